#pragma once
// Strided 2-D copy: moves a block of columns between row-major matrices. Used to split a
// fused projection's output ([q | k | v], [gate | up]) and to gather or scatter the last
// dimension across tensor-parallel ranks.
#include <algorithm>
#include <cstdint>

#include "dsp/backend/host/host.hpp"

namespace dsp::backend {

/// dst[r, dst_offset + j] = src[r, src_offset + j] for r < rows, j < cols.
/// src [rows, src_cols], dst [rows, dst_cols] (overwrite of the addressed block only).
inline void copy_columns(Host, const float* src, std::int64_t src_cols, std::int64_t src_offset, float* dst,
                         std::int64_t dst_cols, std::int64_t dst_offset, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r)
    std::copy_n(src + r * src_cols + src_offset, cols, dst + r * dst_cols + dst_offset);
}

}  // namespace dsp::backend
