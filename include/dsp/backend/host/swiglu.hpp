#pragma once
// SwiGLU activation (Shazeer 2020, "GLU Variants Improve Transformer"): silu(gate) * up, with
// gate and up fused in one projection output (Megatron's gate|up layout).
#include <cstdint>

#include "dsp/backend/host/host.hpp"
#include "dsp/backend/host/parallel_for.hpp"
#include "dsp/backend/host/sigmoid.hpp"
#include "dsp/core/host_device.hpp"

namespace dsp::backend {

namespace detail {
/// silu(g) * u with silu(g) = g * sigmoid(g): one element of swiglu_forward.
DSP_HOST_DEVICE inline float swiglu(float g, float u) { return g * sigmoid(g) * u; }
/// One element of swiglu_backward: the gradients of swiglu(g, u) for upstream gradient d.
struct SwigluGrad {
  float gate, up;
};
DSP_HOST_DEVICE inline SwigluGrad swiglu_grad(float g, float u, float d) {
  const float s = sigmoid(g);
  return {d * u * s * (1.0f + g * (1.0f - s)), d * g * s};
}
}  // namespace detail

/// out [tokens, ffn] = silu(g) * u where gate_up [tokens, 2*ffn] holds g = gate_up[t, 0:ffn]
/// and u = gate_up[t, ffn:2ffn] per row, silu(g) = g * sigmoid(g). Overwrites out (which must
/// not alias gate_up: rows are written in any order). Rows are shared among the rank's threads
/// (parallel_for_rows); each element is computed alone, so the result does not depend on the split.
inline void swiglu_forward(Host h, const float* gate_up, std::int64_t tokens, std::int64_t ffn, float* out) {
  parallel_for_rows(h, tokens, ffn, [&](std::int64_t t0, std::int64_t t1) {
    for (std::int64_t t = t0; t < t1; ++t) {
      const float* g = gate_up + t * 2 * ffn;
      const float* u = g + ffn;
      float* o = out + t * ffn;
      for (std::int64_t j = 0; j < ffn; ++j) o[j] = detail::swiglu(g[j], u[j]);
    }
  });
}

/// dgate_up [tokens, 2*ffn] from gate_up [tokens, 2*ffn] and dout [tokens, ffn]:
/// d(gate) = dout * u * s (1 + g (1 - s)) with s = sigmoid(g); d(up) = dout * g s.
/// Overwrites dgate_up (which must not alias gate_up or dout). Rows shared as in swiglu_forward.
inline void swiglu_backward(Host h, const float* gate_up, const float* dout, std::int64_t tokens, std::int64_t ffn,
                            float* dgate_up) {
  parallel_for_rows(h, tokens, ffn, [&](std::int64_t t0, std::int64_t t1) {
    for (std::int64_t t = t0; t < t1; ++t) {
      const float* g = gate_up + t * 2 * ffn;
      const float* u = g + ffn;
      const float* d = dout + t * ffn;
      float* dg = dgate_up + t * 2 * ffn;
      float* du = dg + ffn;
      for (std::int64_t j = 0; j < ffn; ++j) {
        const detail::SwigluGrad grad = detail::swiglu_grad(g[j], u[j], d[j]);
        dg[j] = grad.gate;
        du[j] = grad.up;
      }
    }
  });
}

}  // namespace dsp::backend
