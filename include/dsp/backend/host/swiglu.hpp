#pragma once
// SwiGLU activation (Shazeer 2020, "GLU Variants Improve Transformer"): silu(gate) * up, with
// gate and up fused in one projection output (Megatron's gate|up layout).
#include <cstdint>

#include "dsp/backend/host/host.hpp"
#include "dsp/backend/host/sigmoid.hpp"

namespace dsp::backend {

/// out [tokens, ffn] = silu(g) * u where gate_up [tokens, 2*ffn] holds g = gate_up[t, 0:ffn]
/// and u = gate_up[t, ffn:2ffn] per row, silu(g) = g * sigmoid(g). Overwrites out.
inline void swiglu_forward(Host, const float* gate_up, std::int64_t tokens, std::int64_t ffn, float* out) {
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* g = gate_up + t * 2 * ffn;
    const float* u = g + ffn;
    float* o = out + t * ffn;
    for (std::int64_t j = 0; j < ffn; ++j) o[j] = g[j] * detail::sigmoid(g[j]) * u[j];
  }
}

/// dgate_up [tokens, 2*ffn] from gate_up [tokens, 2*ffn] and dout [tokens, ffn]:
/// d(gate) = dout * u * s (1 + g (1 - s)) with s = sigmoid(g); d(up) = dout * g s.
/// Overwrites dgate_up (which must not alias gate_up or dout).
inline void swiglu_backward(Host, const float* gate_up, const float* dout, std::int64_t tokens, std::int64_t ffn,
                            float* dgate_up) {
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* g = gate_up + t * 2 * ffn;
    const float* u = g + ffn;
    const float* d = dout + t * ffn;
    float* dg = dgate_up + t * 2 * ffn;
    float* du = dg + ffn;
    for (std::int64_t j = 0; j < ffn; ++j) {
      const float s = detail::sigmoid(g[j]);
      dg[j] = d[j] * u[j] * s * (1.0f + g[j] * (1.0f - s));
      du[j] = d[j] * g[j] * s;
    }
  }
}

}  // namespace dsp::backend
