#pragma once
// Rotary position embedding (Su et al. 2021, "RoFormer"), in the Hugging Face Llama/DeepSeek
// "rotate_half" layout: element i of a head is paired with element i + head_dim/2 and the
// pair is rotated by angle = position * inv_freq[i], inv_freq[i] = theta^(-2i/head_dim).
#include <cmath>
#include <cstdint>
#include <vector>

#include "dsp/backend/host/host.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/host_device.hpp"

namespace dsp::backend {

namespace detail {
/// inv_freq[i] = theta^(-2i/head_dim), in fp64: the rotation speed of pair i.
DSP_HOST_DEVICE inline double rope_inv_freq(std::int64_t i, std::int64_t head_dim, float theta) {
  return std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
}

/// Rotates every pair of x [tokens, heads, head_dim] by sign * angle into y (y == x allowed).
/// Angles and their sin/cos are computed in fp64 (Hugging Face computes them in fp32; the
/// two differ by at most about position * 2^-24 radians).
inline void rope_rotate(const float* x, const std::int32_t* positions, std::int64_t tokens, std::int64_t heads,
                        std::int64_t head_dim, float theta, double sign, float* y) {
  DSP_CHECK(head_dim % 2 == 0, "rope: head_dim must be even, got ", head_dim);
  const std::int64_t half = head_dim / 2;
  std::vector<double> inv_freq(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i) inv_freq[i] = rope_inv_freq(i, head_dim, theta);
  std::vector<float> cos_t(static_cast<std::size_t>(half)), sin_t(static_cast<std::size_t>(half));
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = sign * positions[t] * inv_freq[i];
      cos_t[i] = static_cast<float>(std::cos(angle));
      sin_t[i] = static_cast<float>(std::sin(angle));
    }
    for (std::int64_t hd = 0; hd < heads; ++hd) {
      const float* xh = x + (t * heads + hd) * head_dim;
      float* yh = y + (t * heads + hd) * head_dim;
      for (std::int64_t i = 0; i < half; ++i) {
        const float x1 = xh[i], x2 = xh[i + half];
        yh[i] = x1 * cos_t[i] - x2 * sin_t[i];
        yh[i + half] = x2 * cos_t[i] + x1 * sin_t[i];
      }
    }
  }
}
}  // namespace detail

/// y [tokens, heads, head_dim] = RoPE(x [tokens, heads, head_dim]) at positions [tokens]:
/// for i < head_dim/2, (y[i], y[i + head_dim/2]) = (x1 cos a - x2 sin a, x2 cos a + x1 sin a),
/// a = positions[t] * theta^(-2i/head_dim) (HF `q * cos + rotate_half(q) * sin`).
/// Overwrites y; in place (y == x) allowed. head_dim must be even.
inline void rope_forward(Host, const float* x, const std::int32_t* positions, std::int64_t tokens,
                         std::int64_t heads, std::int64_t head_dim, float theta, float* y) {
  detail::rope_rotate(x, positions, tokens, heads, head_dim, theta, 1.0, y);
}

/// dx [tokens, heads, head_dim] from dy [tokens, heads, head_dim]: the transpose of a rotation
/// is the rotation by -angle. Overwrites dx; in place (dx == dy) allowed.
inline void rope_backward(Host, const float* dy, const std::int32_t* positions, std::int64_t tokens,
                          std::int64_t heads, std::int64_t head_dim, float theta, float* dx) {
  detail::rope_rotate(dy, positions, tokens, heads, head_dim, theta, -1.0, dx);
}

}  // namespace dsp::backend
