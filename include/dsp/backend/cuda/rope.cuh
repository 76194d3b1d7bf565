#pragma once
// Rotary position embedding on the GPU, the Host op's contract (backend/host/rope.hpp): one
// thread per rotated pair, angles and their sin/cos in fp64 from the shared
// detail::rope_inv_freq.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/rope.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/grid_stride.cuh"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/backend/host/rope.hpp"

namespace dsp::backend {

namespace detail {

template <int = 0>
__global__ void rope_rotate_kernel(const float* x, const std::int32_t* positions, std::int64_t tokens,
                                   std::int64_t heads, std::int64_t head_dim, float theta, double sign, float* y) {
  const std::int64_t half = head_dim / 2, pairs = tokens * heads * half;
  for (const std::int64_t p : grid_stride(pairs)) {
    const std::int64_t i = p % half, row = p / half, t = row / heads;  // row = t * heads + head
    const double angle = sign * positions[t] * rope_inv_freq(i, head_dim, theta);
    const float c = static_cast<float>(cos(angle)), s = static_cast<float>(sin(angle));
    const float* xh = x + row * head_dim;
    float* yh = y + row * head_dim;
    const float x1 = xh[i], x2 = xh[i + half];
    yh[i] = x1 * c - x2 * s;
    yh[i + half] = x2 * c + x1 * s;
  }
}

inline void rope_rotate(Cuda b, const float* x, const std::int32_t* positions, std::int64_t tokens, std::int64_t heads,
                        std::int64_t head_dim, float theta, double sign, float* y) {
  DSP_CHECK(head_dim % 2 == 0, "rope: head_dim must be even, got ", head_dim);
  const std::int64_t pairs = tokens * heads * (head_dim / 2);
  if (pairs == 0) return;
  rope_rotate_kernel<<<elementwise_blocks(pairs), kBlockThreads, 0, b.stream>>>(x, positions, tokens, heads, head_dim,
                                                                               theta, sign, y);
  DSP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace detail

/// The Host rope_forward on b.stream: y [tokens, heads, head_dim] = RoPE(x) at positions
/// [tokens] (device memory). In place (y == x) allowed. Throws Error for an odd head_dim,
/// CudaError when the launch fails.
inline void rope_forward(Cuda b, const float* x, const std::int32_t* positions, std::int64_t tokens,
                         std::int64_t heads, std::int64_t head_dim, float theta, float* y) {
  detail::rope_rotate(b, x, positions, tokens, heads, head_dim, theta, 1.0, y);
}

/// The Host rope_backward on b.stream: dx = rotation of dy by -angle. In place allowed.
inline void rope_backward(Cuda b, const float* dy, const std::int32_t* positions, std::int64_t tokens,
                          std::int64_t heads, std::int64_t head_dim, float theta, float* dx) {
  detail::rope_rotate(b, dy, positions, tokens, heads, head_dim, theta, -1.0, dx);
}

}  // namespace dsp::backend
