#pragma once
// General matrix multiply through CBLAS (OpenBLAS).
#include <algorithm>
#include <cstdint>

#include "dsp/backend/host/detail/blas.hpp"
#include "dsp/backend/host/host.hpp"
#include "dsp/core/error.hpp"

namespace dsp::backend {

/// C[m, n] = alpha * op(A)[m, k] * op(B)[k, n] + beta * C, op(X) = X^T when trans_x.
/// All matrices row-major; A is stored [m, k] (or [k, m] when trans_a), B [k, n] (or [n, k]
/// when trans_b); lda/ldb/ldc are the row strides of A, B, C as stored. beta = 0 overwrites
/// C (its old contents, even NaN, are ignored); beta = 1 accumulates. BLAS sgemm semantics.
inline void gemm(Host, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                 std::int64_t ldc) {
  DSP_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm: negative size m=", m, " n=", n, " k=", k);
  if (m == 0 || n == 0) return;
  DSP_CHECK(lda >= std::max<std::int64_t>(1, trans_a ? m : k), "gemm: lda=", lda, " too small");
  DSP_CHECK(ldb >= std::max<std::int64_t>(1, trans_b ? k : n), "gemm: ldb=", ldb, " too small");
  DSP_CHECK(ldc >= n, "gemm: ldc=", ldc, " too small");
  detail::use_blas_threads();
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              detail::blas_int(m), detail::blas_int(n), detail::blas_int(k), alpha, a, detail::blas_int(lda), b,
              detail::blas_int(ldb), beta, c, detail::blas_int(ldc));
}

}  // namespace dsp::backend
