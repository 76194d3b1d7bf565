#pragma once
// Elementwise vector ops and reductions over flat fp32 buffers (residual adds, gradient
// accumulation and scaling, gradient norms). Level-1 BLAS where it exists.
#include <algorithm>
#include <cstdint>

#include "dsp/backend/host/detail/blas.hpp"
#include "dsp/backend/host/host.hpp"

namespace dsp::backend {

/// y [n] += alpha * x [n] (BLAS saxpy). Accumulates.
inline void axpy(Host, std::int64_t n, float alpha, const float* x, float* y) {
  detail::use_blas_threads();
  cblas_saxpy(detail::blas_int(n), alpha, x, 1, y, 1);
}

/// y [n] += x [n]. Accumulates (residual connections, gradient accumulation).
inline void add(Host h, std::int64_t n, const float* x, float* y) { axpy(h, n, 1.0f, x, y); }

/// y [n] *= alpha (BLAS sscal). In place.
inline void scale(Host, std::int64_t n, float alpha, float* y) {
  detail::use_blas_threads();
  cblas_sscal(detail::blas_int(n), alpha, y, 1);
}

/// y [n] = x [n]. Overwrites y; x == y is allowed, other overlaps are not.
inline void copy(Host, std::int64_t n, const float* x, float* y) {
  if (x != y) std::copy_n(x, n, y);
}

/// y [n] = value. Overwrites y.
inline void fill(Host, std::int64_t n, float value, float* y) { std::fill_n(y, n, value); }

/// sum_i x[i] * y[i] over n elements, products accumulated in fp64 (BLAS dsdot) and the
/// result rounded once to fp32.
inline float dot(Host, std::int64_t n, const float* x, const float* y) {
  detail::use_blas_threads();
  return static_cast<float>(cblas_dsdot(detail::blas_int(n), x, 1, y, 1));
}

/// sum_i weight[i] * x[i]^2 over n elements, accumulated and returned in fp64 (the partial
/// sums of a gradient norm, all-reduced across ranks before the sqrt). weight may be nullptr
/// (all ones); otherwise per-element weights, typically 0/1 so that an element replicated on
/// several ranks is counted by one of them only.
inline double sum_squares(Host, std::int64_t n, const float* x, const float* weight) {
  if (weight == nullptr) {
    detail::use_blas_threads();
    return cblas_dsdot(detail::blas_int(n), x, 1, x, 1);
  }
  double acc = 0.0;
  for (std::int64_t i = 0; i < n; ++i) acc += static_cast<double>(weight[i]) * x[i] * x[i];
  return acc;
}

}  // namespace dsp::backend
