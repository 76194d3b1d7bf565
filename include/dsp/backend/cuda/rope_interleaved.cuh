#pragma once
// Rotary position embedding on interleaved pairs on the GPU (MLA's, DeepSeek's layout), the
// Host op's contract (backend/host/rope_interleaved.hpp): one thread per rotated pair, the
// angle and its sin/cos in fp64 as on the host, then scaled by YaRN's attention factor and
// rounded to fp32 before the products, as the host does.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/rope_interleaved.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/grid_stride.cuh"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/backend/host/rope_interleaved.hpp"

namespace dsp::backend {

namespace detail {

template <int = 0>
__global__ void rope_interleaved_kernel(RotarySlices s, const std::int32_t* positions, const double* inv_freq,
                                        double factor, double sign) {
  const std::int64_t half = s.dim / 2, pairs = s.tokens * s.heads * half;
  for (const std::int64_t p : grid_stride(pairs)) {
    const std::int64_t i = p % half, row = p / half, t = row / s.heads, h = row % s.heads;
    const double angle = sign * positions[t] * inv_freq[i];
    const float c = static_cast<float>(factor * cos(angle)), sn = static_cast<float>(factor * sin(angle));
    float* x = s.data + t * s.token_stride + h * s.head_stride;
    const float x1 = x[2 * i], x2 = x[2 * i + 1];
    x[2 * i] = x1 * c - x2 * sn;
    x[2 * i + 1] = x2 * c + x1 * sn;
  }
}

inline void rope_interleaved_rotate(Cuda b, const RotarySlices& s, const std::int32_t* positions,
                                    const double* inv_freq, double factor, double sign) {
  DSP_CHECK(s.dim % 2 == 0 && s.dim > 0, "interleaved rope: the rotary dim must be positive and even, got ", s.dim);
  const std::int64_t pairs = s.tokens * s.heads * (s.dim / 2);
  if (pairs == 0) return;
  rope_interleaved_kernel<<<elementwise_blocks(pairs), kBlockThreads, 0, b.stream>>>(s, positions, inv_freq, factor,
                                                                                    sign);
  DSP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace detail

/// The Host rope_interleaved_forward on b.stream, in place on s (device memory; positions
/// [tokens] and inv_freq [dim/2] in device memory too). Throws Error when dim is odd, CudaError
/// when the launch fails.
inline void rope_interleaved_forward(Cuda b, const RotarySlices& s, const std::int32_t* positions,
                                     const double* inv_freq, double factor) {
  detail::rope_interleaved_rotate(b, s, positions, inv_freq, factor, 1.0);
}

/// The Host rope_interleaved_backward on b.stream: the rotation by -angle times the same factor.
inline void rope_interleaved_backward(Cuda b, const RotarySlices& s, const std::int32_t* positions,
                                      const double* inv_freq, double factor) {
  detail::rope_interleaved_rotate(b, s, positions, inv_freq, factor, -1.0);
}

}  // namespace dsp::backend
