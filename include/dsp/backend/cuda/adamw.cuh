#pragma once
// AdamW on the GPU, the Host op's contract (backend/host/adamw.hpp): one thread per parameter
// applies the shared detail::adamw_element with the step's constants computed on the host.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/adamw.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/grid_stride.cuh"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/backend/host/adamw.hpp"

namespace dsp::backend {

namespace detail {
template <int = 0>
__global__ void adamw_kernel(AdamwStep s, std::int64_t n, float* p, const float* g, float* m, float* v) {
  for (const std::int64_t i : grid_stride(n))
    adamw_element(s, p[i], g[i], m[i], v[i]);
}
}  // namespace detail

/// The Host adamw_update on b.stream: updates p, m, v [n] in place from g [n] (device memory);
/// step >= 1 is the 1-based optimizer step. Throws CudaError when the launch fails.
inline void adamw_update(Cuda b, std::int64_t n, float* p, const float* g, float* m, float* v, float lr, float beta1,
                         float beta2, float eps, float weight_decay, std::int64_t step) {
  if (n == 0) return;
  const detail::AdamwStep s = detail::adamw_step(lr, beta1, beta2, eps, weight_decay, step);
  detail::adamw_kernel<<<detail::elementwise_blocks(n), detail::kBlockThreads, 0, b.stream>>>(s, n, p, g, m, v);
  DSP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsp::backend
