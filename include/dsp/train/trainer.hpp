#pragma once
// Trainer: the tensor x pipeline x data-parallel training step.
//   this rank's model chunks (pp::PipelineStage, one per virtual stage it holds) run the
//   step's micro-batches through a pipeline schedule (pp::Engine: GPipe, 1F1B or interleaved
//   1F1B; with one stage simply forward, backward per micro-batch); gradients accumulate;
//   on each chunk's last micro-batch: sum replicated K/V gradients over TP and all-reduce
//   gradient buckets over DP (overlapped with backward when --overlap-grad-reduce);
//   tied embeddings split over stages: the first and last stage sum their table's gradients
//   (before that table's DP reduction, so every DP rank and any later optimizer-state
//   partition sees the complete gradient; the table has a DP bucket of its own on both
//   stages, so both copies get bitwise the same reduction);
//   MoE models: routed experts split over the expert-parallel group (tokens exchanged by
//   all-to-all inside the layers); expert gradients reduce over the expert-data-parallel
//   group, everything else over DP; the clipping norm counts every expert once;
//   with ZeRO (--zero-stage 1-3) the buckets reduce-scatter and zero::ZeroOptimizer updates the
//   owned slices (and gathers parameters per part at stage 3);
//   clip the global gradient norm; AdamW with the warmup + cosine learning rate; then the
//   auxiliary-loss-free expert-bias update from the step's global expert load.
// The loss is normalised by the global number of loss tokens (every micro-batch on every
// DP rank), so any (TP, PP, DP, micro-batch) split of the same global batch gives the same
// update up to floating-point summation order. Packed documents (TrainConfig's
// reset_position_ids, reset_attention_mask, eod_mask_loss, eod_token; model/document_mask.hpp)
// follow Megatron: positions, attention and the loss mask per document; a masked token's target
// is -1, so it drops out of that count too.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <functional>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include "dsp/backend/matmul_precision.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/core/trace.hpp"
#include "dsp/dp/data_sampler.hpp"
#include "dsp/dp/grad_buckets.hpp"
#include "dsp/ep/balance.hpp"
#include "dsp/ep/moe_options.hpp"
#include "dsp/precision/activation_precision.hpp"
#include "dsp/model/document_mask.hpp"
#include "dsp/model/forward_context.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/policy.hpp"
#include "dsp/pp/engine.hpp"
#include "dsp/pp/pipeline_config.hpp"
#include "dsp/pp/pipeline_stage.hpp"
#include "dsp/precision/loss_scaler.hpp"
#include "dsp/data/sample_source.hpp"
#include "dsp/train/token_dataset.hpp"
#include "dsp/zero/lr_schedule.hpp"
#include "dsp/zero/zero_optimizer.hpp"

namespace dsp::train {

/// Training hyper-parameters (Megatron flag names in comments).
struct TrainConfig {
  std::int64_t micro_batch_size = 4;   ///< --micro-batch-size (sequences per micro-batch per DP rank)
  std::int64_t global_batch_size = 8;  ///< --global-batch-size (sequences per optimizer step)
  std::int64_t train_iters = 100;      ///< --train-iters
  float lr = 1e-3f;                    ///< --lr (peak)
  float min_lr = 1e-4f;                ///< --min-lr
  std::int64_t lr_warmup_iters = 0;    ///< --lr-warmup-iters
  std::int64_t lr_decay_iters = 0;     ///< --lr-decay-iters (0: train_iters)
  float clip_grad = 1.0f;              ///< --clip-grad (0: off)
  /// Megatron's check (on by default; --no-check-for-nan-in-loss-and-grad turns it off): a step
  /// that is not skipped by loss scaling and whose gradient norm is NaN or infinite on any rank
  /// throws Error on every rank before the update, so the parameters and moments are those of
  /// the step before (the last checkpoint stays valid). The error ends the run, as in Megatron:
  /// do not call train_step on that trainer again (its gradients are left as the failed step
  /// made them); resume from the checkpoint. Costs one one-element all-reduce over the
  /// data-parallel group per step. Off, such a step updates as usual (and writes NaN into the
  /// parameters).
  bool check_for_nan_in_loss_and_grad = true;
  zero::AdamWConfig adam{};            ///< --adam-beta1/2, --adam-eps, --weight-decay
  std::uint64_t seed = 1234;           ///< --seed (parameters and data order)
  std::int64_t eval_iters = 4;         ///< --eval-iters (global batches of validation data)
  dp::DdpConfig ddp{};                 ///< --ddp-bucket-size, --overlap-grad-reduce, --grad-reduce-dtype
  pp::PipelineConfig pipeline{};       ///< --pipeline-schedule, --num-layers-per-virtual-pipeline-stage
  /// --moe-expert-capacity-factor, --moe-token-drop-policy, --moe-aux-loss-coeff (aux_loss_scale
  /// is set per micro-batch by the trainer).
  ep::MoeOptions moe{};
  /// --moe-router-bias-update-rate: gamma of the expert-bias update (with an expert bias).
  float moe_router_bias_update_rate = 1e-3f;
  /// --recompute-granularity, --recompute-method, --recompute-num-layers.
  model::RecomputeConfig recompute{};
  /// --zero-stage: how much of the model state is partitioned over data parallelism
  /// (zero::ZeroOptimizer: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters).
  int zero_stage = 0;
  /// Fraction of the optimizer state kept in host memory (a device's pinned host memory) and
  /// updated by the CPU while the device updates the rest (zero::ZeroOptimizer's
  /// offload_ratio; Megatron's --optimizer-offload-fraction). In host memory it changes no
  /// value and no place: the state is there already (in a space with pinned host memory, as
  /// tests' GuardedSpace, it moves there).
  double offload_ratio = 0.0;
  /// Dynamic loss scaling (null: none; with precision::Fp16Mixed LossScalerConfig's defaults): the backward starts from the
  /// loss times the scale, the reduced gradients are multiplied by 1 / scale, and a step whose
  /// gradients hold an infinity or NaN on any rank is skipped by every rank (parameters,
  /// moments, MoE expert biases, optimizer step count and so the LR position unchanged) while the
  /// scale backs off. After 10 skips in a row at the minimum scale train_step throws Error: the
  /// gradients are not finite at any allowed scale (a NaN in the model or data, or
  /// --min-loss-scale too large), or the loss itself is not (the forward overflowed: with
  /// Fp16Mixed, activations past fp16's 65504), and skipping further would only consume data.
  std::optional<precision::LossScalerConfig> loss_scaler{};
  /// Packed documents (model/document_mask.hpp, Megatron's _get_ltor_masks_and_position_ids),
  /// for training and evaluate(): --reset-position-ids (positions restart at 0 after each EOD
  /// token), --reset-attention-mask (a token attends only its own document), --eod-mask-loss (no
  /// loss where the INPUT token is the EOD), and the EOD token id they need (--eod-token; the
  /// tokenizer's). All off by default: then nothing changes, bitwise.
  bool reset_position_ids = false;
  bool reset_attention_mask = false;
  bool eod_mask_loss = false;
  std::int32_t eod_token = -1;
  /// The four fields above as model::DocumentMaskConfig.
  model::DocumentMaskConfig documents() const {
    return {reset_position_ids, reset_attention_mask, eod_mask_loss, eod_token};
  }

