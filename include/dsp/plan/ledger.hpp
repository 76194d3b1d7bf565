#pragma once
// The memory ledger: per-rank bytes by category for training (from a model, a layout, a
// precision, a ZeRO stage, a pipeline schedule and recomputation) and for serving (weights at
// the serving TP, KV cache, workspace). DESIGN.md section 5: the ledger is a prediction we
// test against what the allocator measured (dsp::memory).
//
// Training, for each pipeline rank (all TP, DP and EP ranks of a stage hold the same bytes:
// every shard has the same shape and the experts split evenly):
//   parameters, gradients, optimizer state  plan/model_state.hpp over the exact parameter list
//       of plan/parameters.hpp (dense parameters sharded over DP, routed experts over
//       expert-DP = DP / EP; buffers fp32 and whole);
//   activations  sum over the rank's (micro-batch, model chunk) pairs in flight, at the worst
//       point of the schedule's action list, of the chunk's per-micro-batch bytes
//       (plan/activations.hpp). With one chunk per rank that is pp::peak_in_flight x the
//       stage's bytes: m for GPipe, min(p - r, m) for 1F1B, so the first stage is the worst;
//   communication  dsp's buffers: the data-parallel gradient buckets' payloads (dp::GradBuckets
//       allocates every bucket's payload, gradient elements x 4 bytes fp32 or 2 in 16-bit,
//       when the group has more than one rank); with ZeRO 2/3 two reduce-scatter buckets of
//       --ddp-bucket-size instead, and with ZeRO 3 two all-gather buffers of the largest
//       layer's 16-bit parameters (DeepSpeed's prefetch; design target); pipeline: the posted
//       activation and gradient receives, 2 x [tokens, hidden];
//   workspace  an estimate of the largest transient a step allocates on top: a layer's
//       backward temporaries (gradients of its inputs and intermediates), the output layer's
//       logits gradient on the last stage, and, with full recomputation, the re-materialised
//       group. An estimate of dsp's host implementation, to be measured.
// Mixed precision on the Host backend differs from this in two ways that cancel in part: its
// buckets' 16-bit payload is where the gradients are kept (measured as gradients, so at ZeRO
// 0/1 with DP > 1 the payload counted under communication is not allocated besides), and each
// part's fp32 gradient lives from its first backward until its bucket is packed (up to 4 bytes
// per parameter of the stage without --overlap-grad-reduce), which is not counted.
// Serving: weights = the parameters of one stage holding every layer at the serving TP (EP 1)
// x dtype bytes; KV cache = 2 x layers x kv_heads_local x head_dim x batch x tokens x bytes,
// kv_heads_local = kv_heads / TP, or 1 when kv_heads < TP (each K/V head replicated on
// TP / kv_heads ranks; serve::KvCachePool allocates exactly this per token, in blocks); workspace = logits of a prefill
// of batch x tokens plus one layer's forward temporaries (estimate).
//
// What can be measured today: parameter bytes (exact), fp32 parameters, gradients and AdamW
// moments at ZeRO 0-3, also in bf16 / fp16 mixed precision (16-bit parameters and gradients,
// fp32 masters and moments; exact at DP 4, tests/plan/test_ledger_measured.cpp), fp32 activations without recomputation (dsp::memory counts Tensor storage;
// the fp32 statistics and index vectors kept in std::vector are not counted there), KV cache
// (exact), the step's peak with and without recomputation (within 10%,
// tests/plan/test_ledger_peak.cpp, fp32), and 16-bit activations (precision/activation_precision.hpp:
// the bytes a Bf16Mixed forward keeps are exactly the formula's with 2 bytes per element,
// tests/plan/test_ledger.cpp). A mixed-precision step's measured peak on the Host backend is
// 26-39% above the ledger's total (small model, TP1 x DP2, TP2 x PP2, full and selective
// recomputation): the Host keeps fp32 working copies the ledger (written for 16-bit compute)
// does not count, i.e. the fp32 values of the part being computed, fp32 gradients until their
// bucket is packed, fp32 backward temporaries, and each GEMM's rounded input copies
// (backend/matmul_precision.hpp; Workspace, fp32 on the host, 2 bytes per element on a GPU).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "dsp/model/config.hpp"
#include "dsp/parallel/layout.hpp"
#include "dsp/plan/activations.hpp"
#include "dsp/plan/model_state.hpp"
#include "dsp/plan/parameters.hpp"
#include "dsp/pp/pipeline_config.hpp"
#include "dsp/pp/schedule.hpp"

