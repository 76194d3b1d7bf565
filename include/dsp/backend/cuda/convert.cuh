#pragma once
// Conversions between fp32 and bf16 / fp16 on the GPU, and rounding in place, the Host ops' contracts
// (backend/host/convert.hpp): one thread per element applies the same bf16::from_float /
// fp16::from_float (core/dtype.hpp) as the host loop, so the bits are the same.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/convert.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/grid_stride.cuh"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/core/dtype.hpp"

namespace dsp::backend {

namespace detail {
template <class T>
__global__ void narrow_kernel(std::int64_t n, const float* x, T* y) {
  for (const std::int64_t i : grid_stride(n))
    y[i].bits = T::from_float(x[i]);
}
template <class T>
__global__ void widen_kernel(std::int64_t n, const T* x, float* y) {
  for (const std::int64_t i : grid_stride(n))
    y[i] = T::to_float(x[i].bits);
}
template <class T>
__global__ void round_kernel(std::int64_t n, float* x) {
  for (const std::int64_t i : grid_stride(n))
    x[i] = T::to_float(T::from_float(x[i]));
}
template <class From, class To, class Kernel>
void launch_convert(Cuda b, std::int64_t n, const From* x, To* y, Kernel kernel) {
  if (n == 0) return;
  kernel<<<elementwise_blocks(n), kBlockThreads, 0, b.stream>>>(n, x, y);
  DSP_CUDA_CHECK(cudaGetLastError());
}
template <class T>
void launch_round(Cuda b, std::int64_t n, float* x) {
  if (n == 0) return;
  round_kernel<T><<<elementwise_blocks(n), kBlockThreads, 0, b.stream>>>(n, x);
  DSP_CUDA_CHECK(cudaGetLastError());
}
}  // namespace detail

/// The Host convert on b.stream: y [n] = x [n] rounded to bf16.
inline void convert(Cuda b, std::int64_t n, const float* x, bf16* y) {
  detail::launch_convert(b, n, x, y, detail::narrow_kernel<bf16>);
}
/// The Host convert on b.stream: y [n] = x [n] rounded to fp16.
inline void convert(Cuda b, std::int64_t n, const float* x, fp16* y) {
  detail::launch_convert(b, n, x, y, detail::narrow_kernel<fp16>);
}
/// The Host convert on b.stream: y [n] = x [n] widened to fp32 (exact).
inline void convert(Cuda b, std::int64_t n, const bf16* x, float* y) {
  detail::launch_convert(b, n, x, y, detail::widen_kernel<bf16>);
}
/// The Host convert on b.stream: y [n] = x [n] widened to fp32 (exact).
inline void convert(Cuda b, std::int64_t n, const fp16* x, float* y) {
  detail::launch_convert(b, n, x, y, detail::widen_kernel<fp16>);
}

/// The Host round_to on b.stream: x [n] rounded to bf16 in place, kept in fp32.
inline void round_to(Cuda b, std::int64_t n, float* x, bf16) { detail::launch_round<bf16>(b, n, x); }
/// The Host round_to on b.stream: x [n] rounded to fp16 in place, kept in fp32.
inline void round_to(Cuda b, std::int64_t n, float* x, fp16) { detail::launch_round<fp16>(b, n, x); }

}  // namespace dsp::backend
