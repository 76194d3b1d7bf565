#pragma once
// Linear layer (no bias) in the PyTorch weight layout w [out, in]: y = x w^T.
#include <cstdint>

#include "dsp/backend/host/gemm.hpp"
#include "dsp/backend/host/host.hpp"

namespace dsp::backend {

/// y [tokens, out] = x [tokens, in] * w[out, in]^T. Overwrites y.
inline void linear_forward(Host h, const float* x, const float* w, float* y, std::int64_t tokens, std::int64_t in,
                           std::int64_t out) {
  gemm(h, false, true, tokens, out, in, 1.0f, x, in, w, in, 0.0f, y, out);
}

/// dx [tokens, in] = dy [tokens, out] * w [out, in]. Overwrites dx.
inline void linear_backward_input(Host h, const float* dy, const float* w, float* dx, std::int64_t tokens,
                                  std::int64_t in, std::int64_t out) {
  gemm(h, false, false, tokens, in, out, 1.0f, dy, out, w, in, 0.0f, dx, in);
}

/// dw [out, in] += dy [tokens, out]^T * x [tokens, in]. Accumulates into dw (gradient
/// accumulation over micro-batches).
inline void linear_backward_weight(Host h, const float* dy, const float* x, float* dw, std::int64_t tokens,
                                   std::int64_t in, std::int64_t out) {
  gemm(h, true, false, out, in, tokens, 1.0f, dy, out, x, in, 1.0f, dw, in);
}

}  // namespace dsp::backend
