#pragma once
// The precision the model's matrix products multiply in, as torch.autocast chooses it for
// matmuls: inside a MatmulPrecisionScope(Bf16 or Fp16), matmul() rounds its two inputs to that
// type and accumulates in fp32 into its fp32 output (Micikevicius et al., "Mixed Precision
// Training", ICLR 2018, section 3: 16-bit products, fp32 accumulation; Megatron's --bf16
// layers). Its callers: the GEMM of the linear ops (backend/linear.hpp: every projection, the
// experts and the output layer, not the MoE router, which opens an fp32 scope), of the
// materialising attention (backend/attention.hpp) and the tile GEMMs of the Host flash
// attention; the CUDA flash attention reads the scope to run its tensor-core kernels with the
// same roundings (backend/cuda/flash_attention_mma.cuh).
// Mixed-precision training sets it (train/trainer.hpp). There the forward's inputs are mostly
// 16-bit values already (activations rounded where produced, weights widened from 16-bit
// storage), so the rounding changes chiefly the backward's output gradients.
// The backends' gemm_rounded: backend/host/gemm_rounded.hpp (the fp32 sgemm on rounded copies),
// backend/cuda/gemm_rounded.cuh (cuBLAS with 16-bit inputs on the tensor cores). The products
// of 16-bit numbers are exact in fp32 (short of fp32's overflow and underflow range), so the
// two differ in how they accumulate (order; tensor cores need not round each fp32 sum to
// nearest) only. The scope is the thread's: a model run outside the trainer (serving, a bare
// forward with 16-bit activations) multiplies in fp32 unless its caller opens one.
#include <cstdint>

#include "dsp/backend/host/gemm.hpp"
#include "dsp/backend/host/gemm_rounded.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/thread_scope.hpp"

namespace dsp::backend {

/// What matmul() rounds its inputs to.
enum class MatmulPrecision { Fp32, Bf16, Fp16 };

/// Makes `p` the calling thread's matmul precision until the scope ends, then restores the
/// previous one (scopes nest). Belongs to one thread's stack.
class MatmulPrecisionScope : public ThreadScope<MatmulPrecisionScope, MatmulPrecision> {
 public:
  explicit MatmulPrecisionScope(MatmulPrecision p) : ThreadScope(p) {}
};

/// The calling thread's matmul precision: the innermost MatmulPrecisionScope's; Fp32 outside any.
inline MatmulPrecision matmul_precision() { return MatmulPrecisionScope::current(); }

/// gemm's contract (row-major C[m, n] = alpha op(A) op(B) + beta C, fp32 C) in the calling
/// thread's matmul precision: Backend's fp32 gemm, or its gemm_rounded with A and B rounded to
/// bf16 / fp16. Throws what those throw.
template <class Backend>
void matmul(Backend h, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
            const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
            std::int64_t ldc) {
  switch (matmul_precision()) {
    case MatmulPrecision::Bf16:
      gemm_rounded(h, bf16{}, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    case MatmulPrecision::Fp16:
      gemm_rounded(h, fp16{}, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    case MatmulPrecision::Fp32:
      break;
  }
  gemm(h, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace dsp::backend