namespace dsp::plan {

/// Bytes of one rank by category.
struct MemoryLedger {
  std::int64_t parameters = 0;
  std::int64_t gradients = 0;
  std::int64_t optimizer_state = 0;
  std::int64_t activations = 0;  ///< training: stashed activations; serving: the KV cache
  std::int64_t communication = 0;
  std::int64_t workspace = 0;
  std::int64_t total() const { return parameters + gradients + optimizer_state + activations + communication + workspace; }
};

/// Everything the training prediction depends on (Megatron flag names in the comments).
struct TrainingPlan {
  model::ModelConfig model;
  /// tensor / pipeline / data / expert model-parallel sizes; data must be resolved (>= 1).
  ParallelLayout layout{.tensor = 1, .pipeline = 1, .data = 1, .expert = 1};
  pp::PipelineConfig pipeline;       ///< --pipeline-schedule, --num-layers-per-virtual-pipeline-stage, --pipeline-layer-split
  Precision precision = Precision::Bf16Mixed;  ///< --bf16 / --fp16 / fp32
  int zero_stage = 0;                ///< --zero-stage (DeepSpeed) 0-3
  std::int64_t micro_batch_size = 1;   ///< --micro-batch-size: sequences per micro-batch
  std::int64_t global_batch_size = 1;  ///< --global-batch-size: sequences per optimizer step
  RecomputeConfig recompute;         ///< --recompute-granularity / -method / -num-layers
  std::int64_t ddp_bucket_size = 4 << 20;  ///< --ddp-bucket-size, bytes (dp::DdpConfig's default)