  /// Throws ConfigError naming the flag and the value for a value out of its range: batch
  /// sizes, train_iters and eval_iters below 1; lr, min_lr, lr_warmup_iters, lr_decay_iters,
  /// clip_grad or an AdamW hyper-parameter out of range (NaN included; AdamWConfig::validate).
  /// The Trainer calls it first.
  void validate() const {
    for (auto [flag, value] : {std::pair{"--micro-batch-size", micro_batch_size}, {"--global-batch-size", global_batch_size},
                               {"--train-iters", train_iters}, {"--eval-iters", eval_iters}})
      DSP_CHECK_AS(ConfigError, value >= 1, flag, " must be >= 1, got ", value);
    for (auto [flag, value] : {std::pair{"--lr-warmup-iters", lr_warmup_iters}, {"--lr-decay-iters", lr_decay_iters}})
      DSP_CHECK_AS(ConfigError, value >= 0, flag, " must be >= 0, got ", value);
    for (auto [flag, value] : {std::pair{"--lr", lr}, {"--min-lr", min_lr}, {"--clip-grad", clip_grad}})
      DSP_CHECK_AS(ConfigError, value >= 0.0f, flag, " must be >= 0, got ", value);
    adam.validate();
    documents().validate();
  }
};

/// One micro-batch a caller hands to Trainer::train_step(std::vector<MicroBatch>): micro_batch_size
/// sequences of seq_length tokens side by side, every vector [micro_batch_size * seq_length].
struct MicroBatch {
  std::vector<std::int32_t> inputs;   ///< token ids
  std::vector<std::int32_t> targets;  ///< next-token ids; < 0: no loss (ignored)
  /// Optional (empty: derived). RoPE positions of the tokens in their sequence; empty: 0..seq-1,
  /// or restarted after each EOD input with TrainConfig::reset_position_ids.
  std::vector<std::int32_t> positions;
  /// Optional: the index of each token's document in its sequence (non-decreasing along it); a
  /// token attends only its own document's earlier tokens. Empty: from the EOD inputs with
  /// TrainConfig::reset_attention_mask, else one document per sequence.
  std::vector<std::int32_t> document_ids;
  /// Optional: 1 where a token carries loss, 0 where not (same as target -1; only 0 and 1).
  /// Multiplied with the EOD loss mask of TrainConfig::eod_mask_loss. Empty: all 1.
  std::vector<float> loss_mask;
};

/// One MoE layer's routing over a whole step, summed over every data-parallel rank.
struct MoeStepStats {
  std::int64_t layer = -1;                      ///< global layer index
  std::vector<std::int64_t> tokens_per_expert;  ///< [E] times each expert was chosen (before dropping)
  std::int64_t dropped = 0;                     ///< assignments dropped by capacity
  double aux_loss = 0.0;                        ///< balance loss, mean over the global batch's sequences
  /// max / mean of tokens_per_expert (1 = perfectly balanced; 0 without tokens).
  double max_over_mean_load() const {
    if (tokens_per_expert.empty()) return 0.0;
    double sum = 0.0, mx = 0.0;
    for (auto v : tokens_per_expert) {
      sum += double(v);
      mx = std::max(mx, double(v));
    }
    return sum > 0.0 ? mx * double(tokens_per_expert.size()) / sum : 0.0;
  }
};

/// What one optimizer step did.
struct StepResult {
  std::int64_t iteration = 0;  ///< 1-based number of this step
  double loss = 0.0;           ///< mean training loss over the global batch, nats/token
  float grad_norm = 0.0f;      ///< global gradient norm before clipping
  float lr = 0.0f;             ///< learning rate used
  std::int64_t tokens = 0;     ///< tokens in the global batch
  double seconds = 0.0;        ///< wall time of the step
  /// Idle share of the pipeline ranks' time in the schedule (pp::pipeline_bubble_fraction);
  /// 0 with one stage.
  double bubble_fraction = 0.0;
  /// Most (micro-batch, chunk) activations this rank held at once (pp::ScheduleStats).
  int peak_in_flight = 0;
  /// Measured peak of tensor bytes this rank's thread held during the schedule above what it
  /// held before it, in the memory the tensors live in (`memory`'s counters): stashed
  /// activations of the micro-batches in flight plus the temporaries of the layer running.
  std::int64_t peak_activation_bytes = 0;
  /// This rank's counters by category of the memory its tensors live in (space_snapshot(): a
  /// device's counters for backend::Cuda, dsp::memory's host counters on the host): live bytes
  /// at the end of the step and peaks over the step. The schedule (forward and backward) runs
  /// in an Activations scope, so Activations counts the stashed activations and the layers'
  /// temporaries; the optimizer's and clipping's temporaries are Workspace.
  memory::Snapshot memory;
  /// The host counters (dsp::memory) the same way: `memory` itself on the host; with a device,
  /// the host side (offloaded optimizer state in pinned memory, host copies).
  memory::Snapshot host_memory;
  /// Every MoE layer of the model (all pipeline stages), by layer; empty for a dense model.
  std::vector<MoeStepStats> moe;
  /// With loss scaling: the scale this step's backward used, and whether an overflow on some
  /// rank made every rank skip the update (then grad_norm is NaN, `iteration` is the step it
  /// attempted, and the next step attempts it again).
  float loss_scale = 1.0f;
  bool skipped = false;
};

template <class Policy>
class Trainer {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;
  using Precision = typename Policy::Precision;
  /// The element type parameters and gradients are stored in (float, bf16, fp16).
  using Storage = typename Precision::storage_type;
  /// The layers compute in fp32 whatever the precision (mixed precision widens the stored
  /// 16-bit parameters: zero::ZeroOptimizer), so every precision shares one model type.
  using ModelPolicy = dsp::Policy<Backend, Comm>;
  using Stage = pp::PipelineStage<ModelPolicy>;
  using Optimizer = zero::ZeroOptimizer<Backend, Comm, Storage>;
  /// What activations are rounded to and kept in: the storage type (model/activation_precision.hpp).
  static constexpr precision::ActivationPrecision activation_precision =
      std::is_same_v<Storage, bf16>   ? precision::ActivationPrecision::Bf16
      : std::is_same_v<Storage, fp16> ? precision::ActivationPrecision::Fp16
                                      : precision::ActivationPrecision::Fp32;
  /// What the model's matrix products multiply in during train_step() and evaluate(): the
  /// storage type (backend/matmul_precision.hpp; Megatron's --bf16 / --fp16 GEMMs: 16-bit
  /// inputs, fp32 accumulation).
  static constexpr backend::MatmulPrecision matmul_precision =
      std::is_same_v<Storage, bf16>   ? backend::MatmulPrecision::Bf16
      : std::is_same_v<Storage, fp16> ? backend::MatmulPrecision::Fp16
                                      : backend::MatmulPrecision::Fp32;

