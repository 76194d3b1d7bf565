#pragma once
// Megatron's --split: "969,30,1" (or "969/30/1") weights of the train, validation and test
// parts of a dataset, normalised, and the [begin, end) range of elements (for GPT: sequences)
// each part gets. Follows megatron-core (checked against 0.16.1):
//   blended_megatron_dataset_config.py  parse_and_normalize_split (missing weights are 0),
//                                       convert_split_vector_to_split_matrix (book-ends)
//   utils.py                            normalize (w / sum(w), float64)
//   blended_megatron_dataset_builder.py _build_megatron_dataset_splits:
//                                       begin = int(round(lo * n)), end = int(round(hi * n))
// Python's round is round-half-to-even; so is round_half_even here.
#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dsp/core/error.hpp"

namespace dsp::data {

/// The three parts of a split, in Megatron's order (megatron/core/datasets/utils.py Split).
enum class Split : int { train = 0, valid = 1, test = 2 };

/// [begin, end) element indices of one part.
struct SplitRange {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
  bool operator==(const SplitRange&) const = default;
};

/// Rounds to the nearest integer, ties to even, as Python's round(float) does.
inline double round_half_even(double x) {
  const double r = std::round(x);  // ties away from zero
  if (std::abs(x - std::trunc(x)) == 0.5) return 2.0 * std::round(x / 2.0);
  return r;
}

/// Parses "969,30,1" / "969/30/1" / "99,1" into train, valid, test weights normalised to sum 1
/// (one or two numbers: the rest are 0, as in Megatron). Spaces around numbers are allowed.
/// Throws ConfigError naming the string when it holds no number or more than three, a part is
/// not a non-negative decimal number (e.g. "-1", "a", an empty part), or all weights are 0.
inline std::array<double, 3> parse_and_normalize_split(std::string_view text) {
  const std::string quoted = "--split '" + std::string(text) + "'";
  std::vector<double> w;
  std::size_t start = 0;
  while (true) {
    const auto stop = text.find_first_of(",/", start);
    std::string_view part = text.substr(start, stop == std::string_view::npos ? std::string_view::npos : stop - start);
    while (!part.empty() && part.front() == ' ') part.remove_prefix(1);
    while (!part.empty() && part.back() == ' ') part.remove_suffix(1);
    double v = 0;
    const auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), v, std::chars_format::fixed);
    DSP_CHECK_AS(ConfigError,
                 !part.empty() && part.find_first_not_of("0123456789.") == std::string_view::npos &&
                     ec == std::errc() && end == part.data() + part.size() && std::isfinite(v),
                 quoted, ": '", std::string(part), "' is not a non-negative number (expected e.g. 969,30,1)");
    w.push_back(v);
    if (stop == std::string_view::npos) break;
    start = stop + 1;
  }
  DSP_CHECK_AS(ConfigError, w.size() <= 3, quoted, " has ", w.size(),
               " weights: a split has at most 3 (train, validation, test)");
  w.resize(3, 0.0);
  const double sum = w[0] + w[1] + w[2];  // numpy.sum of 3 float64: sequential
  DSP_CHECK_AS(ConfigError, sum > 0, quoted, ": all weights are 0");
  return {w[0] / sum, w[1] / sum, w[2] / sum};
}

/// The element ranges of the three parts of `num_elements` elements for normalised weights
/// (from parse_and_normalize_split). A part whose book-ends do not overlap (weight 0, up to
/// float rounding) is std::nullopt: Megatron builds no dataset for it. A part with a weight
/// may still round to an empty range. Throws ConfigError when num_elements is negative.
inline std::array<std::optional<SplitRange>, 3> split_ranges(const std::array<double, 3>& weights,
                                                              std::int64_t num_elements) {
  DSP_CHECK_AS(ConfigError, num_elements >= 0, "cannot split ", num_elements, " elements");
  const std::array<double, 4> ends{0.0, weights[0], weights[0] + weights[1], weights[0] + weights[1] + weights[2]};
  std::array<std::optional<SplitRange>, 3> out;
  const auto n = static_cast<double>(num_elements);
  for (int k = 0; k < 3; ++k) {
    if (ends[k + 1] <= ends[k]) continue;  // min(hi, hi) <= max(lo, lo): no overlap, None
    out[k] = SplitRange{static_cast<std::int64_t>(round_half_even(ends[k] * n)),
                        static_cast<std::int64_t>(round_half_even(ends[k + 1] * n))};
  }
  return out;
}

/// parse_and_normalize_split then split_ranges: --split TEXT over num_elements elements.
inline std::array<std::optional<SplitRange>, 3> split_ranges(std::string_view text, std::int64_t num_elements) {
  return split_ranges(parse_and_normalize_split(text), num_elements);
}

}  // namespace dsp::data
