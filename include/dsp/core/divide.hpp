#pragma once
// Checked integer division, as Megatron-Core's `divide`: sizes that must split evenly.
#include <cstdint>
#include <string>
#include <string_view>

#include "dsp/core/error.hpp"

namespace dsp {

/// numerator / denominator; throws ConfigError naming both numbers and what they are when the
/// division is not exact ("hidden size (128) is not divisible by tensor-model-parallel-size (3)";
/// without divisor_what "... is not divisible by 3") or the denominator is not positive.
inline std::int64_t divide(std::int64_t numerator, std::int64_t denominator, std::string_view what = "value",
                           std::string_view divisor_what = {}) {
  const bool named = !divisor_what.empty();  // the messages are built only on failure
  DSP_CHECK_AS(ConfigError, denominator > 0, named ? std::string(divisor_what) : detail::concat(what, ": divisor"),
               " must be positive, got ", denominator);
  DSP_CHECK_AS(ConfigError, numerator % denominator == 0, what, " (", numerator, ") is not divisible by ",
               named ? detail::concat(divisor_what, " (", denominator, ")") : std::to_string(denominator));
  return numerator / denominator;
}

/// Smallest multiple of `multiple` that is >= value.
inline std::int64_t round_up(std::int64_t value, std::int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

}  // namespace dsp