  /// Every tensor lives in the calling thread's current memory space, which must be the
  /// backend's (for backend::Cuda: construct and use the trainer inside
  /// MemorySpaceScope(memory_space(Cuda{}))). Fp32 on a device backend covers training steps
  /// and evaluate() at any TP x PP x DP x EP with ZeRO stages 0-3 (offload included), dense
  /// and MoE models (routing decisions on the host: ep/moe_layer.hpp), over a communicator
  /// that reads device memory and also takes the trainer's host-side sums in its blocking
  /// forms (comm::StagingComm, for ranks sharing one GPU; NcclComm, one GPU per rank, which
  /// stages host memory through device copies); checkpoints (train/checkpointing.hpp) copy
  /// through the host; --grad-reduce-dtype bf16 / fp16 and mixed precision (16-bit activations,
  /// parameters and gradients, fp32 master weights; offload included) round and widen with the
  /// backend's convert ops where the tensors live.
  /// Collective over the mesh. Throws ConfigError when a TrainConfig value is out of range
  /// (TrainConfig::validate, checked first), the model does not split over TP or the pipeline,
  /// the batch sizes do not divide, or the schedule does not fit them (e.g. interleaved with
  /// micro-batches not a multiple of the pipeline size).
  Trainer(const model::ModelConfig& config, const TrainConfig& tc, DeviceMesh<Comm>& mesh, const data::SampleSource& data)
      : tc_((tc.validate(), tc)),
        mesh_(&mesh),
        data_(&data),
        stages_(make_stages(config, tc, mesh)),
        sampler_(data.train_samples(), tc.micro_batch_size, tc.global_batch_size, mesh.dp_size(), mesh.dp_rank(),
                 tc.seed, !data.in_training_order()),
        engine_(mesh.pipeline_group(),
                pp::make_schedule(tc.pipeline.schedule_name(), mesh.pp_size(),
                                  tc.pipeline.virtual_size(config.num_layers, mesh.pp_size()),
                                  static_cast<int>(sampler_.accumulation_steps())),
                {tc.micro_batch_size * config.seq_length, config.hidden_size}),
        buckets_(mesh.data_group(), grad_ready_order(false), ddp_config(tc), tied_embedding(),
                 checked_stage(tc.zero_stage), Optimizer::mixed),
        expert_buckets_(mesh.expert_data_group(), grad_ready_order(true), ddp_config(tc), nullptr, tc.zero_stage,
                        Optimizer::mixed),
        optimizer_(parameters(), {&buckets_, &expert_buckets_}, tc.adam, mesh.tp_size(), mesh.tp_rank(),
                   tc.offload_ratio),
        schedule_{tc.lr, tc.min_lr, tc.lr_warmup_iters, tc.lr_decay_iters > 0 ? tc.lr_decay_iters : tc.train_iters} {
    DSP_CHECK_AS(ConfigError, data.seq_length() == config.seq_length, "data samples of ", data.seq_length(),
                 " tokens do not match --seq-length ", config.seq_length);
    DSP_CHECK_AS(ConfigError, data.val_samples() >= tc.global_batch_size, "the validation split holds ",
                 data.val_samples(), " sequences, fewer than one global batch of ", tc.global_batch_size);
    if (config.tie_word_embeddings && engine_.schedule().num_stages() > 1) {  // first and last stage of each (tp, dp)
      const int p = mesh.pp_size(), r = mesh.pp_rank();
      embedding_group_ = std::make_unique<Comm>(mesh.pipeline_group().split(r == 0 || r == p - 1 ? 0 : 1, r));
    }
    if (Precision::dynamic_loss_scaling && !tc_.loss_scaler) tc_.loss_scaler.emplace();  // fp16: the defaults
    if (tc_.loss_scaler) scaler_.emplace(*tc_.loss_scaler);
    // gradients made on demand (stage 2, mixed precision) and parameters gathered (stage 3) or
    // widened (mixed precision) per part
    if (tc.zero_stage >= 2 || Optimizer::mixed)
      for (auto& s : stages_)
        s->set_parameter_hooks(
            {[this](const auto& part, const auto* next, bool backward) { optimizer_.acquire(part, next, backward); },
             [this](const auto& part) { optimizer_.release(part); }});
  }

