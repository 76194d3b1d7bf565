#pragma once
// Throughput accounting: model FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B),
// model FLOPs utilisation (MFU) against a measured sgemm peak.
#include <chrono>
#include <cstdint>
#include <vector>

#include "dsp/backend/host/gemm.hpp"
#include "dsp/model/config.hpp"

namespace dsp::train {

/// Training FLOPs per token: 6 N + 6 L s heads (d_qk + d_v), where N counts the parameters
/// used in matrix multiplies (ModelConfig::num_activated_parameters without the norms: no input
/// embedding lookup; a tied table counts once, as the output layer; in MoE layers only the k
/// routed experts a token uses), L layers, s the sequence length, d_qk and d_v the per-head
/// query/key and value widths (head_dim both for GQA, which makes the attention term Megatron's
/// 12 L h s; qk_nope + qk_rope and v_head_dim for MLA). Forward is a third of it.
inline double training_flops_per_token(const model::ModelConfig& c) {
  const double n_matmul = static_cast<double>(c.num_activated_parameters()) -
                          static_cast<double>((2 * c.num_layers + 1) * c.hidden_size);  // norms
  const std::int64_t d_qk = c.is_mla() ? c.qk_nope_head_dim + c.qk_rope_head_dim : c.head_dim();
  const std::int64_t d_v = c.is_mla() ? c.v_head_dim : c.head_dim();
  return 6.0 * n_matmul +
         6.0 * static_cast<double>(c.num_layers * c.seq_length * c.num_attention_heads * (d_qk + d_v));
}

/// Model FLOPs utilisation: achieved model FLOP/s over peak FLOP/s.
inline double mfu(double flops_per_token, double tokens_per_second, double peak_flops) {
  return peak_flops > 0.0 ? flops_per_token * tokens_per_second / peak_flops : 0.0;
}

/// Measures this machine's fp32 GEMM peak (FLOP/s, 2 m n k per GEMM) with the backend's GEMM
/// on square 1024 matrices using every core, for about `seconds`. Call outside comm::launch.
template <class Backend>
double measure_sgemm_peak(double seconds = 0.5) {
  constexpr std::int64_t n = 1024;
  std::vector<float> a(n * n, 1.0f), b(n * n, 0.5f), c(n * n);
  gemm(Backend{}, false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);  // warm up
  const auto t0 = std::chrono::steady_clock::now();
  std::int64_t reps = 0;
  double elapsed = 0.0;
  do {
    gemm(Backend{}, false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    ++reps;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (elapsed < seconds);
  return 2.0 * static_cast<double>(n * n * n) * static_cast<double>(reps) / elapsed;
}

}  // namespace dsp::train
