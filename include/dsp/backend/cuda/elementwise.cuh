#pragma once
// Elementwise vector ops and reductions on the GPU, the Host ops' contracts
// (backend/host/elementwise.hpp): level-1 cuBLAS for axpy and scale, a device copy, and kernels
// for fill and the fp64 reductions.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/elementwise.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "dsp/backend/cuda/cublas.hpp"
#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/grid_stride.cuh"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/backend/cuda/reduce.cuh"

namespace dsp::backend {

namespace detail {

template <int = 0>
__global__ void fill_kernel(std::int64_t n, float value, float* y) {
  for (const std::int64_t i : grid_stride(n))
    y[i] = value;
}

/// *out += sum_i w[i] x[i] y[i] (w == nullptr: ones) in fp64: per thread, then per block, then
/// one atomicAdd per block.
template <int = 0>
__global__ void dot_fp64_kernel(std::int64_t n, const float* x, const float* y, const float* w, double* out) {
  double s = 0.0;
  for (const std::int64_t i : grid_stride(n))
    s += (w ? double(w[i]) : 1.0) * double(x[i]) * y[i];
  s = block_sum(s);
  if (threadIdx.x == 0) atomicAdd(out, s);
}

/// sum_i w[i] x[i] y[i] in fp64, returned to the host (waits for b.stream).
inline double dot_fp64(Cuda b, std::int64_t n, const float* x, const float* y, const float* w) {
  DeviceBuffer<double> sum(b, 1, memory::Category::Workspace);
  DSP_CUDA_CHECK(cudaMemsetAsync(sum.data(), 0, sizeof(double), b.stream));
  if (n > 0) {
    dot_fp64_kernel<<<elementwise_blocks(n), kBlockThreads, 0, b.stream>>>(n, x, y, w, sum.data());
    DSP_CUDA_CHECK(cudaGetLastError());
  }
  return to_host(b, sum.data(), 1)[0];
}

}  // namespace detail

/// y [n] += alpha * x [n] (cuBLAS saxpy) on b.stream. Accumulates.
inline void axpy(Cuda b, std::int64_t n, float alpha, const float* x, float* y) {
  if (n == 0) return;
  DSP_CUBLAS_CHECK(cublasSaxpy_64(detail::cublas_handle(b.stream), n, &alpha, x, 1, y, 1));
}

/// y [n] += x [n] on b.stream. Accumulates.
inline void add(Cuda b, std::int64_t n, const float* x, float* y) { axpy(b, n, 1.0f, x, y); }

/// y [n] *= alpha (cuBLAS sscal) on b.stream. In place.
inline void scale(Cuda b, std::int64_t n, float alpha, float* y) {
  if (n == 0) return;
  DSP_CUBLAS_CHECK(cublasSscal_64(detail::cublas_handle(b.stream), n, &alpha, y, 1));
}

/// y [n] = x [n] on b.stream (a device-to-device copy). x == y is allowed, other overlaps are not.
inline void copy(Cuda b, std::int64_t n, const float* x, float* y) {
  if (n == 0 || x == y) return;
  DSP_CUDA_CHECK(cudaMemcpyAsync(y, x, std::size_t(n) * sizeof(float), cudaMemcpyDeviceToDevice, b.stream));
}

/// y [n] = value on b.stream. Overwrites y.
inline void fill(Cuda b, std::int64_t n, float value, float* y) {
  if (n == 0) return;
  detail::fill_kernel<<<detail::elementwise_blocks(n), detail::kBlockThreads, 0, b.stream>>>(n, value, y);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// sum_i x[i] y[i] over n elements, exact products accumulated in fp64 and rounded once to fp32,
/// as the Host dot; the order of the fp64 additions varies between runs (relative error ~n 1e-16).
/// Waits for b.stream (the result is on the host).
inline float dot(Cuda b, std::int64_t n, const float* x, const float* y) {
  return static_cast<float>(detail::dot_fp64(b, n, x, y, nullptr));
}

/// sum_i weight[i] x[i]^2 (weight may be nullptr: all ones), in fp64, as the Host sum_squares.
/// Waits for b.stream.
inline double sum_squares(Cuda b, std::int64_t n, const float* x, const float* weight) {
  return detail::dot_fp64(b, n, x, x, weight);
}

}  // namespace dsp::backend