  /// One optimizer step over the next global batch. Collective over the mesh. Throws Error on
  /// every rank when the gradient norm is not finite and TrainConfig::check_for_nan_in_loss_and_grad
  /// is on, and after 10 loss-scaling skips in a row at the minimum scale (TrainConfig::loss_scaler);
  /// ConfigError and the communicators' errors as they arise.
  StepResult train_step() { return run_step(next_micro_batches(), std::chrono::steady_clock::now()); }

  /// One optimizer step over a global batch the caller made instead of the data set's next
  /// one: this data-parallel rank's share, sampler().accumulation_steps() micro-batches
  /// (gradient accumulation) of micro_batch_size sequences of seq_length tokens each, the same
  /// on every tensor and pipeline rank of this replica. Each micro-batch may carry positions,
  /// document ids and a loss mask (MicroBatch); the document options of the TrainConfig apply
  /// to the rest. The loss is the sum over loss tokens divided by their count over the whole
  /// global batch (every micro-batch and data-parallel rank), so splitting the same sequences
  /// differently over micro-batches and DP ranks gives the same update up to summation order.
  /// Does not advance the data sampler. Collective over the mesh. Throws Error when the number
  /// of micro-batches or a vector's size is wrong, and as train_step().
  StepResult train_step(std::vector<MicroBatch> micro_batches) {
    const auto t0 = std::chrono::steady_clock::now();
    DSP_CHECK(static_cast<std::int64_t>(micro_batches.size()) == sampler_.accumulation_steps(), "train_step: ",
              micro_batches.size(), " micro-batches, but a global batch of ", tc_.global_batch_size,
              " sequences over ", mesh_->dp_size(), " data-parallel ranks in micro-batches of ", tc_.micro_batch_size,
              " is ", sampler_.accumulation_steps(), " per rank");
    const auto n = static_cast<std::size_t>(tc_.micro_batch_size * data_->seq_length());
    for (const MicroBatch& mb : micro_batches) {
      DSP_CHECK(mb.inputs.size() == n && mb.targets.size() == n, "train_step: a micro-batch's inputs and targets ",
                "must hold micro_batch_size x seq_length = ", n, " tokens, got ", mb.inputs.size(), " and ",
                mb.targets.size());
      for (const auto* v : {&mb.positions, &mb.document_ids})
        DSP_CHECK(v->empty() || v->size() == n, "train_step: a micro-batch's positions and document_ids must be "
                                                "empty or hold ", n, " entries, got ", v->size());
      DSP_CHECK(mb.loss_mask.empty() || mb.loss_mask.size() == n, "train_step: a micro-batch's loss_mask must be "
                                                                  "empty or hold ", n, " entries, got ",
                mb.loss_mask.size());
    }
    return run_step(std::move(micro_batches), t0);
  }

