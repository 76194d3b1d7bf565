#pragma once
// Logistic sigmoid on the GPU, the Host op's contract (backend/host/sigmoid.hpp), with the shared
// detail::sigmoid.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/sigmoid.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/grid_stride.cuh"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/backend/host/sigmoid.hpp"

namespace dsp::backend {

namespace detail {
template <int = 0>
__global__ void sigmoid_forward_kernel(std::int64_t n, const float* x, float* y) {
  for (const std::int64_t i : grid_stride(n))
    y[i] = sigmoid(x[i]);
}
template <int = 0>
__global__ void sigmoid_backward_kernel(std::int64_t n, const float* y, const float* dy, float* dx) {
  for (const std::int64_t i : grid_stride(n))
    dx[i] = dy[i] * y[i] * (1.0f - y[i]);
}
}  // namespace detail

/// The Host sigmoid_forward on b.stream: y [n] = 1 / (1 + exp(-x [n])). y == x allowed.
inline void sigmoid_forward(Cuda b, std::int64_t n, const float* x, float* y) {
  if (n == 0) return;
  detail::sigmoid_forward_kernel<<<detail::elementwise_blocks(n), detail::kBlockThreads, 0, b.stream>>>(n, x, y);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host sigmoid_backward on b.stream: dx [n] = dy [n] * y (1 - y). dx == dy allowed.
inline void sigmoid_backward(Cuda b, std::int64_t n, const float* y, const float* dy, float* dx) {
  if (n == 0) return;
  detail::sigmoid_backward_kernel<<<detail::elementwise_blocks(n), detail::kBlockThreads, 0, b.stream>>>(n, y, dy,
                                                                                                       dx);
  DSP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsp::backend
