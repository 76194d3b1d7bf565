#pragma once
// AdamW update (Loshchilov & Hutter 2019, "Decoupled weight decay regularization",
// Algorithm 2) with bias correction (Kingma & Ba 2015):
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= lr * (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * p)
#include <cmath>
#include <cstdint>

#include "dsp/backend/host/host.hpp"

namespace dsp::backend {

/// Updates n parameters in place. p, m, v [n] are overwritten; g [n] is read. step >= 1 is
/// the 1-based optimizer step used for bias correction.
inline void adamw_update(Host, std::int64_t n, float* p, const float* g, float* m, float* v, float lr, float beta1,
                         float beta2, float eps, float weight_decay, std::int64_t step) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  const float step_size = static_cast<float>(lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  for (std::int64_t i = 0; i < n; ++i) {
    m[i] = beta1 * m[i] + (1.0f - beta1) * g[i];
    v[i] = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];
    p[i] -= step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps) + lr * weight_decay * p[i];
  }
}

}  // namespace dsp::backend
