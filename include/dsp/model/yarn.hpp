#pragma once
// RoPE frequencies with YaRN context extension (Peng et al. 2023, "YaRN: Efficient Context
// Window Extension of Large Language Models"), as DeepSeek-V2/V3 configure it (config.json
// `rope_scaling` / transformers 5's `rope_parameters` with rope_type "yarn").
// Formulas as transformers 5.25 computes them (modeling_rope_utils.py, _compute_yarn_parameters;
// modeling_deepseek_v3.py, yarn_get_mscale and DeepseekV3Attention.scaling):
//   pos_freqs[i]  = theta^(2i / dim), i < dim/2
//   extrapolation = 1 / pos_freqs, interpolation = 1 / (factor pos_freqs)
//   correction_dim(r) = dim ln(original_max / (2 pi r)) / (2 ln theta)
//   low = max(floor(correction_dim(beta_fast)), 0), high = min(ceil(correction_dim(beta_slow)), dim - 1)
//   ramp[i] = clamp((i - low) / (high - low), 0, 1)   (high += 0.001 when low == high)
//   inv_freq[i] = interpolation[i] ramp[i] + extrapolation[i] (1 - ramp[i])
//   attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
//                      (get_mscale(factor) when either is 0), get_mscale(s, m) = 1 (s <= 1) or 0.1 m ln(s) + 1
//   cos, sin are multiplied by attention_factor (so q_pe . k_pe carries its square), and the
//   softmax scale is 1 / sqrt(qk_head_dim) x get_mscale(factor, mscale_all_dim)^2.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <vector>

#include "dsp/core/error.hpp"

namespace dsp::model {

/// config.json `rope_scaling` (transformers 5: `rope_parameters`) for YaRN; type "" is plain RoPE.
struct RopeScaling {
  std::string type;                               ///< "" (none) or "yarn"
  double factor = 1.0;                            ///< context extension factor s
  std::int64_t original_max_position_embeddings = 0;  ///< the pre-training context L
  double beta_fast = 32.0;                        ///< rotations above which a pair extrapolates
  double beta_slow = 1.0;                         ///< rotations below which a pair interpolates
  double mscale = 1.0;                            ///< the cos/sin factor's numerator exponent (0: unset)
  double mscale_all_dim = 0.0;                    ///< its denominator and the softmax correction (0: unset)

  bool is_yarn() const { return type == "yarn"; }
  /// Throws ConfigError naming the field unless type is "" or "yarn" with factor >= 1,
  /// original_max_position_embeddings > 0 and beta_fast > beta_slow > 0.
  void validate() const {
    DSP_CHECK_AS(ConfigError, type.empty() || type == "yarn", "rope_scaling type must be yarn (or absent), got '",
                 type, "'");
    if (!is_yarn()) return;
    DSP_CHECK_AS(ConfigError, factor >= 1.0, "rope_scaling factor must be >= 1, got ", factor);
    DSP_CHECK_AS(ConfigError, original_max_position_embeddings > 0,
                 "rope_scaling original_max_position_embeddings must be positive, got ",
                 original_max_position_embeddings);
    DSP_CHECK_AS(ConfigError, beta_fast > beta_slow && beta_slow > 0, "rope_scaling needs beta_fast > beta_slow > 0, got ",
                 beta_fast, " and ", beta_slow);
  }
  bool operator==(const RopeScaling&) const = default;
};

/// YaRN's magnitude correction 0.1 m ln(s) + 1 for a scale s > 1, else 1
/// (transformers' yarn_get_mscale / get_mscale).
inline double yarn_get_mscale(double scale, double mscale = 1.0) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

/// The rotation speed of each pair of a rotary slice and the factor on its cos/sin.
struct RopeFrequencies {
  std::vector<double> inv_freq;   ///< [dim/2] radians per position
  double attention_factor = 1.0;  ///< multiplies cos and sin (YaRN), 1 for plain RoPE
};

/// RoPE frequencies of a rotary slice of `dim` (even) values with base theta, YaRN-scaled when
/// `s` is yarn (formulas above). Throws ConfigError when dim is odd or not positive.
inline RopeFrequencies rope_frequencies(std::int64_t dim, double theta, const RopeScaling& s) {
  DSP_CHECK_AS(ConfigError, dim > 0 && dim % 2 == 0, "rotary dimension must be positive and even, got ", dim);
  s.validate();
  const std::int64_t half = dim / 2;
  const auto d = static_cast<double>(dim);
  RopeFrequencies f;
  f.inv_freq.resize(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i) f.inv_freq[i] = std::pow(theta, -2.0 * static_cast<double>(i) / d);
  if (!s.is_yarn()) return f;
  const auto original = static_cast<double>(s.original_max_position_embeddings);
  auto correction_dim = [&](double rotations) {
    return d * std::log(original / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(theta));
  };
  const double low = std::max(std::floor(correction_dim(s.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(s.beta_slow)), d - 1.0);
  if (low == high) high += 0.001;
  for (std::int64_t i = 0; i < half; ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    f.inv_freq[i] = f.inv_freq[i] / s.factor * ramp + f.inv_freq[i] * (1.0 - ramp);
  }
  f.attention_factor = s.mscale != 0.0 && s.mscale_all_dim != 0.0
                           ? yarn_get_mscale(s.factor, s.mscale) / yarn_get_mscale(s.factor, s.mscale_all_dim)
                           : yarn_get_mscale(s.factor);
  return f;
}

/// The softmax scale of MLA: 1 / sqrt(qk_head_dim), times get_mscale(factor, mscale_all_dim)^2
/// under YaRN with mscale_all_dim set (DeepSeek-V2 paper's YaRN setup; DeepseekV3Attention.scaling).
inline double mla_softmax_scale(std::int64_t qk_head_dim, const RopeScaling& s) {
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim));
  if (s.is_yarn() && s.mscale_all_dim != 0.0) {
    const double m = yarn_get_mscale(s.factor, s.mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

}  // namespace dsp::model
