#pragma once
// The Host transpose (backend/host/transpose.hpp) on the GPU: one thread per element of a
// grid-stride loop.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/transpose.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/grid_stride.cuh"
#include "dsp/backend/cuda/launch.hpp"

namespace dsp::backend {

namespace detail {
template <int = 0>
__global__ void transpose_kernel(std::int64_t rows, std::int64_t cols, const float* src, std::int64_t ld_src,
                                 float* dst, std::int64_t ld_dst) {
  for (const std::int64_t i : grid_stride(rows * cols)) {
    const std::int64_t r = i / cols, c = i % cols;
    dst[c * ld_dst + r] = src[r * ld_src + c];
  }
}
}  // namespace detail

/// dst[c, r] = src[r, c] for r < rows, c < cols on b.stream (device pointers; src [rows, cols]
/// with row stride ld_src, dst [cols, rows] with row stride ld_dst; only the addressed block of
/// dst is written). Throws CudaError when the launch fails.
inline void transpose(Cuda b, std::int64_t rows, std::int64_t cols, const float* src, std::int64_t ld_src, float* dst,
                      std::int64_t ld_dst) {
  if (rows * cols == 0) return;
  detail::transpose_kernel<<<detail::elementwise_blocks(rows * cols), detail::kBlockThreads, 0, b.stream>>>(
      rows, cols, src, ld_src, dst, ld_dst);
  DSP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsp::backend
