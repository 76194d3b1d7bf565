#pragma once
// RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"):
// y = x / sqrt(mean(x^2) + eps) * w, per token over the hidden dimension.
#include <cmath>
#include <cstdint>

#include "dsp/backend/host/host.hpp"

namespace dsp::backend {

/// y [tokens, hidden] = x [tokens, hidden] * rstd[t] * w [hidden], with
/// rstd [tokens] = 1 / sqrt(mean_j x[t, j]^2 + eps) (mean accumulated in fp64) saved for the
/// backward. Overwrites y and rstd; y == x is allowed.
inline void rms_norm_forward(Host, const float* x, const float* w, float eps, std::int64_t tokens,
                             std::int64_t hidden, float* y, float* rstd) {
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* xt = x + t * hidden;
    float* yt = y + t * hidden;
    double ss = 0.0;
    for (std::int64_t j = 0; j < hidden; ++j) ss += static_cast<double>(xt[j]) * xt[j];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(hidden) + eps));
    rstd[t] = r;
    for (std::int64_t j = 0; j < hidden; ++j) yt[j] = xt[j] * r * w[j];
  }
}

/// Gradients of rms_norm_forward given dy [tokens, hidden] and the saved rstd [tokens]:
/// dx[t, j] = r * (dy[t, j] w[j] - x[t, j] r^2 c_t),  c_t = mean_i dy[t, i] w[i] x[t, i],  r = rstd[t];
/// dw[j] += sum_t dy[t, j] x[t, j] r. Overwrites dx (dx == dy is allowed), accumulates into dw.
inline void rms_norm_backward(Host, const float* x, const float* w, const float* rstd, const float* dy,
                              std::int64_t tokens, std::int64_t hidden, float* dx, float* dw) {
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* xt = x + t * hidden;
    const float* dyt = dy + t * hidden;
    float* dxt = dx + t * hidden;
    const float r = rstd[t];
    double c = 0.0;
    for (std::int64_t j = 0; j < hidden; ++j) {
      c += static_cast<double>(dyt[j]) * w[j] * xt[j];
      dw[j] += dyt[j] * xt[j] * r;
    }
    const float k = static_cast<float>(c / static_cast<double>(hidden)) * r * r;
    for (std::int64_t j = 0; j < hidden; ++j) dxt[j] = r * (dyt[j] * w[j] - xt[j] * k);
  }
}

}  // namespace dsp::backend
