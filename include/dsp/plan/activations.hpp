#pragma once
// Activation memory of training: what each layer keeps from its forward to its backward for
// one micro-batch on one tensor-parallel rank, with activation recomputation.
//
// Two counts, side by side:
//  - dsp_layer_activation_bytes: dsp's own, derived from the Saved structs the layers fill
//    (model/rms_norm.hpp, attention.hpp, mlp.hpp, model/moe_layer.hpp, ep/grouped_experts.hpp,
//    ep/router.hpp Routing, ep/expert_dispatcher.hpp DispatchPlan) and pp::PipelineStage::
//    Activations. Every saved tensor is its own copy (dsp::Tensor copies deeply), so e.g. a
//    block's input is kept by the first norm and its normalised output again by attention.
//  - korthikanti_layer_bytes: the field's formula, Korthikanti et al., "Reducing Activation
//    Recomputation in Large Transformer Models", MLSys 2023 (arXiv 2205.05198), eq. 2 and
//    table 2, for a GPT layer with 16-bit activations, a 4h GELU MLP, multi-head attention
//    and dropout masks: s b h (34 + 5 a s / h) bytes unparallelised; with tensor parallelism
//    and no sequence parallelism only the parts inside the TP region divide by t:
//    s b h (10 + 24/t + 5 a s / (h t)). It is a reference point, not dsp's count (dsp has
//    SwiGLU, GQA, no dropout, no sequence parallelism, and fp32 statistics).
//
// Recomputation (Megatron's --recompute-granularity / --recompute-method / --recompute-num-
// layers; Korthikanti et al. sections 4.1-4.2):
//   none       every layer keeps its Saved state;
//   selective  the attention core (Q K^T, softmax, softmax x V) is recomputed in backward,
//              so the s^2 term (the softmax probabilities, [b, heads/t, s, s]) is not kept;
//   full       a checkpointed layer keeps only its input [s b, h]; backward re-runs its
//              forward, so one checkpointed group's full state lives again during backward
//              (counted as workspace). method uniform: the stage's layers are split into
//              groups of N and each group's input is kept; block: the first N layers of each
//              stage are checkpointed one by one, the others keep everything.
// --use-flash-attn (model/config.hpp) keeps each query's fp32 log-sum-exp [b, heads/t, s]
// instead of the probabilities, with any granularity: the s^2 term is gone without recomputing
// the rest of the attention core.
// Measured: fp32 with every granularity (tests/plan/test_ledger_peak.cpp); the kept bytes of
// fp32 and 16-bit forwards exactly (tests/plan/test_ledger.cpp). Selective recomputation's transient probabilities in
// backward ([b, heads/t, s, s] per layer) are not in the workspace term yet.
#include <algorithm>
#include <cstdint>
#include <string>

#include "dsp/core/divide.hpp"
#include "dsp/core/error.hpp"
#include "dsp/model/config.hpp"
#include "dsp/model/recompute.hpp"
#include "dsp/plan/model_state.hpp"
#include "dsp/pp/layer_split.hpp"

namespace dsp::plan {

// The trainer's recomputation settings (model/recompute.hpp), planned here.
using model::RecomputeConfig;
using model::RecomputeGranularity;
using model::RecomputeMethod;

inline std::string to_string(RecomputeGranularity g) {
  return g == RecomputeGranularity::None ? "none" : g == RecomputeGranularity::Selective ? "selective" : "full";
}

/// Sizes of one micro-batch: b sequences of s tokens.
struct MicroBatch {
  std::int64_t batch = 1;
  std::int64_t seq = 1;
  std::int64_t tokens() const { return batch * seq; }
};

/// Local sizes of one tensor-parallel rank (the numbers the layers allocate with).
struct LocalSizes {
  std::int64_t hidden, head_dim, heads, kv_heads, ffn, moe_ffn, shared_ffn, experts, vocab_padded;

