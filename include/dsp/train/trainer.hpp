#pragma once
// Trainer: the data-parallel x tensor-parallel training step.
//   for each micro-batch of this DP rank: forward, loss, backward (gradients accumulate)
//   on the last micro-batch: sum replicated K/V gradients over TP and all-reduce gradient
//   buckets over DP (overlapped with backward when --overlap-grad-reduce; dp/grad_buckets.hpp)
//   clip the global gradient norm; AdamW with the warmup + cosine learning rate.
// The loss is normalised by the global number of loss tokens (every micro-batch on every
// DP rank), so any (TP, DP, micro-batch) split of the same global batch gives the same
// update up to floating-point summation order.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <numeric>
#include <vector>

#include "dsp/core/trace.hpp"
#include "dsp/dp/data_sampler.hpp"
#include "dsp/dp/grad_buckets.hpp"
#include "dsp/model/causal_lm.hpp"
#include "dsp/train/token_dataset.hpp"
#include "dsp/zero/adamw.hpp"
#include "dsp/zero/grad_clip.hpp"
#include "dsp/zero/lr_schedule.hpp"

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
  zero::AdamWConfig adam;              ///< --adam-beta1/2, --adam-eps, --weight-decay
  std::uint64_t seed = 1234;           ///< --seed (parameters and data order)
  std::int64_t eval_iters = 4;         ///< --eval-iters (global batches of validation data)
  dp::DdpConfig ddp;                   ///< --ddp-bucket-size, --overlap-grad-reduce, --grad-reduce-dtype
};

/// What one optimizer step did.
struct StepResult {
  std::int64_t iteration = 0;  ///< 1-based number of this step
  double loss = 0.0;           ///< mean training loss over the global batch, nats/token
  float grad_norm = 0.0f;      ///< global gradient norm before clipping
  float lr = 0.0f;             ///< learning rate used
  std::int64_t tokens = 0;     ///< tokens in the global batch
  double seconds = 0.0;        ///< wall time of the step
};

template <class Policy>
class Trainer {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;

  /// Collective over the mesh. Throws ConfigError when the model does not split over TP or
  /// the batch sizes do not divide.
  Trainer(const model::ModelConfig& config, const TrainConfig& tc, DeviceMesh<Comm>& mesh, const TokenDataset& data)
      : tc_(tc),
        mesh_(&mesh),
        data_(&data),
        model_(config, mesh, tc.seed),
        optimizer_(model_.parameters(), tc.adam),
        clipper_(model_.parameters(), mesh.tp_size(), mesh.tp_rank()),
        buckets_(mesh.data_group(), model_.grad_ready_order(), tc.ddp),
        sampler_(data.train_windows(), tc.micro_batch_size, tc.global_batch_size, mesh.dp_size(), mesh.dp_rank(),
                 tc.seed),
        schedule_{tc.lr, tc.min_lr, tc.lr_warmup_iters, tc.lr_decay_iters > 0 ? tc.lr_decay_iters : tc.train_iters} {
    DSP_CHECK_AS(ConfigError, data.seq_length() == config.seq_length, "data windows of ", data.seq_length(),
                 " tokens do not match --seq-length ", config.seq_length);
    DSP_CHECK_AS(ConfigError, tc.eval_iters >= 1, "--eval-iters must be >= 1, got ", tc.eval_iters);
    DSP_CHECK_AS(ConfigError, data.val_windows() >= tc.global_batch_size, "the validation split holds ",
                 data.val_windows(), " sequences, fewer than one global batch of ", tc.global_batch_size);
  }