 private:
  StepResult run_step(std::vector<MicroBatch> micro_batches, std::chrono::steady_clock::time_point t0) {
    trace::Span step_span("train_step", trace::Kind::Compute);
    backend::MatmulPrecisionScope matmuls(matmul_precision);
    for (auto& s : stages_) s->zero_grad();
    const std::int64_t seq = data_->seq_length();
    auto ctx = model::ForwardContext::for_training(tc_.micro_batch_size, seq);
    ctx.moe = tc_.moe;
    ctx.recompute = tc_.recompute;
    ctx.activations = activation_precision;
    ctx.moe.aux_loss_scale = static_cast<float>(double(tc_.micro_batch_size) / double(tc_.global_batch_size));
    // per micro-batch when some carries documents (targets of masked tokens set to -1 first)
    std::vector<model::ForwardContext> contexts = document_contexts(ctx, micro_batches);
    std::vector<double> counts{0.0};  // loss tokens (targets >= 0) of the global batch
    for (const auto& mb : micro_batches) counts[0] += count_loss_tokens(mb.targets);
    mesh_->data_group().all_reduce(std::span(counts));
    const double loss_tokens = std::max(counts[0], 1.0);
    const double loss_scale = scaler_ ? double(scaler_->scale()) : 1.0;
    std::vector<double> loss_sum{0.0};  // on the last stage
    const typename Stage::GradReadyFn ready = [&](Parameter& p) {
      (p.expert ? expert_buckets_ : buckets_).mark_ready(p);
    };
    std::map<std::pair<int, int>, typename Stage::Activations> stash;  // (micro-batch, stage)
    ctx.moe.loss_scale = static_cast<float>(loss_scale);
    for (auto& c : contexts) c.moe.loss_scale = ctx.moe.loss_scale;
    for (auto* m : moe_layers()) m->stats().clear();
    typename pp::Engine<Comm>::Hooks hooks;
    hooks.forward = [&](int m, int s, Tensor x) {
      Stage& stage = chunk(s);
      MicroBatch& mb = micro_batches[static_cast<std::size_t>(m)];
      const model::ForwardContext& c = contexts.empty() ? ctx : contexts[static_cast<std::size_t>(m)];
      Tensor out = stage.forward(c, stage.layers().pre_process ? std::move(mb.inputs) : std::vector<std::int32_t>{},
                                 stage.layers().post_process ? std::move(mb.targets) : std::vector<std::int32_t>{},
                                 std::move(x), stash[{m, s}]);
      if (stage.layers().post_process) loss_sum[0] += std::accumulate(out.values().begin(), out.values().end(), 0.0);
      return out;
    };
    hooks.backward = [&](int m, int s, Tensor dy, bool last) {
      Stage& stage = chunk(s);
      if (stage.layers().post_process) {
        Tensor host = Tensor::host_zeros({tc_.micro_batch_size * seq});
        host.fill(static_cast<float>(loss_scale / loss_tokens));
        dy = std::move(host).to(current_memory_space());
      }
      auto it = stash.find({m, s});
      Tensor dx = stage.backward(it->second, dy, last ? &ready : nullptr);
      stash.erase(it);
      return dx;
    };
    const std::int64_t held_before = space_snapshot().total.live;  // where the tensors live
    memory::reset_peak();
    reset_space_peak();
    const pp::ScheduleStats stats = [&] {
      memory::CategoryScope scope(memory::Category::Activations);
      return engine_.run(hooks);
    }();
    const std::int64_t peak_activation_bytes = space_snapshot().total.peak - held_before;
    sum_tied_embedding_grads();
    {
      trace::Span span("grad_buckets.finish", trace::Kind::Comm);
      buckets_.finish();
      expert_buckets_.finish();
    }
    if (grad_hook_) grad_hook_(*this);
    StepResult r;
    r.loss_scale = static_cast<float>(loss_scale);
    r.skipped = scaler_ && overflowed();
    r.lr = schedule_(optimizer_.steps());
    r.moe = moe_step_stats();
    if (r.skipped) {
      r.grad_norm = std::numeric_limits<float>::quiet_NaN();
    } else {
      {
        trace::Span span("clip_grad", trace::Kind::Compute);
        r.grad_norm = optimizer_.clip_grad_norm(tc_.clip_grad, mesh_->model_group(), &mesh_->expert_group());
      }
      // clip_grad_norm's norm is the same on every rank of a model group, but a fault after the
      // data-parallel reduction (one replica's gradients) reaches only its own group's norm at
      // ZeRO 0: decided over the data-parallel group too, so that every rank throws here, or none.
      if (tc_.check_for_nan_in_loss_and_grad &&
          precision::any_rank(mesh_->data_group(), !std::isfinite(r.grad_norm)))
        throw Error(dsp::detail::concat(
            "step ", optimizer_.steps() + 1, ": the gradient norm is not finite on some rank (", r.grad_norm,
            " on this rank; a NaN or infinity in the gradients: from the data, the model, or a forward "
            "that overflowed; without loss scaling nothing skips such a step). Stopped before the update: the "
            "parameters and optimizer state are those of step ", optimizer_.steps(),
            ". --no-check-for-nan-in-loss-and-grad turns this check off"));
      trace::Span span("optimizer.step", trace::Kind::Compute);
      optimizer_.step(r.lr);
      update_expert_biases(r.moe);
    }
    mesh_->data_group().all_reduce(std::span(loss_sum));
    mesh_->pipeline_group().all_reduce(std::span(loss_sum));  // from the last stage
    r.iteration = optimizer_.steps() + (r.skipped ? 1 : 0);
    if (r.skipped && r.loss_scale <= tc_.loss_scaler->min_scale && ++skips_at_min_scale_ >= 10)
      throw Error(dsp::detail::concat(
          "loss scaling: 10 steps in a row overflowed at the minimum loss scale ", r.loss_scale,
          " (--min-loss-scale): ",
          std::isfinite(loss_sum[0])
              ? "the gradients are not finite at any allowed scale (a NaN in the model or data, or --min-loss-scale "
                "too large)"
              : "the loss itself is not finite, so the forward overflowed before any scaling (with --fp16 every "
                "activation must stay within +-65504; --bf16 has fp32's range) or the model or data hold a NaN"));
    if (!r.skipped) skips_at_min_scale_ = 0;
    r.loss = loss_sum[0] / loss_tokens;
    r.tokens = tc_.global_batch_size * seq;
    r.bubble_fraction = mesh_->pp_size() > 1 ? pp::pipeline_bubble_fraction(mesh_->pipeline_group(), stats) : 0.0;
    r.peak_in_flight = stats.peak_in_flight;
    r.peak_activation_bytes = peak_activation_bytes;
    r.memory = space_snapshot();
    r.host_memory = memory::snapshot();
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }

