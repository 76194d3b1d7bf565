#pragma once
// The batch-invariant GEMM on the GPU, in the Host kernel's order (backend/host/
// gemm_batch_invariant.hpp): every element of C is one chain of fused multiply-adds over k in
// increasing order from +0 (__fmaf_rn, IEEE's single rounding, as std::fma), so a row of C
// depends on its row of A and on B alone, bitwise, and equals the Host kernel's result bitwise.
// cuBLAS promises neither (its kernel, tile and split-K depend on the shape). A block computes
// a 64 x 64 tile of C with 256 threads of 4 x 4 elements each, staging 16 k of A and B in shared
// memory at a time; tiles change which elements share loads, never an element's chain. A plain
// kernel, not tuned: serving's decode GEMMs are bound by reading the weights once.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/gemm_batch_invariant.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/gemm_args.hpp"
#include "dsp/core/error.hpp"

namespace dsp::backend {

namespace detail {

inline constexpr int kBiTile = 64;    // rows and columns of C per block
inline constexpr int kBiStage = 16;   // k staged in shared memory at a time
inline constexpr int kBiThreads = 256;  // 16 x 16 threads, 4 x 4 elements each

template <int = 0>
__global__ void __launch_bounds__(kBiThreads)
    gemm_nt_batch_invariant_kernel(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                                   const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
  __shared__ float as[kBiStage][kBiTile + 1];  // as[kk][row of the tile]
  __shared__ float bs[kBiStage][kBiTile + 1];  // bs[kk][column of the tile]
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const std::int64_t row0 = std::int64_t(blockIdx.y) * kBiTile, col0 = std::int64_t(blockIdx.x) * kBiTile;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  for (std::int64_t k0 = 0; k0 < k; k0 += kBiStage) {
    for (int e = threadIdx.x; e < kBiTile * kBiStage; e += kBiThreads) {
      const int r = e / kBiStage, kk = e % kBiStage;
      const std::int64_t gk = k0 + kk, ga = row0 + r, gb = col0 + r;
      as[kk][r] = ga < m && gk < k ? a[ga * lda + gk] : 0.0f;
      bs[kk][r] = gb < n && gk < k ? b[gb * ldb + gk] : 0.0f;
    }
    __syncthreads();
    // Only the k that exist: an fma of padding could turn a -0 sum into +0.
    const int staged = k - k0 < kBiStage ? static_cast<int>(k - k0) : kBiStage;
    for (int kk = 0; kk < staged; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = as[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = __fmaf_rn(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t r = row0 + ty + 16 * i, col = col0 + tx + 16 * j;
      if (r < m && col < n) c[r * ldc + col] = acc[i][j];
    }
}

}  // namespace detail

/// C[m, n] = A[m, k] B[n, k]^T on b.stream (device pointers; row-major with row strides lda,
/// ldb, ldc; A [tokens, in] activations, B [out, in] a linear layer's weight). Overwrites C.
/// Every element is the Host kernel's fma chain (the top of this file): a row of C depends on
/// its row of A and on B alone, bitwise, and equals the Host op's. Throws Error for negative
/// sizes, short strides or more than 65535 x 64 rows (the grid), CudaError when the launch fails.
inline void gemm_nt_batch_invariant(Cuda backend, std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
                                    std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
  if (!detail::check_gemm_args(false, true, m, n, k, lda, ldb, ldc)) return;
  const std::int64_t row_tiles = (m + detail::kBiTile - 1) / detail::kBiTile;
  const std::int64_t col_tiles = (n + detail::kBiTile - 1) / detail::kBiTile;
  DSP_CHECK(row_tiles <= 65535 && col_tiles <= std::numeric_limits<std::int32_t>::max(),
            "gemm_nt_batch_invariant (CUDA): m=", m, " n=", n, " exceed the grid (at most 65535 x 64 rows)");
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(row_tiles));
  detail::gemm_nt_batch_invariant_kernel<<<grid, detail::kBiThreads, 0, backend.stream>>>(m, n, k, a, lda, b, ldb, c,
                                                                                          ldc);
  DSP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsp::backend
