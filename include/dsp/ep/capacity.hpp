#pragma once
// Expert capacity and token dropping. Dropless by default; with a capacity factor each expert
// takes at most ceil(factor * tokens * k / E) of the batch's (token, slot) assignments
// (Megatron-Core get_capacity over tokens * topk), never more than the tokens. Dropped
// assignments keep their expert index (so the balance loss, computed before dropping, does not
// change) but get kept = 0 and gate weight 0.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dsp/ep/router.hpp"

namespace dsp::ep {

/// Assignments an expert may take: ceil(capacity_factor * tokens * top_k / num_experts)
/// (fp64), at most tokens (a token picks an expert once, so `tokens` never drops anything).
/// capacity_factor <= 0 means dropless and returns tokens. Throws ConfigError for a NaN
/// factor, negative tokens, or top_k / num_experts < 1.
inline std::int64_t expert_capacity(float capacity_factor, std::int64_t tokens, std::int64_t top_k,
                                    std::int64_t num_experts) {
  DSP_CHECK_AS(ConfigError, !std::isnan(capacity_factor), "expert capacity factor is NaN");
  DSP_CHECK_AS(ConfigError, tokens >= 0 && top_k >= 1 && num_experts >= 1, "expert capacity: tokens (", tokens,
               ") must be >= 0, top_k (", top_k, ") and num_experts (", num_experts, ") >= 1");
  if (capacity_factor <= 0.0f) return tokens;
  const double cap = std::ceil(double(capacity_factor) * double(tokens) * double(top_k) / double(num_experts));
  return cap >= double(tokens) ? tokens : static_cast<std::int64_t>(cap);
}

/// Which assignments an over-full expert keeps: its highest gate weights (ties to the earlier
/// token), or its earliest tokens.
enum class DropPolicy { Probability, Position };

/// What apply_capacity dropped.
struct Dropped {
  std::vector<std::int64_t> dropped_per_expert;  ///< [E] assignments dropped per expert
  std::int64_t dropped = 0;                      ///< their sum
};

/// Keeps at most `capacity` of each expert's still-kept assignments (policy above); the rest
/// get r.kept = 0 and r.weights = 0, r.experts unchanged. Idempotent for one capacity.
/// Throws Error for a negative capacity.
template <class Backend = backend::Host>
Dropped apply_capacity(Routing& r, std::int64_t capacity, DropPolicy policy) {
  DSP_CHECK(capacity >= 0, "apply_capacity: capacity must be >= 0, got ", capacity);
  Dropped d;
  d.dropped_per_expert.resize(static_cast<std::size_t>(r.num_experts));
  d.dropped = capacity_drop(Backend{}, r.experts.data(), r.tokens, r.top_k, r.num_experts, capacity,
                            policy == DropPolicy::Probability, r.weights.data(), r.kept.data(),
                            d.dropped_per_expert.data());
  return d;
}

}  // namespace dsp::ep
