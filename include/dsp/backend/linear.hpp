#pragma once
// Linear layer (no bias) in the PyTorch weight layout w [out, in]: y = x w^T. Written once for
// every backend on top of its matmul (backend/matmul_precision.hpp: its gemm, or gemm_rounded
// inside a MatmulPrecisionScope), found by argument-dependent lookup on the backend tag; the
// Host ops come with this header, another backend's with that backend's headers
// (backend/cuda/gemm.hpp, backend/cuda/gemm_rounded.cuh: with backend::Cuda these ops need a
// .cu file compiled by nvcc, for gemm_rounded's kernel; backend/cuda/gemm_batch_invariant.cuh
// too). Inside a BatchInvariantScope (backend/batch_invariance.hpp) the forward runs the
// backend's gemm_nt_batch_invariant.
#include <cstdint>

#include "dsp/backend/batch_invariance.hpp"
#include "dsp/backend/host/gemm_batch_invariant.hpp"
#include "dsp/backend/matmul_precision.hpp"

namespace dsp::backend {

/// y [tokens, out] = x [tokens, in] * w [out, in]^T with row strides ldx, ldw, ldy (a slice of
/// wider matrices: one head's columns). Overwrites y. In a BatchInvariantScope each row of y
/// depends on its row of x alone, bitwise (fp32 only: throws Error inside a 16-bit
/// MatmulPrecisionScope, which serving does not open). Every backend's
/// gemm_nt_batch_invariant must be visible where this is instantiated, as its gemm_rounded
/// (with backend::Cuda: backend/cuda/gemm_batch_invariant.cuh in a .cu file), so that every
/// translation unit instantiates the same function.
template <class Backend>
void linear_forward_strided(Backend h, const float* x, std::int64_t ldx, const float* w, std::int64_t ldw, float* y,
                            std::int64_t ldy, std::int64_t tokens, std::int64_t in, std::int64_t out) {
  if (batch_invariant()) {
    DSP_CHECK(matmul_precision() == MatmulPrecision::Fp32,
              "linear_forward: the batch-invariant GEMM multiplies in fp32 only (a 16-bit matmul scope is open)");
    gemm_nt_batch_invariant(h, tokens, out, in, x, ldx, w, ldw, y, ldy);
    return;
  }
  matmul(h, false, true, tokens, out, in, 1.0f, x, ldx, w, ldw, 0.0f, y, ldy);
}

/// y [tokens, out] = x [tokens, in] * w [out, in]^T, contiguous (linear_forward_strided).
template <class Backend>
void linear_forward(Backend h, const float* x, const float* w, float* y, std::int64_t tokens, std::int64_t in,
                    std::int64_t out) {
  linear_forward_strided(h, x, in, w, in, y, out, tokens, in, out);
}

/// dx [tokens, in] = dy [tokens, out] * w [out, in]. Overwrites dx.
template <class Backend>
void linear_backward_input(Backend h, const float* dy, const float* w, float* dx, std::int64_t tokens,
                           std::int64_t in, std::int64_t out) {
  matmul(h, false, false, tokens, in, out, 1.0f, dy, out, w, in, 0.0f, dx, in);
}

/// dw [out, in] += dy [tokens, out]^T * x [tokens, in]. Accumulates into dw (gradient
/// accumulation over micro-batches).
template <class Backend>
void linear_backward_weight(Backend h, const float* dy, const float* x, float* dw, std::int64_t tokens,
                            std::int64_t in, std::int64_t out) {
  matmul(h, true, false, out, in, tokens, 1.0f, dy, out, x, in, 1.0f, dw, in);
}

}  // namespace dsp::backend
