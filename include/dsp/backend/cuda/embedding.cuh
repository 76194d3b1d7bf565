#pragma once
// Token embedding on the GPU, the Host op's contract (backend/host/embedding.hpp): one thread
// per output element; the backward adds with atomicAdd, so repeated ids add up in an order that
// varies between runs (the sum is the same up to fp32 rounding).
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/embedding.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
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
__global__ void embedding_forward_kernel(const std::int32_t* ids, std::int64_t tokens, const float* table,
                                         std::int64_t rows, std::int64_t row_offset, std::int64_t hidden,
                                         float* out) {
  for (const std::int64_t e : grid_stride(tokens * hidden)) {
    const std::int64_t t = e / hidden, j = e % hidden, row = ids[t] - row_offset;
    out[e] = row >= 0 && row < rows ? table[row * hidden + j] : 0.0f;
  }
}

template <int = 0>
__global__ void embedding_backward_kernel(const std::int32_t* ids, std::int64_t tokens, const float* dout,
                                          std::int64_t rows, std::int64_t row_offset, std::int64_t hidden,
                                          float* dtable) {
  for (const std::int64_t e : grid_stride(tokens * hidden)) {
    const std::int64_t t = e / hidden, j = e % hidden, row = ids[t] - row_offset;
    if (row >= 0 && row < rows) atomicAdd(&dtable[row * hidden + j], dout[e]);
  }
}

}  // namespace detail

/// The Host embedding_forward on b.stream: out [tokens, hidden] = table [rows, hidden] row
/// ids[t] - row_offset for ids in this rank's range, zero rows for the others.
inline void embedding_forward(Cuda b, const std::int32_t* ids, std::int64_t tokens, const float* table,
                              std::int64_t rows, std::int64_t row_offset, std::int64_t hidden, float* out) {
  if (tokens * hidden == 0) return;
  detail::embedding_forward_kernel<<<detail::elementwise_blocks(tokens * hidden), detail::kBlockThreads, 0,
                                     b.stream>>>(ids, tokens, table, rows, row_offset, hidden, out);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host embedding_backward on b.stream: dtable row ids[t] - row_offset += dout [tokens,
/// hidden] row t for ids in this rank's range. Accumulates into dtable (atomically: repeated
/// ids in an order that varies between runs).
inline void embedding_backward(Cuda b, const std::int32_t* ids, std::int64_t tokens, const float* dout,
                               std::int64_t rows, std::int64_t row_offset, std::int64_t hidden, float* dtable) {
  if (tokens * hidden == 0) return;
  detail::embedding_backward_kernel<<<detail::elementwise_blocks(tokens * hidden), detail::kBlockThreads, 0,
                                      b.stream>>>(ids, tokens, dout, rows, row_offset, hidden, dtable);
  DSP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsp::backend
