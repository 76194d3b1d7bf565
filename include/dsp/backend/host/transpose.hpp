#pragma once
// Out-of-place transpose of a row-major block. MLA's absorbed serving path needs each head's
// W_UK^T as the [out, in] weight the linear layer's x w^T takes (model/mla_attention.hpp).
#include <cstdint>

#include "dsp/backend/host/host.hpp"

namespace dsp::backend {

/// dst[c, r] = src[r, c] for r < rows, c < cols: src [rows, cols] with row stride ld_src, dst
/// [cols, rows] with row stride ld_dst (only the addressed block of dst is written).
inline void transpose(Host, std::int64_t rows, std::int64_t cols, const float* src, std::int64_t ld_src, float* dst,
                      std::int64_t ld_dst) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
}

}  // namespace dsp::backend
