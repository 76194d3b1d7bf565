#pragma once
// Rotary position embedding on interleaved pairs, DeepSeek's layout (DeepSeek-V2/V3 reference
// code, `view_as_complex(x.view(..., -1, 2)) * freqs_cis`; transformers' DeepseekV2
// apply_rotary_emb): pair i of a rotary slice is (x[2i], x[2i+1]), unlike Llama's rotate-half
// pairs (x[i], x[i + dim/2]) of backend/host/rope.hpp. With YaRN the rotation is scaled by an
// attention factor (model/yarn.hpp).
#include <cmath>
#include <cstdint>
#include <vector>

#include "dsp/backend/host/host.hpp"
#include "dsp/core/error.hpp"

namespace dsp::backend {

/// The rotary slices a rope op works on in place: tokens x heads vectors of `dim` values, the
/// vector of (t, h) at data + t * token_stride + h * head_stride (the rope part of each head of
/// an MLA query: data = q + nope, head_stride = nope + rope).
struct RotarySlices {
  float* data = nullptr;
  std::int64_t tokens = 0, heads = 1, dim = 0, token_stride = 0, head_stride = 0;
};

namespace detail {
/// Rotates every interleaved pair of s by sign * angle and multiplies by factor, where
/// angle = positions[t] * inv_freq[i]; angles, sin and cos in fp64 (transformers computes them
/// in fp32: they differ by about position * 2^-24 radians).
inline void rope_interleaved_rotate(const RotarySlices& s, const std::int32_t* positions, const double* inv_freq,
                                    double factor, double sign) {
  DSP_CHECK(s.dim % 2 == 0 && s.dim > 0, "interleaved rope: the rotary dim must be positive and even, got ", s.dim);
  const std::int64_t half = s.dim / 2;
  std::vector<float> cos_t(static_cast<std::size_t>(half)), sin_t(static_cast<std::size_t>(half));
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = sign * positions[t] * inv_freq[i];
      cos_t[i] = static_cast<float>(factor * std::cos(angle));
      sin_t[i] = static_cast<float>(factor * std::sin(angle));
    }
    for (std::int64_t h = 0; h < s.heads; ++h) {
      float* x = s.data + t * s.token_stride + h * s.head_stride;
      for (std::int64_t i = 0; i < half; ++i) {
        const float x1 = x[2 * i], x2 = x[2 * i + 1];
        x[2 * i] = x1 * cos_t[i] - x2 * sin_t[i];
        x[2 * i + 1] = x2 * cos_t[i] + x1 * sin_t[i];
      }
    }
  }
}
}  // namespace detail

/// In place on s: (x[2i], x[2i+1]) <- factor (x1 cos a - x2 sin a, x2 cos a + x1 sin a),
/// a = positions[t] * inv_freq[i], for i < dim/2. positions [tokens]; inv_freq [dim/2]
/// (model::rope_frequencies). Throws Error when dim is odd.
inline void rope_interleaved_forward(Host, const RotarySlices& s, const std::int32_t* positions,
                                     const double* inv_freq, double factor) {
  detail::rope_interleaved_rotate(s, positions, inv_freq, factor, 1.0);
}

/// The transpose of rope_interleaved_forward, in place on the gradient slices s: the rotation
/// by -a times the same factor.
inline void rope_interleaved_backward(Host, const RotarySlices& s, const std::int32_t* positions,
                                      const double* inv_freq, double factor) {
  detail::rope_interleaved_rotate(s, positions, inv_freq, factor, -1.0);
}

}  // namespace dsp::backend