 public:
  /// Mean validation loss (nats/token) over the first min(eval_iters, available) global
  /// batches of the validation split (the same windows every time; at least one batch, checked
  /// at construction). Forward only, stage after stage. Collective over the mesh.
  double evaluate() {
    backend::MatmulPrecisionScope matmuls(matmul_precision);
    const std::int64_t seq = data_->seq_length(), per_rank = tc_.global_batch_size / mesh_->dp_size();
    const std::int64_t batches = std::min(tc_.eval_iters, data_->val_samples() / tc_.global_batch_size);
    std::vector<double> sums{0.0, 0.0};  // loss sum (last stage), tokens
    std::vector<std::int32_t> inputs, targets;
    const auto plain = [&] {
      auto c = model::ForwardContext::for_training(tc_.micro_batch_size, seq);
      c.activations = activation_precision;
      return c;
    }();
    const model::DocumentMaskConfig documents = tc_.documents();
    for (std::int64_t b = 0; b < batches; ++b)
      for (std::int64_t m = 0; m < per_rank; m += tc_.micro_batch_size) {
        std::vector<std::int64_t> windows(static_cast<std::size_t>(tc_.micro_batch_size));
        std::iota(windows.begin(), windows.end(), b * tc_.global_batch_size + mesh_->dp_rank() * per_rank + m);
        data_->batch(true, windows, inputs, targets);
        model::ForwardContext ctx = plain;
        if (documents.any()) model::apply_document_masks(ctx, inputs, targets, documents);
        sums[1] += count_loss_tokens(targets);
        const Tensor loss = pp::forward_stages(mesh_->pipeline_group(), engine_.schedule().num_stages(),
                                               {ctx.tokens(), model_config().hidden_size}, [&](int s, Tensor x) {
                                                 typename Stage::Activations act;
                                                 return chunk(s).forward(ctx, inputs, targets, std::move(x), act);
                                               });
        sums[0] += std::accumulate(loss.values().begin(), loss.values().end(), 0.0);
      }
    mesh_->data_group().all_reduce(std::span(sums));
    mesh_->pipeline_group().all_reduce(std::span(sums).first(1));
    return sums[0] / std::max(sums[1], 1.0);
  }

  /// What a checkpoint holds of this rank's model: every chunk's parameters and buffers (MoE
  /// expert biases), chunk after chunk (PipelineStage::state_parameters).
  std::vector<Parameter*> state_parameters() {
    std::vector<Parameter*> out;
    for (auto& s : stages_)
      for (auto* p : s->state_parameters()) out.push_back(p);
    return out;
  }
  /// This rank's MoE layers, chunk after chunk.
  std::vector<model::MoELayer<ModelPolicy>*> moe_layers() {
    std::vector<model::MoELayer<ModelPolicy>*> out;
    for (auto& s : stages_)
      for (auto* m : s->moe_layers()) out.push_back(m);
    return out;
  }

  /// This rank's model chunks, by chunk index (virtual stage chunk x p + pipeline rank).
  std::vector<std::unique_ptr<Stage>>& stages() { return stages_; }
  /// Called in every step once the gradients are reduced over data parallelism (what the
  /// optimizer reads: ZeroOptimizer::gradient), before loss-scale checking, clipping and the
  /// update: to inspect them, or to inject a fault in a test. Null: none.
  void set_grad_hook(std::function<void(Trainer&)> hook) { grad_hook_ = std::move(hook); }
  /// The dynamic loss scaler (TrainConfig::loss_scaler), or null.
  precision::DynamicLossScaler* loss_scaler() { return scaler_ ? &*scaler_ : nullptr; }

  /// Every parameter of this rank (all chunks), in chunk order.
  std::vector<Parameter*> parameters() {
    std::vector<Parameter*> out;
    for (auto& s : stages_)
      for (auto* p : s->parameters()) out.push_back(p);
    return out;
  }
  const model::ModelConfig& model_config() const { return stages_.front()->config(); }
  Optimizer& optimizer() { return optimizer_; }
  dp::DataSampler& sampler() { return sampler_; }
  const dp::GradBuckets<Comm, Backend>& grad_buckets() const { return buckets_; }
  /// Buckets of the routed experts' gradients, over the expert-data-parallel group.
  const dp::GradBuckets<Comm, Backend>& expert_grad_buckets() const { return expert_buckets_; }
  const pp::Engine<Comm>& engine() const { return engine_; }
  DeviceMesh<Comm>& mesh() { return *mesh_; }
  const TrainConfig& config() const { return tc_; }
  std::int64_t iteration() const { return optimizer_.steps(); }

