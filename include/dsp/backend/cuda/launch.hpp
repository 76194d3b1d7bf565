#pragma once
// Launch geometry of the kernels: grid-stride loops over n elements, or one block per row.
//
// Every kernel defined in a .cuh header is a function template (`template <int = 0>
// __global__ void name(...)`, launched as `name<<<...>>>`): a plain __global__ function defined
// in two .cu files of one program fails to link (multiple definition), and nvcc ignores
// `inline` on kernels; a template is emitted in every file that uses it and linked once.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "dsp/core/error.hpp"

namespace dsp::backend::detail {

/// Threads per block of the elementwise kernels: a multiple of the 32-thread warp that lets
/// several blocks share an SM (up to 2048 resident threads per SM on sm_80 and sm_90).
inline constexpr int kBlockThreads = 256;

/// Blocks for a grid-stride loop over n elements: one element per thread up to 65535 blocks
/// (beyond that each thread loops; enough blocks remain to fill every SM of an H200).
inline unsigned elementwise_blocks(std::int64_t n) {
  const std::int64_t blocks = (n + kBlockThreads - 1) / kBlockThreads;
  return static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, 65535));
}

/// Blocks for a kernel with one block per row (grid x-dimension: at most 2^31 - 1 rows).
inline unsigned row_blocks(std::int64_t rows) {
  DSP_CHECK(rows >= 0 && rows <= std::numeric_limits<std::int32_t>::max(), "CUDA row kernel: ", rows,
            " rows exceed the grid's 2^31 - 1 blocks");
  return static_cast<unsigned>(rows);
}

}  // namespace dsp::backend::detail
