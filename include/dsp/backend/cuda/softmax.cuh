#pragma once
// Row softmax on the GPU, the Host op's contract (backend/host/softmax.hpp): one block per row,
// the max and the fp64 sum reduced over the block.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/softmax.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/backend/cuda/reduce.cuh"

namespace dsp::backend {

namespace detail {

/// Row blockIdx.x: softmax over its first `valid` columns, or with positions (a causal mask)
/// over its first clamp(positions[row] + 1, 0, valid); with key_begin (a document mask) only
/// from column clamp(key_begin[row], 0, that end) on, 0 before it.
template <int = 0>
__global__ void softmax_forward_kernel(const float* x, std::int64_t cols, std::int64_t valid,
                                       const std::int32_t* positions, float* y,
                                       const std::int32_t* key_begin = nullptr) {
  const float* xr = x + blockIdx.x * cols;
  float* yr = y + blockIdx.x * cols;
  if (positions) valid = min(max(std::int64_t(positions[blockIdx.x]) + 1, std::int64_t(0)), valid);
  const std::int64_t begin = key_begin ? min(max(std::int64_t(key_begin[blockIdx.x]), std::int64_t(0)), valid) : 0;
  float mx = -INFINITY;
  for (std::int64_t j = begin + threadIdx.x; j < valid; j += blockDim.x) mx = fmaxf(mx, xr[j]);
  mx = valid > begin ? block_max(mx) : 0.0f;
  double sum = 0.0;
  for (std::int64_t j = begin + threadIdx.x; j < valid; j += blockDim.x) {
    const float e = expf(xr[j] - mx);
    yr[j] = e;
    sum += e;
  }
  const float inv = static_cast<float>(1.0 / block_sum(sum));
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = j >= begin && j < valid ? yr[j] * inv : 0.0f;
}

template <int = 0>
__global__ void softmax_backward_kernel(const float* y, const float* dy, std::int64_t cols, float* dx) {
  const float* yr = y + blockIdx.x * cols;
  const float* dyr = dy + blockIdx.x * cols;
  float* dxr = dx + blockIdx.x * cols;
  double s = 0.0;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) s += double(yr[j]) * dyr[j];
  const float sf = static_cast<float>(block_sum(s));
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) dxr[j] = yr[j] * (dyr[j] - sf);
}

}  // namespace detail

/// The Host softmax_forward on b.stream: y [rows, cols] = softmax over the first `valid` columns
/// of each row of x, exactly 0 beyond them. y == x allowed. Throws Error when valid is outside
/// [0, cols], CudaError when the launch fails.
inline void softmax_forward(Cuda b, const float* x, std::int64_t rows, std::int64_t cols, std::int64_t valid,
                            float* y) {
  DSP_CHECK(valid >= 0 && valid <= cols, "softmax: valid=", valid, " outside [0, cols=", cols, "]");
  if (rows == 0) return;
  detail::softmax_forward_kernel<<<detail::row_blocks(rows), detail::kBlockThreads, 0, b.stream>>>(x, cols, valid,
                                                                                                nullptr, y);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host causal_softmax_forward on b.stream: in place over p [rows, cols], row i over its
/// first clamp(positions[i] + 1, 0, cols) columns (positions [rows] in device memory), exactly 0
/// beyond. Throws CudaError when the launch fails.
inline void causal_softmax_forward(Cuda b, float* p, std::int64_t rows, std::int64_t cols,
                                   const std::int32_t* positions) {
  if (rows == 0) return;
  detail::softmax_forward_kernel<<<detail::row_blocks(rows), detail::kBlockThreads, 0, b.stream>>>(p, cols, cols,
                                                                                                positions, p);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host document-masked causal_softmax_forward on b.stream: in place over p [rows, cols],
/// row i over the columns [clamp(key_begin[i], 0, end_i), end_i), end_i = clamp(positions[i] + 1,
/// 0, cols) (positions, key_begin [rows] in device memory), exactly 0 outside. Throws CudaError
/// when the launch fails.
inline void causal_softmax_forward(Cuda b, float* p, std::int64_t rows, std::int64_t cols,
                                   const std::int32_t* positions, const std::int32_t* key_begin) {
  if (rows == 0) return;
  detail::softmax_forward_kernel<<<detail::row_blocks(rows), detail::kBlockThreads, 0, b.stream>>>(
      p, cols, cols, positions, p, key_begin);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host softmax_backward on b.stream: dx [rows, cols] = y * (dy - sum_j y[j] dy[j]) per row.
/// dx == dy allowed. Throws CudaError when the launch fails.
inline void softmax_backward(Cuda b, const float* y, const float* dy, std::int64_t rows, std::int64_t cols,
                             float* dx) {
  if (rows == 0) return;
  detail::softmax_backward_kernel<<<detail::row_blocks(rows), detail::kBlockThreads, 0, b.stream>>>(y, dy, cols, dx);
  DSP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsp::backend