 private:
  // The forward contexts of the micro-batches (from ctx) when the document options are on or a
  // micro-batch carries positions, document ids or a loss mask; the loss mask (with the EOD's,
  // --eod-mask-loss) turned into targets of -1. Empty otherwise: every micro-batch runs on ctx,
  // exactly as without documents.
  std::vector<model::ForwardContext> document_contexts(const model::ForwardContext& ctx,
                                                       std::vector<MicroBatch>& micro_batches) const {
    const model::DocumentMaskConfig dc = tc_.documents();
    const bool carried = std::any_of(micro_batches.begin(), micro_batches.end(), [](const MicroBatch& mb) {
      return !mb.positions.empty() || !mb.document_ids.empty() || !mb.loss_mask.empty();
    });
    if (!dc.any() && !carried) return {};
    std::vector<model::ForwardContext> out;
    for (MicroBatch& mb : micro_batches) {
      model::DocumentMasks masks = model::document_masks(mb.inputs, ctx.seq, dc);
      if (!mb.positions.empty()) masks.positions = mb.positions;
      if (!mb.document_ids.empty()) {
        masks.document_ids = mb.document_ids;
        masks.key_begin = model::key_begin_from_document_ids(mb.document_ids, ctx.seq);
      }
      for (std::size_t t = 0; t < mb.loss_mask.size(); ++t) masks.loss_mask[t] *= mb.loss_mask[t];
      out.push_back(ctx);
      model::apply_document_masks(out.back(), masks, mb.targets);
    }
    return out;
  }

  // Targets that carry a loss (ignored positions are < 0).
  static double count_loss_tokens(const std::vector<std::int32_t>& targets) {
    return static_cast<double>(std::count_if(targets.begin(), targets.end(), [](auto t) { return t >= 0; }));
  }

  static std::vector<std::unique_ptr<Stage>> make_stages(const model::ModelConfig& config, const TrainConfig& tc,
                                                         DeviceMesh<Comm>& mesh) {
    DSP_CHECK_AS(ConfigError, memory_space(Backend{}) == current_memory_space(),
                 "a trainer on a device backend must be built and run where its tensors live: inside "
                 "MemorySpaceScope(memory_space(Backend{})) on the rank's thread");
    config.validate_expert_parallel(mesh.ep_size());
    tc.recompute.validate();
    const ep::MoeOptions& moe = tc.moe;
    DSP_CHECK_AS(ConfigError, !std::isnan(moe.capacity_factor) && !std::isinf(moe.capacity_factor),
                 "--moe-expert-capacity-factor must be finite (<= 0: dropless), got ", moe.capacity_factor);
    DSP_CHECK_AS(ConfigError, std::isfinite(moe.aux_loss_coeff) && moe.aux_loss_coeff >= 0.0f,
                 "--moe-aux-loss-coeff must be finite and >= 0, got ", moe.aux_loss_coeff);
    DSP_CHECK_AS(ConfigError, std::isfinite(tc.moe_router_bias_update_rate) && tc.moe_router_bias_update_rate >= 0.0f,
                 "--moe-router-bias-update-rate must be finite and >= 0, got ", tc.moe_router_bias_update_rate);
    const int p = mesh.pp_size();
    const auto layers = tc.pipeline.stages(config.num_layers, p);
    std::vector<std::unique_ptr<Stage>> out;
    for (std::size_t s = static_cast<std::size_t>(mesh.pp_rank()); s < layers.size(); s += static_cast<std::size_t>(p))
      out.push_back(std::make_unique<Stage>(config, mesh.tensor_group(), layers[s], tc.seed, &mesh.expert_group()));
    return out;
  }

  // Loss scaling: multiplies every reduced gradient by 1 / scale and reports whether any rank of
  // the mesh saw an infinity or NaN (the flag goes through the model-parallel group, then the
  // data-parallel group, so every rank agrees); advances the scaler. Collective over the mesh.
  bool overflowed() {
    const bool mine = optimizer_.unscale_gradients(scaler_->inv_scale());
    const bool any = precision::any_rank(mesh_->data_group(), precision::any_rank(mesh_->model_group(), mine));
    scaler_->update(any);
    return any;
  }

  // Mixed precision keeps gradients in the storage type: the buckets' dtype is that type
  // (fp32, the default, is replaced; the other 16-bit type is a ConfigError).
  static dp::DdpConfig ddp_config(const TrainConfig& tc) {
    dp::DdpConfig c = tc.ddp;
    if constexpr (Optimizer::mixed) {
      const auto dtype = std::is_same_v<Storage, bf16> ? dp::GradReduceDType::Bf16 : dp::GradReduceDType::Fp16;
      DSP_CHECK_AS(ConfigError, c.grad_reduce_dtype == dtype || c.grad_reduce_dtype == dp::GradReduceDType::Fp32,
                   Precision::name, " mixed precision keeps gradients in ", Precision::name,
                   ": --grad-reduce-dtype must be ", Precision::name, " (or left at its default)");
      c.grad_reduce_dtype = dtype;
    }
    return c;
  }