  static LocalSizes of(const model::ModelConfig& c, int tp, int ep) {
    const std::int64_t t = tp;
    return {c.hidden_size,
            c.head_dim(),
            c.num_attention_heads / t,
            c.num_query_groups >= t ? c.num_query_groups / t : 1,  // replicated K/V heads when kv < TP
            c.ffn_hidden_size / t,
            c.moe_ffn_hidden_size / t,
            c.num_shared_experts * c.moe_ffn_hidden_size / t,
            c.is_moe() ? c.num_experts / ep : 0,
            round_up(c.vocab_size, t) / t};
  }
};

/// Bytes decoder layer `layer` keeps from forward to backward for one micro-batch `mb` on one
/// TP rank, dsp's implementation, activations of `act` bytes per element (4 fp32, 2 16-bit);
/// statistics (RMSNorm's 1/rms, router scores and gate weights) stay fp32, indices int32/int64.
/// granularity None or Selective (Full keeps only the input: mb.tokens() x hidden x act).
/// MoE layers assume balanced routing without drops: every EP rank sends and receives
/// tokens x top-k rows (a skewed router makes the hot rank receive up to EP times that).
inline std::int64_t dsp_layer_activation_bytes(const model::ModelConfig& c, int tp, int ep, std::int64_t layer,
                                               MicroBatch mb, std::int64_t act,
                                               RecomputeGranularity g = RecomputeGranularity::None) {
  if (g == RecomputeGranularity::Full) return mb.tokens() * c.hidden_size * act;
  const LocalSizes l = LocalSizes::of(c, tp, ep);
  const std::int64_t n = mb.tokens(), h = l.hidden, d = l.head_dim;
  // RMSNorm::Saved {x [n, h], rstd [n] fp32}, twice (input_layernorm, post_attention_layernorm).
  std::int64_t bytes = 2 * (n * h * act + n * 4);
  if (c.is_mla()) {
    // MLAttention::Saved {x [n, h], q_latent and q_a_layernorm's input [n, q_lora] + rstd fp32
    // [n] (with a query latent), kv_a_layernorm's input and output [n, kv_lora] + rstd fp32 [n],
    // q, k [n, hq, qk_nope + qk_rope], v [n, hq, v_head_dim], probs [b, hq, s, s] (none under
    // selective recomputation), context [n, hq v_head_dim]}; hq = heads / t.
    const std::int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim, v = c.v_head_dim;
    bytes += act * (n * h + 2 * n * c.q_lora_rank + 2 * n * c.kv_lora_rank + 2 * n * l.heads * qk +
                    2 * n * l.heads * v) +
             4 * n * (c.q_lora_rank > 0 ? 2 : 1);
    if (g == RecomputeGranularity::None) bytes += act * mb.batch * l.heads * mb.seq * mb.seq;
  } else {
    // Attention::Saved {x [n, h], q [n, hq d], k, v [n, hkv d], probs [b, hq, s, s] (flash: lse
    // fp32 [b, hq, s] instead), context [n, hq d]}.
    bytes += act * (n * h + 2 * n * l.heads * d + 2 * n * l.kv_heads * d);
    if (c.use_flash_attn) bytes += 4 * mb.batch * l.heads * mb.seq;
    else if (g == RecomputeGranularity::None) bytes += act * mb.batch * l.heads * mb.seq * mb.seq;
  }
  if (!c.is_moe_layer(layer)) return bytes + act * (n * h + 3 * n * l.ffn);  // MLP::Saved {x, gate_up [n, 2f/t], act [n, f/t]}
  // MoELayer::Saved: x [n, h]; Routing {experts int32 [n, k], weights fp32 [n, k], scores fp32
  // [n, E], kept u8 [n, k]}; DispatchPlan {order [A], expert_counts [E], send/recv_rows [ep],
  // recv_counts [ep, E/ep], rows_per_local_expert [E/ep]} int64; back [A, h]; routed experts'
  // GroupedExperts::Saved {x [R, h], gate_up [R, 2 f/t], act [R, f/t], rows [E/ep]}; shared
  // experts' {x [n, h], gate_up, act, rows [1]}. A = R = n k (balanced, no drops).
  const std::int64_t k = c.moe_router_topk, A = n * k, R = A, E = c.num_experts, el = l.experts;
  bytes += act * n * h;
  bytes += n * k * (4 + 4 + 1) + n * E * 4;
  bytes += 8 * (A + E + 2 * ep + ep * el + el);
  bytes += act * A * h;
  bytes += act * (R * h + 3 * R * l.moe_ffn) + 8 * el;
  if (c.num_shared_experts > 0) bytes += act * (n * h + 3 * n * l.shared_ffn) + 8;
  return bytes;
}

/// Bytes a stage keeps per micro-batch outside its layers (pp::PipelineStage::Activations):
/// the context's positions int32 [n]; first stage: token ids int32 [n]; last stage: target ids
/// int32 [n], the final norm's Saved, the normalised hidden states [n, h], the logits
/// [n, vocab_padded / t] and the loss's row max and sum of exp (fp32 [n] each).
inline std::int64_t dsp_stage_extra_activation_bytes(const model::ModelConfig& c, int tp, const pp::StageLayers& s,
                                                     MicroBatch mb, std::int64_t act) {
  const std::int64_t n = mb.tokens(), h = c.hidden_size;
  std::int64_t bytes = 4 * n;
  if (s.pre_process) bytes += 4 * n;
  if (s.post_process) bytes += 4 * n + (n * h * act + 4 * n) + n * h * act + n * (round_up(c.vocab_size, tp) / tp) * act + 8 * n;
  return bytes;
}

/// The stage's layers' activation bytes for one micro-batch under recomputation `r`: what is
/// kept from forward to backward (`kept`) and the most a checkpointed group re-materialises
/// during backward (`recomputed`, live for one group at a time).
struct StageActivations {
  std::int64_t kept = 0;
  std::int64_t recomputed = 0;
};

inline StageActivations dsp_stage_activation_bytes(const model::ModelConfig& c, int tp, int ep,
                                                   const pp::StageLayers& s, MicroBatch mb, std::int64_t act,
                                                   const RecomputeConfig& r) {
  StageActivations out{dsp_stage_extra_activation_bytes(c, tp, s, mb, act), 0};
  auto full = [&](std::int64_t l) { return dsp_layer_activation_bytes(c, tp, ep, l, mb, act); };
  const std::int64_t input = mb.tokens() * c.hidden_size * act, first = s.first_layer, L = s.num_layers;
  if (r.granularity != RecomputeGranularity::Full) {
    for (std::int64_t l = first; l < first + L; ++l)
      out.kept += dsp_layer_activation_bytes(c, tp, ep, l, mb, act, r.granularity);
    return out;
  }
  const std::int64_t N = std::max<std::int64_t>(r.num_layers, 1);
  if (r.method == RecomputeMethod::Uniform) {
    for (std::int64_t g0 = first; g0 < first + L; g0 += N) {
      out.kept += input;  // the group's input
      std::int64_t group = 0;
      for (std::int64_t l = g0; l < std::min(g0 + N, first + L); ++l) group += full(l);
      out.recomputed = std::max(out.recomputed, group);
    }
    return out;
  }
  for (std::int64_t l = first; l < first + L; ++l) {  // block: the first N layers checkpointed one by one
    if (l - first < N) {
      out.kept += input;
      out.recomputed = std::max(out.recomputed, full(l));
    } else {
      out.kept += full(l);
    }
  }
  return out;
}

/// Korthikanti et al. 2022, eq. 2 / table 2: bytes of one transformer layer's activations for
/// s tokens x b sequences, hidden h, a heads, tensor parallelism t without sequence
/// parallelism (sequence_parallel: the layer norms and dropouts are split too):
///   none:      s b h (10 + 24/t + 5 a s / (h t))     (SP: s b h (34 + 5 a s / h) / t)
///   selective: s b h (10 + 24/t)                     (SP: s b h 34 / t)
///   full:      2 s b h                               (the layer input, 16-bit)
inline double korthikanti_layer_bytes(std::int64_t s, std::int64_t b, std::int64_t h, std::int64_t a, int t,
                                      RecomputeGranularity g, bool sequence_parallel = false) {
  const double sbh = double(s) * double(b) * double(h), T = t;
  const double attn_core = g == RecomputeGranularity::None ? 5.0 * double(a) * double(s) / (double(h) * T) : 0.0;
  if (g == RecomputeGranularity::Full) return 2.0 * sbh;
  if (sequence_parallel) return sbh * (34.0 / T + attn_core);
  return sbh * (10.0 + 24.0 / T + attn_core);
}

}  // namespace dsp::plan
