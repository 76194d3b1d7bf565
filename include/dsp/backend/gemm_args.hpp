#pragma once
// The argument checks of the GEMM contract (row-major C[m, n] = alpha op(A) op(B) + beta C),
// shared by every backend's gemm.
#include <algorithm>
#include <cstdint>

#include "dsp/core/error.hpp"

namespace dsp::backend::detail {

/// Throws Error for a negative size or a row stride shorter than the row it strides (A stored
/// [m, k], or [k, m] when trans_a; B [k, n], or [n, k] when trans_b; C [m, n]). Returns false
/// when C is empty (m or n is 0): nothing to compute, and no pointer may be touched.
inline bool check_gemm_args(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                            std::int64_t lda, std::int64_t ldb, std::int64_t ldc) {
  DSP_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm: negative size m=", m, " n=", n, " k=", k);
  if (m == 0 || n == 0) return false;
  DSP_CHECK(lda >= std::max<std::int64_t>(1, trans_a ? m : k), "gemm: lda=", lda, " too small");
  DSP_CHECK(ldb >= std::max<std::int64_t>(1, trans_b ? k : n), "gemm: ldb=", ldb, " too small");
  DSP_CHECK(ldc >= n, "gemm: ldc=", ldc, " too small");
  return true;
}

}  // namespace dsp::backend::detail