  /// One optimizer step over the next global batch. Collective over the mesh.
  StepResult train_step() {
    const auto t0 = std::chrono::steady_clock::now();
    trace::Span step_span("train_step", trace::Kind::Compute);
    model_.zero_grad();
    const std::int64_t seq = data_->seq_length();
    struct MicroBatch {
      std::int64_t sequences;
      std::vector<std::int32_t> inputs, targets;
    };
    std::vector<MicroBatch> micro_batches;
    std::vector<double> counts{0.0};  // loss tokens (targets >= 0) of the global batch
    for (const auto& windows : sampler_.next_global_batch()) {
      MicroBatch mb{static_cast<std::int64_t>(windows.size()), {}, {}};
      data_->batch(false, windows, mb.inputs, mb.targets);
      counts[0] += count_loss_tokens(mb.targets);
      micro_batches.push_back(std::move(mb));
    }
    mesh_->data_group().all_reduce(std::span(counts));
    const double loss_tokens = std::max(counts[0], 1.0);
    std::vector<double> loss_sum{0.0};
    const typename model::CausalLM<Policy>::GradReadyFn ready = [&](model::Parameter& p) { buckets_.mark_ready(p); };
    for (auto& mb : micro_batches) {
      const bool last = &mb == &micro_batches.back();
      const auto ctx = model::ForwardContext::for_training(mb.sequences, seq);
      typename model::CausalLM<Policy>::Activations act;
      const auto loss = model_.forward(ctx, std::move(mb.inputs), std::move(mb.targets), act);
      loss_sum[0] += std::accumulate(loss.begin(), loss.end(), 0.0);
      if (last) buckets_.begin_last_micro_batch();
      model_.backward(act, std::vector<float>(loss.size(), static_cast<float>(1.0 / loss_tokens)), last ? &ready : nullptr);
    }
    {
      trace::Span span("grad_buckets.finish", trace::Kind::Comm);
      buckets_.finish();
    }
    StepResult r;
    {
      trace::Span span("clip_grad", trace::Kind::Compute);
      r.grad_norm = clipper_.clip(mesh_->model_group(), tc_.clip_grad);
    }
    r.lr = schedule_(optimizer_.steps());
    {
      trace::Span span("optimizer.step", trace::Kind::Compute);
      optimizer_.step(r.lr);
    }
    mesh_->data_group().all_reduce(std::span(loss_sum));
    r.iteration = optimizer_.steps();
    r.loss = loss_sum[0] / loss_tokens;
    r.tokens = tc_.global_batch_size * seq;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }

  /// Mean validation loss (nats/token) over the first min(eval_iters, available) global
  /// batches of the validation split (the same windows every time; at least one batch, checked
  /// at construction). Collective over the mesh.
  double evaluate() {
    const std::int64_t seq = data_->seq_length(), per_rank = tc_.global_batch_size / mesh_->dp_size();
    const std::int64_t batches = std::min(tc_.eval_iters, data_->val_windows() / tc_.global_batch_size);
    std::vector<double> sums{0.0, 0.0};  // loss sum, tokens
    std::vector<std::int32_t> inputs, targets;
    for (std::int64_t b = 0; b < batches; ++b)
      for (std::int64_t m = 0; m < per_rank; m += tc_.micro_batch_size) {
        std::vector<std::int64_t> windows(static_cast<std::size_t>(tc_.micro_batch_size));
        std::iota(windows.begin(), windows.end(), b * tc_.global_batch_size + mesh_->dp_rank() * per_rank + m);
        data_->batch(true, windows, inputs, targets);
        const auto ctx = model::ForwardContext::for_training(tc_.micro_batch_size, seq);
        typename model::CausalLM<Policy>::Activations act;
        const auto loss = model_.forward(ctx, inputs, targets, act);
        sums[0] += std::accumulate(loss.begin(), loss.end(), 0.0);
        sums[1] += count_loss_tokens(targets);
      }
    mesh_->data_group().all_reduce(std::span(sums));
    return sums[0] / std::max(sums[1], 1.0);
  }

  model::CausalLM<Policy>& model() { return model_; }
  zero::AdamW<Backend>& optimizer() { return optimizer_; }
  dp::DataSampler& sampler() { return sampler_; }
  const dp::GradBuckets<Comm>& grad_buckets() const { return buckets_; }
  DeviceMesh<Comm>& mesh() { return *mesh_; }
  const TrainConfig& config() const { return tc_; }
  std::int64_t iteration() const { return optimizer_.steps(); }

 private:
  // Targets that carry a loss (ignored positions are < 0).
  static double count_loss_tokens(const std::vector<std::int32_t>& targets) {
    return static_cast<double>(std::count_if(targets.begin(), targets.end(), [](auto t) { return t >= 0; }));
  }

  TrainConfig tc_;
  DeviceMesh<Comm>* mesh_;
  const TokenDataset* data_;
  model::CausalLM<Policy> model_;
  zero::AdamW<Backend> optimizer_;
  zero::GradClipper<Backend> clipper_;
  dp::GradBuckets<Comm> buckets_;
  dp::DataSampler sampler_;
  zero::WarmupCosine schedule_;
};

}  // namespace dsp::train
