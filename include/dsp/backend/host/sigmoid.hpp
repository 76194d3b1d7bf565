#pragma once
// Logistic sigmoid, elementwise (DeepSeek-V3 router scores; SiLU is built on it).
#include <cmath>
#include <cstdint>

#include "dsp/backend/host/host.hpp"
#include "dsp/core/host_device.hpp"

namespace dsp::backend {

namespace detail {
/// 1 / (1 + e^-x); saturates to exactly 0 or 1 for |x| > ~88 without producing NaN.
DSP_HOST_DEVICE inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
}  // namespace detail

/// y [n] = 1 / (1 + exp(-x [n])). Overwrites y; y == x allowed.
inline void sigmoid_forward(Host, std::int64_t n, const float* x, float* y) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = detail::sigmoid(x[i]);
}

/// dx [n] = dy [n] * y (1 - y) from the forward's output y [n]. Overwrites dx; dx == dy allowed.
inline void sigmoid_backward(Host, std::int64_t n, const float* y, const float* dy, float* dx) {
  for (std::int64_t i = 0; i < n; ++i) dx[i] = dy[i] * y[i] * (1.0f - y[i]);
}

}  // namespace dsp::backend
