#pragma once
// AdamW update (Loshchilov & Hutter 2019, "Decoupled weight decay regularization",
// Algorithm 2) with bias correction (Kingma & Ba 2015):
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= lr * (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * p)
#include <cmath>
#include <cstdint>

#include "dsp/backend/host/host.hpp"
#include "dsp/core/host_device.hpp"

namespace dsp::backend {

namespace detail {
/// The per-step constants of an AdamW update: the hyperparameters and the bias corrections,
/// computed once per step in fp64 and rounded to fp32.
struct AdamwStep {
  float lr, beta1, beta2, eps, weight_decay;
  float step_size;     ///< lr / (1 - beta1^step)
  float inv_sqrt_bc2;  ///< 1 / sqrt(1 - beta2^step)
};
inline AdamwStep adamw_step(float lr, float beta1, float beta2, float eps, float weight_decay, std::int64_t step) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  return {lr, beta1, beta2, eps, weight_decay, static_cast<float>(lr / bc1), static_cast<float>(1.0 / std::sqrt(bc2))};
}
/// One parameter's update (the formula at the top of this file).
DSP_HOST_DEVICE inline void adamw_element(const AdamwStep& s, float& p, float g, float& m, float& v) {
  m = s.beta1 * m + (1.0f - s.beta1) * g;
  v = s.beta2 * v + (1.0f - s.beta2) * g * g;
  p -= s.step_size * m / (std::sqrt(v) * s.inv_sqrt_bc2 + s.eps) + s.lr * s.weight_decay * p;
}
}  // namespace detail

/// Updates n parameters in place. p, m, v [n] are overwritten; g [n] is read. step >= 1 is
/// the 1-based optimizer step used for bias correction.
inline void adamw_update(Host, std::int64_t n, float* p, const float* g, float* m, float* v, float lr, float beta1,
                         float beta2, float eps, float weight_decay, std::int64_t step) {
  const detail::AdamwStep s = detail::adamw_step(lr, beta1, beta2, eps, weight_decay, step);
  for (std::int64_t i = 0; i < n; ++i) detail::adamw_element(s, p[i], g[i], m[i], v[i]);
}

}  // namespace dsp::backend
