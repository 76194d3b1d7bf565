#pragma once
// Elementwise vector ops and reductions over flat fp32 buffers (residual adds, gradient
// accumulation and scaling, gradient norms). Level-1 BLAS where it exists, except for the fp64
// reductions (see detail::dot_fp64).
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

namespace detail {
/// sum_i w[i] x[i] y[i] (w == nullptr: all ones) in fp64, in index order. A product of two
/// floats is exact in fp64, so the accumulation is the only rounding (relative error ~n 1e-16).
/// A loop of our own rather than BLAS dsdot: OpenBLAS picks dsdot's kernel by CPU, and on an AMD
/// Zen 4 development machine it did not meet this accuracy (the reductions test, tolerance
/// 1e-12, failed there and passed on an Intel Xeon).
inline double dot_fp64(std::int64_t n, const float* x, const float* y, const float* w) {
  double acc = 0.0;
  if (w == nullptr)
    for (std::int64_t i = 0; i < n; ++i) acc += static_cast<double>(x[i]) * y[i];
  else
    for (std::int64_t i = 0; i < n; ++i) acc += static_cast<double>(w[i]) * (static_cast<double>(x[i]) * y[i]);
  return acc;
}
}  // namespace detail

/// sum_i x[i] * y[i] over n elements, exact products accumulated in fp64 (detail::dot_fp64), the
/// result rounded once to fp32.
inline float dot(Host, std::int64_t n, const float* x, const float* y) {
  return static_cast<float>(detail::dot_fp64(n, x, y, nullptr));
}

/// sum_i weight[i] * x[i]^2 over n elements, accumulated and returned in fp64 (the partial
/// sums of a gradient norm, all-reduced across ranks before the sqrt). weight may be nullptr
/// (all ones); otherwise per-element weights, typically 0/1 so that an element replicated on
/// several ranks is counted by one of them only.
inline double sum_squares(Host, std::int64_t n, const float* x, const float* weight) {
  return detail::dot_fp64(n, x, x, weight);
}

}  // namespace dsp::backend
