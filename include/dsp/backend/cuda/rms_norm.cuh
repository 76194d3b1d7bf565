#pragma once
// RMSNorm on the GPU, the Host op's contract (backend/host/rms_norm.hpp): one block per token
// for the forward and the input gradient (sums in fp64 as on the host), one thread per hidden
// column for the weight gradient (summed over tokens in token order, as on the host).
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/rms_norm.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/grid_stride.cuh"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/backend/cuda/reduce.cuh"

namespace dsp::backend {

namespace detail {

template <int = 0>
__global__ void rms_norm_forward_kernel(const float* x, const float* w, float eps, std::int64_t hidden, float* y,
                                        float* rstd) {
  const float* xt = x + blockIdx.x * hidden;
  float* yt = y + blockIdx.x * hidden;
  double ss = 0.0;
  for (std::int64_t j = threadIdx.x; j < hidden; j += blockDim.x) ss += double(xt[j]) * xt[j];
  ss = block_sum(ss);
  const float r = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(hidden) + eps));
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  for (std::int64_t j = threadIdx.x; j < hidden; j += blockDim.x) yt[j] = xt[j] * r * w[j];
}

template <int = 0>
__global__ void rms_norm_backward_input_kernel(const float* x, const float* w, const float* rstd, const float* dy,
                                               std::int64_t hidden, float* dx) {
  const float* xt = x + blockIdx.x * hidden;
  const float* dyt = dy + blockIdx.x * hidden;
  float* dxt = dx + blockIdx.x * hidden;
  const float r = rstd[blockIdx.x];
  double c = 0.0;
  for (std::int64_t j = threadIdx.x; j < hidden; j += blockDim.x) c += double(dyt[j]) * w[j] * xt[j];
  c = block_sum(c);
  const float k = static_cast<float>(c / static_cast<double>(hidden)) * r * r;
  for (std::int64_t j = threadIdx.x; j < hidden; j += blockDim.x) dxt[j] = r * (dyt[j] * w[j] - xt[j] * k);
}

template <int = 0>
__global__ void rms_norm_backward_weight_kernel(const float* x, const float* rstd, const float* dy,
                                                std::int64_t tokens, std::int64_t hidden, float* dw) {
  for (const std::int64_t j : grid_stride(hidden)) {
    float acc = dw[j];
    for (std::int64_t t = 0; t < tokens; ++t) acc += dy[t * hidden + j] * x[t * hidden + j] * rstd[t];
    dw[j] = acc;
  }
}

}  // namespace detail

/// The Host rms_norm_forward on b.stream: y [tokens, hidden] = x * rstd[t] * w [hidden],
/// rstd [tokens] = 1 / sqrt(mean_j x[t, j]^2 + eps). y == x allowed. Device pointers. Throws
/// CudaError when the launch fails.
inline void rms_norm_forward(Cuda b, const float* x, const float* w, float eps, std::int64_t tokens,
                             std::int64_t hidden, float* y, float* rstd) {
  if (tokens == 0) return;
  detail::rms_norm_forward_kernel<<<detail::row_blocks(tokens), detail::kBlockThreads, 0, b.stream>>>(x, w, eps,
                                                                                                    hidden, y, rstd);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host rms_norm_backward on b.stream: overwrites dx [tokens, hidden] (dx == dy allowed) and
/// accumulates into dw [hidden]. dx must not alias x. Throws CudaError when a launch fails.
inline void rms_norm_backward(Cuda b, const float* x, const float* w, const float* rstd, const float* dy,
                              std::int64_t tokens, std::int64_t hidden, float* dx, float* dw) {
  if (tokens == 0) return;
  // dw first: it reads dy, which the input gradient may overwrite (dx == dy).
  detail::rms_norm_backward_weight_kernel<<<detail::elementwise_blocks(hidden), detail::kBlockThreads, 0,
                                            b.stream>>>(x, rstd, dy, tokens, hidden, dw);
  DSP_CUDA_CHECK(cudaGetLastError());
  detail::rms_norm_backward_input_kernel<<<detail::row_blocks(tokens), detail::kBlockThreads, 0, b.stream>>>(
      x, w, rstd, dy, hidden, dx);
  DSP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsp::backend
