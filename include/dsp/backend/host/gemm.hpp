#pragma once
// General matrix multiply through CBLAS (OpenBLAS).
#include <cstdint>

#include "dsp/backend/gemm_args.hpp"
#include "dsp/backend/host/detail/blas.hpp"
#include "dsp/backend/host/host.hpp"

namespace dsp::backend {

/// C[m, n] = alpha * op(A)[m, k] * op(B)[k, n] + beta * C, op(X) = X^T when trans_x.
/// All matrices row-major; A is stored [m, k] (or [k, m] when trans_a), B [k, n] (or [n, k]
/// when trans_b); lda/ldb/ldc are the row strides of A, B, C as stored. beta = 0 overwrites
/// C (its old contents, even NaN, are ignored); beta = 1 accumulates. BLAS sgemm semantics.
inline void gemm(Host, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                 std::int64_t ldc) {
  if (!detail::check_gemm_args(trans_a, trans_b, m, n, k, lda, ldb, ldc)) return;
  detail::use_blas_threads();
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              detail::blas_int(m), detail::blas_int(n), detail::blas_int(k), alpha, a, detail::blas_int(lda), b,
              detail::blas_int(ldb), beta, c, detail::blas_int(ldc));
}

}  // namespace dsp::backend
