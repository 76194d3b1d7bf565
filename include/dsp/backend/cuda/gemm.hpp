#pragma once
// General matrix multiply through cuBLAS (cublasGemmEx): fp32 in and out, bf16 in with fp32 or
// bf16 out, or fp16 in with fp32 out; always fp32 accumulation (CUBLAS_COMPUTE_32F, which never rounds fp32 inputs to
// TF32: that would take CUBLAS_COMPUTE_32F_FAST_TF32 or the TF32 math mode, neither used here).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "dsp/backend/cuda/cublas.hpp"
#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/gemm_args.hpp"
#include "dsp/core/dtype.hpp"

namespace dsp::backend {

namespace detail {

inline int cublas_int(std::int64_t v, const char* what) {
  DSP_CHECK(v <= std::numeric_limits<int>::max(), "gemm: ", what, "=", v, " exceeds cuBLAS's int range");
  return static_cast<int>(v);
}

/// Row-major C[m, n] = alpha op(A) op(B) + beta C with element types given as cudaDataType_t.
/// cuBLAS is column-major: a row-major X with row stride ld is the column-major X^T with leading
/// dimension ld, so this computes C^T = op(B)^T op(A)^T, i.e. cuBLAS's (B, A) with the sizes
/// (n, m, k) swapped accordingly.
inline void gemm_ex(Cuda backend, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                    float alpha, const void* a, cudaDataType_t a_type, std::int64_t lda, const void* b,
                    cudaDataType_t b_type, std::int64_t ldb, float beta, void* c, cudaDataType_t c_type,
                    std::int64_t ldc) {
  if (!detail::check_gemm_args(trans_a, trans_b, m, n, k, lda, ldb, ldc)) return;
  cublasHandle_t h = cublas_handle(backend.stream);
  if (k == 0) {  // BLAS: C = beta C, A and B unread (done here: cuBLAS does not document k = 0)
    const std::size_t elem = c_type == CUDA_R_32F ? sizeof(float) : sizeof(bf16);
    if (beta == 0.0f) {
      DSP_CUDA_CHECK(cudaMemset2DAsync(c, std::size_t(ldc) * elem, 0, std::size_t(n) * elem, std::size_t(m),
                                       backend.stream));
    } else if (beta != 1.0f) {
      for (std::int64_t i = 0; i < m; ++i)
        DSP_CUBLAS_CHECK(cublasScalEx(h, cublas_int(n, "n"), &beta, CUDA_R_32F,
                                      static_cast<char*>(c) + std::size_t(i * ldc) * elem, c_type, 1, CUDA_R_32F));
    }
    return;
  }
  DSP_CUBLAS_CHECK(cublasGemmEx(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                cublas_int(n, "n"), cublas_int(m, "m"), cublas_int(k, "k"), &alpha, b, b_type,
                                cublas_int(ldb, "ldb"), a, a_type, cublas_int(lda, "lda"), &beta, c, c_type,
                                cublas_int(ldc, "ldc"), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace detail

/// C[m, n] = alpha * op(A)[m, k] * op(B)[k, n] + beta * C on b.stream, op(X) = X^T when
/// trans_x; the Host gemm's contract (row-major; A stored [m, k] or [k, m] when trans_a, B
/// [k, n] or [n, k] when trans_b; lda/ldb/ldc row strides as stored; beta = 0 ignores C's old
/// contents). fp32 throughout. Throws Error for bad sizes or strides, CudaError when cuBLAS
/// refuses.
inline void gemm(Cuda backend, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                 std::int64_t ldc) {
  detail::gemm_ex(backend, trans_a, trans_b, m, n, k, alpha, a, CUDA_R_32F, lda, b, CUDA_R_32F, ldb, beta, c,
                  CUDA_R_32F, ldc);
}

/// The same with bf16 A and B (dsp::bf16 has __nv_bfloat16's bits), fp32 accumulation and an
/// fp32 C: the mixed-precision layer's GEMM that keeps its output (or gradient) in fp32.
inline void gemm(Cuda backend, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const bf16* a, std::int64_t lda, const bf16* b, std::int64_t ldb, float beta, float* c,
                 std::int64_t ldc) {
  detail::gemm_ex(backend, trans_a, trans_b, m, n, k, alpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, beta, c,
                  CUDA_R_32F, ldc);
}

/// The same with fp16 A and B (dsp::fp16 has __half's bits), fp32 accumulation and an fp32 C.
inline void gemm(Cuda backend, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const fp16* a, std::int64_t lda, const fp16* b, std::int64_t ldb, float beta, float* c,
                 std::int64_t ldc) {
  detail::gemm_ex(backend, trans_a, trans_b, m, n, k, alpha, a, CUDA_R_16F, lda, b, CUDA_R_16F, ldb, beta, c,
                  CUDA_R_32F, ldc);
}

/// The same with bf16 A, B and C: fp32 accumulation, the result rounded once to bf16 (and beta
/// C read from bf16).
inline void gemm(Cuda backend, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const bf16* a, std::int64_t lda, const bf16* b, std::int64_t ldb, float beta, bf16* c,
                 std::int64_t ldc) {
  detail::gemm_ex(backend, trans_a, trans_b, m, n, k, alpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, beta, c,
                  CUDA_R_16BF, ldc);
}

}  // namespace dsp::backend
