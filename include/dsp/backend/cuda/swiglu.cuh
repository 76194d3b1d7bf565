#pragma once
// SwiGLU on the GPU: the Host op's per-element formulas (backend/host/swiglu.hpp, shared through
// DSP_HOST_DEVICE) applied by one thread per output element. Defines kernels: include it from a
// .cu file compiled by nvcc.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/swiglu.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/grid_stride.cuh"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/backend/host/swiglu.hpp"

namespace dsp::backend {

namespace detail {

template <int = 0>
__global__ void swiglu_forward_kernel(const float* gate_up, std::int64_t tokens, std::int64_t ffn, float* out) {
  for (const std::int64_t i : grid_stride(tokens * ffn)) {
    const std::int64_t t = i / ffn, j = i % ffn;
    const float* g = gate_up + t * 2 * ffn;
    out[i] = swiglu(g[j], g[ffn + j]);
  }
}

template <int = 0>
__global__ void swiglu_backward_kernel(const float* gate_up, const float* dout, std::int64_t tokens, std::int64_t ffn,
                                       float* dgate_up) {
  for (const std::int64_t i : grid_stride(tokens * ffn)) {
    const std::int64_t t = i / ffn, j = i % ffn;
    const float* g = gate_up + t * 2 * ffn;
    const SwigluGrad grad = swiglu_grad(g[j], g[ffn + j], dout[i]);
    dgate_up[t * 2 * ffn + j] = grad.gate;
    dgate_up[t * 2 * ffn + ffn + j] = grad.up;
  }
}

}  // namespace detail

/// The Host swiglu_forward on b.stream: out [tokens, ffn] = silu(g) * u with gate_up
/// [tokens, 2*ffn] = [g | u] per row. Device pointers. Throws CudaError when the launch fails.
inline void swiglu_forward(Cuda b, const float* gate_up, std::int64_t tokens, std::int64_t ffn, float* out) {
  if (tokens * ffn == 0) return;
  detail::swiglu_forward_kernel<<<detail::elementwise_blocks(tokens * ffn), detail::kBlockThreads, 0, b.stream>>>(
      gate_up, tokens, ffn, out);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host swiglu_backward on b.stream: dgate_up [tokens, 2*ffn] from gate_up [tokens, 2*ffn]
/// and dout [tokens, ffn]. dgate_up must not alias the inputs. Throws CudaError when the launch
/// fails.
inline void swiglu_backward(Cuda b, const float* gate_up, const float* dout, std::int64_t tokens, std::int64_t ffn,
                            float* dgate_up) {
  if (tokens * ffn == 0) return;
  detail::swiglu_backward_kernel<<<detail::elementwise_blocks(tokens * ffn), detail::kBlockThreads, 0, b.stream>>>(
      gate_up, dout, tokens, ffn, dgate_up);
  DSP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsp::backend