  static int checked_stage(int stage) {
    zero::validate_zero_stage(stage);
    return stage;
  }

  Stage& chunk(int virtual_stage) { return *stages_[static_cast<std::size_t>(engine_.schedule().chunk_of(virtual_stage))]; }

  // This rank's table of tied embeddings split over stages, or null.
  Parameter* tied_embedding() {
    for (auto& s : stages_)
      if (Parameter* t = s->tied_embedding()) return t;
    return nullptr;
  }

  // The order gradients become final on this rank: chunk after chunk as their last backward
  // comes in the schedule; a tied table last of all (it waits for the other stage's part).
  // Only the routed experts' parameters (expert) or only the others.
  std::vector<Parameter*> grad_ready_order(bool expert) {
    std::vector<Parameter*> out;
    Parameter* tied = tied_embedding();
    for (int s : engine_.stages_by_last_backward())
      for (auto* p : chunk(s).grad_ready_order())
        if (p != tied && p->expert == expert) out.push_back(p);
    if (tied && !expert) out.push_back(tied);
    return out;
  }

  // The step's routing statistics of every MoE layer of the model: this rank's layers filled
  // in, summed over DP (all tokens) and over the pipeline (every stage's layers); the TP ranks
  // of a stage see the same routing, so they are not summed.
  std::vector<MoeStepStats> moe_step_stats() {
    const model::ModelConfig& c = model_config();
    if (!c.is_moe()) return {};
    const std::int64_t e = c.num_experts, width = e + 2;  // load [E], dropped, aux loss
    std::vector<double> sums(static_cast<std::size_t>((c.num_layers - c.first_k_dense_replace) * width));
    for (auto* m : moe_layers()) {
      const model::MoeLayerStats& st = m->stats();
      double* row = sums.data() + (st.layer - c.first_k_dense_replace) * width;
      for (std::int64_t i = 0; i < e; ++i) row[i] = double(st.tokens_per_expert[static_cast<std::size_t>(i)]);
      row[e] = double(st.dropped);
      row[e + 1] = st.aux_loss;
    }
    mesh_->data_group().all_reduce(std::span(sums));
    mesh_->pipeline_group().all_reduce(std::span(sums));
    std::vector<MoeStepStats> out;
    for (std::int64_t l = c.first_k_dense_replace; l < c.num_layers; ++l) {
      const double* row = sums.data() + (l - c.first_k_dense_replace) * width;
      MoeStepStats st{l, std::vector<std::int64_t>(static_cast<std::size_t>(e)), std::llround(row[e]), row[e + 1]};
      for (std::int64_t i = 0; i < e; ++i) st.tokens_per_expert[static_cast<std::size_t>(i)] = std::llround(row[i]);
      out.push_back(std::move(st));
    }
    return out;
  }

  // Auxiliary-loss-free balancing (DeepSeek-V3 section 2.1.2): every rank moves its copy of a
  // layer's expert bias by the same step, from the global load of the step.
  void update_expert_biases(const std::vector<MoeStepStats>& stats) {
    for (auto* m : moe_layers()) {
      Parameter* bias = m->expert_bias();
      if (!bias) continue;
      const MoeStepStats& st = stats[static_cast<std::size_t>(m->stats().layer - model_config().first_k_dense_replace)];
      Tensor host = bias->value.to_host();  // [E]: updated on the host wherever the bias lives
      ep::update_expert_bias(host.span(), st.tokens_per_expert, tc_.moe_router_bias_update_rate);
      bias->value.copy_from_host(host.span());
    }
  }

  std::vector<MicroBatch> next_micro_batches() {
    std::vector<MicroBatch> out;
    for (const auto& windows : sampler_.next_global_batch()) {
      MicroBatch mb;
      data_->batch(false, windows, mb.inputs, mb.targets);
      out.push_back(std::move(mb));
    }
    return out;
  }

  // Tied embeddings over stages: the first and last stage sum their table's gradient, then
  // it is final (its DP bucket may start).
  void sum_tied_embedding_grads() {
    Parameter* t = tied_embedding();
    if (!embedding_group_ || !t) return;
    trace::Span span("tied_embedding.all_reduce", trace::Kind::Comm);
    embedding_group_->all_reduce(t->grad.raw_span());
    buckets_.mark_ready(*t);
  }

  TrainConfig tc_;
  DeviceMesh<Comm>* mesh_;
  const data::SampleSource* data_;
  std::vector<std::unique_ptr<Stage>> stages_;
  dp::DataSampler sampler_;
  pp::Engine<Comm> engine_;
  dp::GradBuckets<Comm, Backend> buckets_;         // over DP: everything but the routed experts
  dp::GradBuckets<Comm, Backend> expert_buckets_;  // over expert-data parallelism: the routed experts
  Optimizer optimizer_;
  zero::WarmupCosine schedule_;
  std::unique_ptr<Comm> embedding_group_;  // first and last pipeline rank (tied embeddings over stages)
  std::optional<precision::DynamicLossScaler> scaler_;
  int skips_at_min_scale_ = 0;  // consecutive skipped steps at the minimum loss scale
  std::function<void(Trainer&)> grad_hook_;
};

}  // namespace dsp::train
