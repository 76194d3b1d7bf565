#pragma once
// Mixed-precision policies (Micikevicius et al., "Mixed Precision Training", ICLR 2018; the
// ZeRO paper's model state of 2 + 2 + 12 bytes per parameter, section 3.1): parameters and
// gradients stored in 16 bits, fp32 master weights and Adam moments (zero::ZeroOptimizer with
// T = storage_type), gradients reduced in 16 bits with fp32 accumulation. On every backend the
// layers compute on the 16-bit values widened, rounded and widened by the backend's convert ops
// where the tensors live; the GEMMs take 16-bit inputs with fp32 accumulation
// (backend/matmul_precision.hpp, which the trainer opens: so the backward's output gradients
// are rounded at each GEMM too); norms, softmax, the loss and the router are fp32 as in
// Megatron.
#include "dsp/core/dtype.hpp"

namespace dsp::precision {

/// bf16 parameters and gradients (fp32's range: no loss scaling needed). dsp-train --bf16.
struct Bf16Mixed {
  using storage_type = bf16;
  static constexpr bool dynamic_loss_scaling = false;
  static constexpr const char* name = "bf16";
};

/// fp16 parameters and gradients with dynamic loss scaling (train::TrainConfig::loss_scaler;
/// its defaults when none is given). dsp-train --fp16.
struct Fp16Mixed {
  using storage_type = fp16;
  static constexpr bool dynamic_loss_scaling = true;
  static constexpr const char* name = "fp16";
};

}  // namespace dsp::precision
