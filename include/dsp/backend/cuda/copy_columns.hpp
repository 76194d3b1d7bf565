#pragma once
// A block of columns copied between two row-major device matrices (the Host op's contract,
// backend/host/copy_columns.hpp): one strided 2-D copy (cudaMemcpy2DAsync).
#include <cuda_runtime.h>

#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"

namespace dsp::backend {

/// dst[r, dst_offset + j] = src[r, src_offset + j] for r < rows, j < cols, on b.stream; src
/// [rows, src_cols] and dst [rows, dst_cols] in device memory (only the addressed block of dst
/// is written). Throws CudaError when the copy cannot be enqueued.
inline void copy_columns(Cuda b, const float* src, std::int64_t src_cols, std::int64_t src_offset, float* dst,
                         std::int64_t dst_cols, std::int64_t dst_offset, std::int64_t rows, std::int64_t cols) {
  if (rows == 0 || cols == 0) return;
  DSP_CUDA_CHECK(cudaMemcpy2DAsync(dst + dst_offset, std::size_t(dst_cols) * sizeof(float), src + src_offset,
                                   std::size_t(src_cols) * sizeof(float), std::size_t(cols) * sizeof(float),
                                   std::size_t(rows), cudaMemcpyDeviceToDevice, b.stream));
}

}  // namespace dsp::backend