  /// m: micro-batches per step = global / (micro x DP) (no check; see plan/validate.hpp).
  int micro_batches() const {
    return static_cast<int>(global_batch_size / std::max<std::int64_t>(micro_batch_size * layout.data, 1));
  }
  MicroBatch micro_batch() const { return {micro_batch_size, model.seq_length}; }
  int expert_data_parallel() const { return layout.data / std::max(layout.expert, 1); }
};

/// One pipeline rank's prediction.
struct RankLedger {
  int pipeline_rank = 0;
  std::vector<pp::StageLayers> chunks;  ///< the (virtual) stages this rank runs
  ParameterCount elements;              ///< parameter elements it holds
  int in_flight = 0;                    ///< peak (micro-batch, chunk) pairs stashed (pp::peak_in_flight)
  MemoryLedger bytes;
};

/// The whole training prediction.
struct TrainingPrediction {
  std::vector<RankLedger> ranks;  ///< one per pipeline rank
  int worst = 0;                  ///< index of the pipeline rank with the largest total
  std::string schedule;           ///< the schedule's name
  int virtual_size = 1;
  int micro_batches = 1;
  double bubble = 0.0;            ///< pp::theoretical_bubble_fraction
  const RankLedger& worst_rank() const { return ranks.at(static_cast<std::size_t>(worst)); }
};

namespace detail {

/// Most bytes stashed at once on pipeline rank `rank`: walks its action list adding
/// chunk_bytes[chunk] at each Forward and removing it at each Backward (the weighted form of
/// pp::peak_in_flight, which it equals times the bytes when every chunk keeps the same).
inline std::int64_t peak_stashed_bytes(const pp::Schedule& s, int rank, const std::vector<std::int64_t>& chunk_bytes) {
  std::int64_t now = 0, peak = 0;
  for (const pp::Action& a : s.ranks.at(static_cast<std::size_t>(rank))) {
    const std::int64_t b = chunk_bytes.at(static_cast<std::size_t>(s.chunk_of(a.stage)));
    if (a.op == pp::Op::Forward) peak = std::max(peak, now += b);
    if (a.op == pp::Op::Backward) now -= b;
  }
  return peak;
}

/// Estimate of the largest transient one layer's backward allocates (dsp's host layers):
/// the incoming and outgoing [n, h] gradients plus, in the attention part, dcontext, dq, dk,
/// dv and dqkv and one [s, s] score scratch; in a dense MLP dact, dgate_up and dx; in an MoE
/// layer the expert rows' gradients in both orders (2 A h), the experts' dact/dgate_up/dx and
/// the router's dlogits [n, E] and its input gradient.
inline std::int64_t layer_backward_workspace(const model::ModelConfig& c, int tp, int ep, std::int64_t layer,
                                             MicroBatch mb, std::int64_t act) {
  const LocalSizes l = LocalSizes::of(c, tp, ep);
  const std::int64_t n = mb.tokens(), h = l.hidden, d = l.head_dim;
  // The materialising attention's backward holds a [s, s] scratch per head; flash's two
  // [64, s] fp32 tiles on the host (and a [b, h/t, s] D on CUDA), small enough to leave out.
  const std::int64_t attn = n * (2 * (l.heads + 2 * l.kv_heads) * d + l.heads * d + h) +
                            (c.use_flash_attn ? 0 : mb.seq * mb.seq);
  std::int64_t ffn = n * (3 * l.ffn + h);
  if (c.is_moe_layer(layer)) {
    const std::int64_t A = n * c.moe_router_topk;
    ffn = 2 * A * h + A * (3 * l.moe_ffn + h) + n * (3 * l.shared_ffn + 2 * h) + n * c.num_experts;
  }
  return act * (2 * n * h + std::max(attn, ffn));
}

}  // namespace detail

/// The (virtual) stages each pipeline rank runs: rank r holds virtual stages r, r + p, ...
/// (pp::Schedule::rank_of). Throws ConfigError as pp::PipelineConfig::stages.
inline std::vector<std::vector<pp::StageLayers>> rank_chunks(const TrainingPlan& plan) {
  const int p = plan.layout.pipeline;
  const auto stages = plan.pipeline.stages(plan.model.num_layers, p);
  std::vector<std::vector<pp::StageLayers>> out(static_cast<std::size_t>(p));
  for (std::size_t s = 0; s < stages.size(); ++s) out[s % static_cast<std::size_t>(p)].push_back(stages[s]);
  return out;
}

/// Per-rank bytes of training `plan`, every pipeline rank, and the worst one. Assumes a plan
/// that validates (plan/validate.hpp); throws ConfigError from the pieces it uses otherwise.
inline TrainingPrediction predict_training(const TrainingPlan& plan) {
  const auto& c = plan.model;
  const ParallelLayout& L = plan.layout;
  const int p = L.pipeline, tp = L.tensor, ep = L.expert;
  const int v = plan.pipeline.virtual_size(c.num_layers, p);
  const pp::Schedule schedule = pp::make_schedule(plan.pipeline.schedule_name(), p, v, plan.micro_batches());
  const auto chunks = rank_chunks(plan);
  const MicroBatch mb = plan.micro_batch();
  const std::int64_t act = activation_bytes(plan.precision);
  const std::int64_t grad_comm = plan.precision == Precision::Fp32 ? 4 : 2;
  const std::int64_t dp = L.data, edp = plan.expert_data_parallel();

  TrainingPrediction out{{}, 0, schedule.name, v, schedule.micro_batches, pp::theoretical_bubble_fraction(schedule)};
  for (int r = 0; r < p; ++r) {
    RankLedger R{r, chunks[static_cast<std::size_t>(r)], {}, pp::peak_in_flight(schedule, r), {}};
    std::vector<std::int64_t> chunk_bytes;
    std::int64_t workspace = 0, largest_layer = 0;
    for (const auto& s : R.chunks) {
      const auto params = stage_parameters(c, tp, ep, s);
      const ParameterCount n = count(params);
      R.elements.dense += n.dense;
      R.elements.expert += n.expert;
      R.elements.buffers += n.buffers;
      const StageActivations a = dsp_stage_activation_bytes(c, tp, ep, s, mb, act, plan.recompute);
      chunk_bytes.push_back(a.kept);
      for (std::int64_t l = s.first_layer; l < s.first_layer + s.num_layers; ++l)
        workspace = std::max(workspace, detail::layer_backward_workspace(c, tp, ep, l, mb, act) + a.recomputed);
      if (s.post_process)  // the logits' gradient [n, V/t] and the output layer's input gradient
        workspace = std::max(workspace, act * mb.tokens() * (round_up(c.vocab_size, tp) / tp + c.hidden_size));
      for (std::int64_t l = s.first_layer; plan.zero_stage == 3 && l < s.first_layer + s.num_layers; ++l) {
        std::int64_t layer = 0;
        for (const auto& q : stage_parameters(c, tp, ep, {l, 1, false, false})) layer += q.elements();
        largest_layer = std::max(largest_layer, layer);
      }
    }
    const ModelStateBytes dense = zero_model_state(R.elements.dense, dp, plan.precision, plan.zero_stage);
    const ModelStateBytes expert = zero_model_state(R.elements.expert, edp, plan.precision, plan.zero_stage);
    MemoryLedger& m = R.bytes;
    m.parameters = dense.parameters + expert.parameters + 4 * R.elements.buffers;
    m.gradients = dense.gradients + expert.gradients;
    m.optimizer_state = dense.optimizer_state + expert.optimizer_state;
    m.activations = detail::peak_stashed_bytes(schedule, r, chunk_bytes);
    if (plan.zero_stage <= 1) {
      if (dp > 1) m.communication += R.elements.dense * grad_comm;
      if (edp > 1) m.communication += R.elements.expert * grad_comm;
    } else if (dp > 1) {
      m.communication += 2 * plan.ddp_bucket_size;
      if (plan.zero_stage == 3) m.communication += 2 * largest_layer * state_bytes(plan.precision).parameter;
    }
    if (p > 1) m.communication += 2 * mb.tokens() * c.hidden_size * act;
    m.workspace = workspace;
    out.ranks.push_back(std::move(R));
  }
  for (int r = 1; r < p; ++r)
    if (out.ranks[static_cast<std::size_t>(r)].bytes.total() > out.worst_rank().bytes.total()) out.worst = r;
  return out;
}

/// Serving at `tensor`-way TP on one pipeline stage, `batch` sequences of up to `max_tokens`
/// tokens (prompt + generated), weights and KV cache of `dtype_bytes` (4: fp32, what
/// serving's default; 2: 16-bit weights and --kv-cache-dtype bf16 / fp16).
struct ServingPlan {
  model::ModelConfig model;
  int tensor = 1;
  std::int64_t batch = 1;
  std::int64_t max_tokens = 0;  ///< 0: model.seq_length
  std::int64_t dtype_bytes = 4;
  std::int64_t tokens() const { return max_tokens > 0 ? max_tokens : model.seq_length; }
};

/// KV cache bytes per rank: 2 (K and V) x layers x kv_heads_local x head_dim x batch x tokens
/// x bytes, kv_heads_local = kv_heads / tp, or 1 when kv_heads < tp (replicated). MLA: layers x
/// (kv_lora_rank + qk_rope_head_dim) x batch x tokens x bytes on every rank (the latent is not
/// split over TP, as vLLM caches it; model::mla_cache_bytes_per_token).
inline std::int64_t kv_cache_bytes(const model::ModelConfig& c, int tp, std::int64_t batch, std::int64_t tokens,
                                   std::int64_t dtype_bytes) {
  if (c.is_mla()) return c.kv_cache_bytes_per_token(dtype_bytes) * batch * tokens;
  const std::int64_t kv_local = LocalSizes::of(c, tp, 1).kv_heads;
  return 2 * c.num_layers * kv_local * c.head_dim() * batch * tokens * dtype_bytes;
}

/// Bytes of one paged KV cache block on a rank: kv_cache_bytes of one sequence of block_size
/// tokens (every layer's K and V of kv_heads_local heads).
inline std::int64_t kv_cache_bytes_per_block(const model::ModelConfig& c, int tp, std::int64_t block_size,
                                             std::int64_t dtype_bytes) {
  return kv_cache_bytes(c, tp, 1, block_size, dtype_bytes);
}

/// Paged KV cache blocks a per-rank budget of `budget_bytes` holds (vLLM's num_gpu_blocks):
/// floor(budget / kv_cache_bytes_per_block); serve::Engine sizes its pool so from
/// --kv-cache-memory.
inline std::int64_t kv_cache_blocks(const model::ModelConfig& c, int tp, std::int64_t block_size,
                                    std::int64_t dtype_bytes, std::int64_t budget_bytes) {
  return std::max<std::int64_t>(0, budget_bytes) / kv_cache_bytes_per_block(c, tp, block_size, dtype_bytes);
}

/// Per-rank bytes of serving: parameters (weights only: a model built in an InferenceMode
/// scope, as dsp-serve builds it; on an AVX-512 host serve::Engine holds one more copy of its
/// matmul weights, packed, which is not counted), activations (the KV cache) and workspace
/// (a prefill of batch x tokens: its logits [n, V/t] plus one layer's forward temporaries,
/// an estimate). Throws ConfigError when the model does not split over plan.tensor.
inline MemoryLedger predict_serving(const ServingPlan& plan) {
  const auto& c = plan.model;
  MemoryLedger m;
  m.parameters = stage_parameter_count(c, plan.tensor, 1, pp::StageLayers::whole(c.num_layers)).total() * plan.dtype_bytes;
  m.activations = kv_cache_bytes(c, plan.tensor, plan.batch, plan.tokens(), plan.dtype_bytes);
  const LocalSizes l = LocalSizes::of(c, plan.tensor, 1);
  const std::int64_t n = plan.batch * plan.tokens(), h = l.hidden, d = l.head_dim;
  const std::int64_t attn = n * (2 * (l.heads + 2 * l.kv_heads) * d + l.heads * d) +
                            (c.use_flash_attn ? 0 : plan.tokens() * plan.tokens());  // the [s, s] score scratch
  const std::int64_t ffn = c.is_moe() ? n * (c.moe_router_topk * (2 * h + 3 * l.moe_ffn) + 3 * l.shared_ffn + c.num_experts)
                                      : 3 * n * l.ffn;
  m.workspace = plan.dtype_bytes * std::max(n * l.vocab_padded, 3 * n * h + std::max(attn, ffn));
  return m;
}

}  // namespace dsp::plan
