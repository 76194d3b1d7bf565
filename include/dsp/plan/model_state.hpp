#pragma once
// Model-state bytes (parameters, gradients, optimizer state) per rank for a precision and a
// ZeRO stage, after Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
// Parameter Models", SC'20, sections 3.1 and 5.1 (figure 1):
//   mixed-precision Adam keeps, per parameter, 2 bytes of 16-bit weights, 2 bytes of 16-bit
//   gradients and K = 12 bytes of fp32 master weights, momentum and variance: 16 bytes.
//   Over N data-parallel ranks,  stage 0: 2 + 2 + 12         = 16
//                                 stage 1: 2 + 2 + 12/N       = 4 + 12/N   (optimizer state sharded)
//                                 stage 2: 2 + (2 + 12)/N     = 2 + 14/N   (+ gradients)
//                                 stage 3: (2 + 2 + 12)/N     = 16/N       (+ parameters)
// fp32 training (what dsp::train::Trainer runs today, zero::ZeroOptimizer): 4 bytes of weights, 4 of
// gradients, 8 of moments (no master copy): also 16 unsharded, and by the same stages
// 8 + 8/N, 4 + 12/N, 16/N.
// A sharded buffer is split as ZeRO/Megatron's distributed optimizer split it: the rank's flat
// buffer of E elements padded to a multiple of N, so each rank holds ceil(E / N) elements.
// Routed-expert parameters are data-parallel over the expert-data-parallel group, so for them
// N = DP / EP.
//
// zero::ZeroOptimizer measures exactly these fp32 numbers at DP 4 (tests/plan/
// test_ledger_measured.cpp: 16, 10, 7, 4 bytes per parameter); it pads each parameter rather
// than the flat buffer, up to N - 1 elements per parameter more; so it does in mixed precision
// (16, 7, 5.5, 4 bytes per parameter at DP 4).
#include <cstdint>
#include <string>

#include "dsp/core/divide.hpp"
#include "dsp/core/error.hpp"

namespace dsp::plan {

/// Training precision (Megatron: default fp32, --bf16, --fp16).
enum class Precision { Fp32, Bf16Mixed, Fp16Mixed };

/// "fp32" | "bf16" | "fp16" -> Precision; throws ConfigError naming the value otherwise.
inline Precision precision_from_name(const std::string& name) {
  if (name == "fp32") return Precision::Fp32;
  if (name == "bf16") return Precision::Bf16Mixed;
  if (name == "fp16") return Precision::Fp16Mixed;
  throw ConfigError("--precision must be fp32, bf16 or fp16, got '" + name + "'");
}
inline std::string to_string(Precision p) {
  return p == Precision::Fp32 ? "fp32" : p == Precision::Bf16Mixed ? "bf16 mixed" : "fp16 mixed";
}

/// Bytes per parameter of each kind of model state, unsharded.
struct StateBytes {
  std::int64_t parameter = 4;  ///< the weights the forward reads (16-bit in mixed precision)
  std::int64_t gradient = 4;   ///< the gradient accumulated over micro-batches
  std::int64_t optimizer = 8;  ///< K: fp32 master copy (mixed only) + Adam momentum + variance
  std::int64_t total() const { return parameter + gradient + optimizer; }
};

/// ZeRO paper section 3.1: mixed precision 2 + 2 + 12; fp32 (zero::ZeroOptimizer) 4 + 4 + 8.
inline StateBytes state_bytes(Precision p) { return p == Precision::Fp32 ? StateBytes{4, 4, 8} : StateBytes{2, 2, 12}; }

/// Bytes of 16-bit or fp32 activations, the dtype the forward computes in.
inline std::int64_t activation_bytes(Precision p) { return p == Precision::Fp32 ? 4 : 2; }

/// Model-state bytes one rank holds.
struct ModelStateBytes {
  std::int64_t parameters = 0, gradients = 0, optimizer_state = 0;
  std::int64_t total() const { return parameters + gradients + optimizer_state; }
};

/// Bytes for `elements` trained parameters data-parallel over `n` ranks at ZeRO `stage` (0-3):
/// each kind is whole (E) or sharded (ceil(E / n)) as the table above says. Throws ConfigError
/// when stage is not 0-3 or n < 1.
inline ModelStateBytes zero_model_state(std::int64_t elements, std::int64_t n, Precision p, int stage) {
  DSP_CHECK_AS(ConfigError, stage >= 0 && stage <= 3, "--zero-stage must be 0, 1, 2 or 3, got ", stage);
  DSP_CHECK_AS(ConfigError, n >= 1, "data-parallel size must be >= 1, got ", n);
  const StateBytes b = state_bytes(p);
  const std::int64_t shard = round_up(elements, n) / n;
  return {(stage >= 3 ? shard : elements) * b.parameter, (stage >= 2 ? shard : elements) * b.gradient,
          (stage >= 1 ? shard : elements) * b.optimizer};
}

/// The ZeRO paper's bytes per parameter (figure 1, K = 12 for mixed precision): 16, 4 + 12/N,
/// 2 + 14/N, 16/N; for fp32 16, 8 + 8/N, 4 + 12/N, 16/N. The limit of zero_model_state / E for
/// E a multiple of N.
inline double bytes_per_parameter(Precision p, int stage, double n) {
  const StateBytes b = state_bytes(p);
  const double P = double(b.parameter), G = double(b.gradient), K = double(b.optimizer);
  switch (stage) {
    case 0: return P + G + K;
    case 1: return P + G + K / n;
    case 2: return P + (G + K) / n;
    default: return (P + G + K) / n;
  }
}

}  // namespace dsp::plan
