#pragma once
// Row-wise softmax with trailing masked/padding columns.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "dsp/backend/host/host.hpp"
#include "dsp/core/error.hpp"

namespace dsp::backend {

/// y [rows, cols] = softmax over the first `valid` columns of each row of x [rows, cols]
/// (max-subtracted, sum accumulated in fp64); columns >= valid get probability exactly 0, and
/// a row with valid == 0 is all zeros. Overwrites y; y == x allowed.
inline void softmax_forward(Host, const float* x, std::int64_t rows, std::int64_t cols, std::int64_t valid,
                            float* y) {
  DSP_CHECK(valid >= 0 && valid <= cols, "softmax: valid=", valid, " outside [0, cols=", cols, "]");
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    const float mx = valid > 0 ? *std::max_element(xr, xr + valid) : 0.0f;
    double sum = 0.0;
    for (std::int64_t j = 0; j < valid; ++j) {
      yr[j] = std::exp(xr[j] - mx);
      sum += yr[j];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (std::int64_t j = 0; j < valid; ++j) yr[j] *= inv;
    std::fill(yr + valid, yr + cols, 0.0f);
  }
}

/// Causal softmax in place over p [rows, cols] (attention scores: a query per row, a key per
/// column): row i is softmax_forward over its first clamp(positions[i] + 1, 0, cols) columns,
/// the keys query i may see, and exactly 0 beyond them.
inline void causal_softmax_forward(Host h, float* p, std::int64_t rows, std::int64_t cols,
                                   const std::int32_t* positions) {
  for (std::int64_t i = 0; i < rows; ++i) {
    const std::int64_t visible = std::clamp<std::int64_t>(positions[i] + 1, 0, cols);
    softmax_forward(h, p + i * cols, 1, cols, visible, p + i * cols);
  }
}

/// Document-masked causal softmax in place over p [rows, cols] (packed documents,
/// Megatron's --reset-attention-mask): row i is a softmax over the columns
/// [clamp(key_begin[i], 0, end_i), end_i), end_i = clamp(positions[i] + 1, 0, cols), and exactly
/// 0 outside them (a row with no column is all zeros). key_begin [rows]: the first key of row
/// i's document. The softmax of a row is bitwise the one its document alone would get.
inline void causal_softmax_forward(Host h, float* p, std::int64_t rows, std::int64_t cols,
                                   const std::int32_t* positions, const std::int32_t* key_begin) {
  for (std::int64_t i = 0; i < rows; ++i) {
    const std::int64_t end = std::clamp<std::int64_t>(positions[i] + 1, 0, cols);
    const std::int64_t begin = std::clamp<std::int64_t>(key_begin[i], 0, end);
    float* row = p + i * cols;
    std::fill(row, row + begin, 0.0f);
    softmax_forward(h, row + begin, 1, cols - begin, end - begin, row + begin);
  }
}

/// dx [rows, cols] = y * (dy - sum_j y[j] dy[j]) per row, the softmax Jacobian-vector
/// product from the forward's output y [rows, cols] and dy [rows, cols]; masked columns
/// (y == 0) get exactly 0. Overwrites dx; dx == dy allowed.
inline void softmax_backward(Host, const float* y, const float* dy, std::int64_t rows, std::int64_t cols,
                             float* dx) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* yr = y + r * cols;
    const float* dyr = dy + r * cols;
    float* dxr = dx + r * cols;
    double s = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) s += static_cast<double>(yr[j]) * dyr[j];
    const float sf = static_cast<float>(s);
    for (std::int64_t j = 0; j < cols; ++j) dxr[j] = yr[j] * (dyr[j] - sf);
  }
}

}  // namespace dsp::backend
