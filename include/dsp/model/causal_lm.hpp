#pragma once
// CausalLM: the decoder restricted to a range of its parts (model/part_range.hpp): a
// contiguous range of global layers, plus the embedding when the range starts the model and the
// final RMSNorm, output layer and vocab-parallel cross-entropy when it ends it (Megatron's
// GPTModel with pre_process / post_process). The whole model is the range that holds every
// layer and both ends; a pipeline stage (pp::PipelineStage) is the range pp/ assigns to it.
// Every part is tensor-parallel over the TP group. Each rank builds only its shards; the global
// model is the same for every layout (parameters drawn from (seed, name, global index)). Tied
// embeddings: the output layer multiplies by the embedding table ([vocab, hidden], split by
// vocabulary rows in both uses), so one parameter gets both gradients.
//
// The parts are built from the model's description of them, describe_parts (model/parts.hpp),
// kept as parts(); every reader walks that one list: ZeRO gathers per part (parameter_parts()),
// full recomputation re-runs groups of blocks, and the checkpoint (state_parameters()) and the
// ledger (plan/parameters.hpp, from the description alone) enumerate its tensors.
//
// Tied input/output embeddings over several stages: the last stage holds its own copy of
// model.embed_tokens.weight (initialised from the same (seed, name), so equal to the first
// stage's), marked Parameter::tied_copy. Its gradient and the first stage's are summed by the
// trainer between the two stages before the data-parallel reduction, so both copies take the
// same optimizer step and stay equal; only the first stage saves it and counts it in norms.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dsp/backend/host/moe_permute.hpp"
#include "dsp/core/memory_space.hpp"
#include "dsp/core/trace.hpp"
#include "dsp/model/decoder_block.hpp"
#include "dsp/model/part_range.hpp"
#include "dsp/model/parts.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/parallel/inference_mode.hpp"
#include "dsp/tp/vocab_parallel_cross_entropy.hpp"
#include "dsp/tp/vocab_parallel_embedding.hpp"

namespace dsp::model {

template <class Policy>
class CausalLM {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;

  /// Activations of one micro-batch on this stage, kept between its forward and its backward
  /// (one per micro-batch in flight). With 16-bit activations (ctx.activations) each block's
  /// tensors, each recompute group's input and the head's tensors are packed in 16 bits in
  /// between (precision::PackedTensors), each unpacked only just before its backward.
  struct Activations {
    ForwardContext ctx;
    std::vector<std::int32_t> ids, targets;
    std::vector<typename DecoderBlock<Policy>::Saved> blocks;
    /// Full recomputation: the kept input of each recompute group, at its first local layer.
    std::vector<Tensor> group_inputs;
    typename RMSNorm<Policy>::Saved final_norm;
    Tensor normed, logits;
    typename tp::VocabParallelCrossEntropy<Policy>::Saved loss;
    std::vector<precision::PackedTensors> packed_blocks;  ///< blocks[l] while packed
    std::vector<precision::PackedTensors> packed_inputs;  ///< group_inputs[l] while packed
    precision::PackedTensors packed_head;                 ///< head_tensors() while packed
    /// The last stage's kept tensors after the blocks: the final norm's input, its output and
    /// the logits.
    std::vector<Tensor*> head_tensors() { return {&final_norm.x, &normed, &logits}; }
  };

  /// Builds this rank's shards of every layer over the mesh's tensor group (collective over
  /// it), routed experts split over its expert group. Throws ConfigError (naming the numbers)
  /// when the config does not split over TP or EP.
  template <class MeshComm>
  CausalLM(const ModelConfig& config, DeviceMesh<MeshComm>& mesh, std::uint64_t seed)
      : CausalLM(config, mesh.tensor_group(), PartRange::whole(config.num_layers), seed, &mesh.expert_group()) {}

  /// Builds this rank's shards of the parts of `layers` (the decoder layers [first_layer, +
  /// num_layers), the embedding and the head at the ends): describe_parts(config, layers,
  /// EP size, EP rank), part by part, each from its spec. Collective over `tp` (K/V replica
  /// groups are split from it). ep: the expert-parallel group of an MoE model (null:
  /// expert-parallel size 1; it must outlive the model). Throws ConfigError (naming the
  /// numbers) when the config does not split over tp.size() or ep->size(), or the layer range
  /// lies outside the model.
  CausalLM(const ModelConfig& config, Comm& tp, PartRange layers, std::uint64_t seed, Comm* ep = nullptr)
      : config_((config.validate(tp.size()), config)),
        layers_(layers),
        spec_(describe_parts(config, layers, ep ? ep->size() : 1, ep ? ep->rank() : 0)),
        tp_(&tp),
        loss_(tp, config.vocab_size) {
    if (config.num_query_groups < tp.size())  // ranks sharing one K/V head
      kv_replicas_ = std::make_unique<Comm>(
          tp.split(static_cast<int>(tp.rank() * config.num_query_groups / tp.size()), tp.rank()));
    if (config.is_moe() && !ep) {  // every expert on this rank: a group of one
      own_ep_ = std::make_unique<Comm>(tp.split(tp.rank(), 0));
      ep = own_ep_.get();
    }
    if (spec_.embedding) embed_.emplace(tp, *spec_.embedding, seed);
    for (const auto& block : spec_.blocks)
      blocks_.push_back(std::make_unique<DecoderBlock<Policy>>(tp, ep ? *ep : tp, config, block, seed));
    if (!spec_.head) return;
    final_norm_.emplace(spec_.head->final_norm, config.norm_epsilon, tp.size(), tp.rank());
    if (spec_.head->lm_head) {
      lm_head_.emplace(tp, spec_.head->lm_head->tensor, spec_.head->lm_head->init, seed);
    } else if (spec_.head->tied_copy) {  // tied over stages: this stage's copy of the first stage's table
      tied_copy_ = std::make_unique<Parameter>(*spec_.head->tied_copy, seed, tp.size(), tp.rank());
      lm_head_.emplace(tp, *tied_copy_);
    } else {
      lm_head_.emplace(tp, embed_->weight());
    }
  }

  /// The description this rank's model was built from (model/parts.hpp): its parts and their
  /// tensors, in the order of parameter_parts() and state_parameters().
  const ModelParts& parts() const { return spec_; }

  /// ZeRO stages 2 and 3 (zero::ZeroOptimizer::acquire / release): the stage calls acquire with
  /// the parameters one part of it (the embedding, one block, the final norm with the output
  /// layer) is about to read, before that part's forward, its backward (backward = true) and
  /// a full recomputation's re-run, with the part expected next in the same direction (null at
  /// the end), and release with the same list once the part is done.
  struct ParameterHooks {
    std::function<void(const std::vector<Parameter*>& part, const std::vector<Parameter*>* next, bool backward)>
        acquire;
    std::function<void(const std::vector<Parameter*>& part)> release;
  };

  /// Installs the hooks (an empty ParameterHooks removes them); they must outlive their use.
  void set_parameter_hooks(ParameterHooks hooks) { hooks_ = std::move(hooks); }

  /// The parts acquire() is called with, in forward order: the embedding table (first stage),
  /// each block's parameters(), the final norm's weight with the output layer's (last stage;
  /// a tied table is the embedding's or its copy).
  const std::vector<std::vector<Parameter*>>& parameter_parts() {
    if (parts_.empty()) {
      if (embed_) parts_.push_back({&embed_->weight()});
      for (auto& b : blocks_) parts_.push_back(b->parameters());
      if (layers_.post_process) parts_.push_back({&final_norm_->weight(), &lm_head_->weight()});
    }
    return parts_;
  }

  CausalLM(const CausalLM&) = delete;  // layers hold pointers into the model
  CausalLM& operator=(const CausalLM&) = delete;

  /// Training forward of one micro-batch. First stage: embeds `ids` [batch * seq] (x unused);
  /// other stages: x = hidden states [batch * seq, hidden] from the previous stage. Last stage:
  /// returns the per-token loss [batch * seq] in nats (0 where target < 0; needs `targets`);
  /// other stages: hidden states [batch * seq, hidden] for the next stage. Keeps activations
  /// in `act` for backward. Throws InputError for a token id outside the vocabulary.
  Tensor forward(const ForwardContext& ctx, std::vector<std::int32_t> ids, std::vector<std::int32_t> targets,
                 Tensor x, Activations& act) {
    trace::Span span("forward", trace::Kind::Compute);
    act.ctx = ctx;
    act.ids = std::move(ids);
    act.targets = std::move(targets);
    Tensor y = run(ctx, act.ids, std::move(x), &act);
    std::vector<float> loss;
    if (layers_.post_process) {
      act.logits = std::move(y);
      loss = loss_.forward(act.logits, act.targets, act.loss);
    }
    act.packed_head.pack(Backend{}, ctx.activations, act.head_tensors());
    if (!layers_.post_process) return y;
    return Tensor({static_cast<std::int64_t>(loss.size())}, loss);
  }

  /// Called by backward for each parameter whose gradient is final for the step.
  using GradReadyFn = std::function<void(Parameter&)>;

  /// Backward of one micro-batch: dy = dL/dloss per token [batch * seq] on the last stage
  /// (e.g. 1 / global loss tokens), else dL/d(this stage's output) [batch * seq, hidden].
  /// Accumulates into every parameter's grad and returns dL/d(input hidden states)
  /// [batch * seq, hidden] (empty on the first stage). Frees the activations.
  /// On the last micro-batch of a step pass `on_grad_ready`: backward then also sums, layer
  /// by layer, the partial gradients of K/V heads replicated over TP ranks (kv heads < TP;
  /// collective over the TP group) and calls on_grad_ready(p) for every parameter as soon as
  /// its gradient for the step is final, in grad_ready_order(), except the tied embedding of
  /// a model split over stages (tied_embedding()), whose gradient is final only once the
  /// caller summed it between the first and last stage.
  /// Throws Error when the model was built in an InferenceMode scope (it has no gradients).
  Tensor backward(Activations& act, const Tensor& dy, const GradReadyFn* on_grad_ready = nullptr) {
    DSP_CHECK(!inference_, "CausalLM::backward: the model was built in an InferenceMode scope and has no "
              "gradients; build it outside one to train it");
    trace::Span span("backward", trace::Kind::Compute);
    const auto ready = [&](Parameter& p) {
      if (on_grad_ready && &p != tied_embedding()) (*on_grad_ready)(p);
    };
    Tensor dx;
    act.packed_head.unpack(Backend{}, act.head_tensors());
    const std::size_t first_block = embed_ ? 1 : 0;  // parameter_parts() index of block 0
    if (!layers_.post_process) {
      dx = dy;
    } else {
      const std::size_t head = parameter_parts().size() - 1;
      acquire(head, head > 0 ? std::optional(head - 1) : std::nullopt, true);
      dx = lm_head_->backward(act.normed, loss_.backward(act.logits, act.targets, dy, act.loss));
      if (!config_.tie_word_embeddings) ready(lm_head_->weight());
      dx = final_norm_->backward(dx, act.final_norm);
      ready(final_norm_->weight());
      release(head);
    }
    for (std::size_t l = blocks_.size(); l-- > 0;) {
      const std::size_t part = first_block + l;
      acquire(part, part > 0 ? std::optional(part - 1) : std::nullopt, true);
      recompute_group_ending_at(l, act);
      act.packed_blocks[l].unpack(Backend{}, act.blocks[l].tensors());
      dx = blocks_[l]->backward(act.ctx, dx, act.blocks[l]);
      act.blocks[l] = {};  // this layer's activations are spent
      if (on_grad_ready) {
        if (kv_replicas_) kv_replicas_->all_reduce(blocks_[l]->replicated_kv_grad());
        for (auto* p : blocks_[l]->parameters()) ready(*p);
      }
      release(part);
    }
    if (embed_) {
      acquire(0, std::nullopt, true);
      embed_->backward(act.ids, dx);
      ready(embed_->weight());
      release(0);
      dx = Tensor{};
    }
    act = Activations{};
    return dx;
  }

  /// Inference forward (no activations kept): first stage embeds `ids` [batch * seq], others
  /// take x = hidden states [batch * seq, hidden]; tokens at ctx.positions (their keys and
  /// values written to and read from ctx.paged when set). Returns the hidden states for the
  /// next stage, or on the last stage this rank's logits [rows, vocab_padded / tp] (padding
  /// columns must be masked), rows = ctx.logit_rows in that order, or every token when empty.
  Tensor infer(const ForwardContext& ctx, const std::vector<std::int32_t>& ids, Tensor x) {
    return run(ctx, ids, std::move(x), nullptr);
  }

  /// The whole model's training forward of one micro-batch: ids and targets [batch * seq] ->
  /// per-token loss [batch * seq] in nats (0 where target < 0). Keeps activations in `act`.
  std::vector<float> forward(const ForwardContext& ctx, std::vector<std::int32_t> ids, std::vector<std::int32_t> targets,
                             Activations& act) {
    const Tensor loss = forward(ctx, std::move(ids), std::move(targets), Tensor{}, act);
    return {loss.values().begin(), loss.values().end()};
  }

  /// The whole model's backward of one micro-batch given dL/dloss per token [batch * seq]; see
  /// backward above (on_grad_ready reports every parameter, the tied table last).
  void backward(Activations& act, const std::vector<float>& dloss, const GradReadyFn* on_grad_ready = nullptr) {
    const auto n = static_cast<std::int64_t>(dloss.size());
    backward(act, Tensor({n}, dloss).to(current_memory_space()), on_grad_ready);
  }

  /// The whole model's inference forward: ids [batch * seq] at ctx.positions (through the
  /// paged KV cache ctx.paged when set) -> this rank's logits [rows, vocab_padded / tp], rows =
  /// *ctx.logit_rows (every token without it); padding columns hold logits of zero weight rows,
  /// which callers must mask (see padded_vocab()).
  Tensor logits(const ForwardContext& ctx, const std::vector<std::int32_t>& ids) { return infer(ctx, ids, Tensor{}); }

  /// Vocabulary rounded up to a multiple of TP (columns of the gathered logits).
  std::int64_t padded_vocab() const { return lm_head_->out_local() * tp_->size(); }

  /// Every parameter of this stage once, in a fixed order (a tied table appears once; on the
  /// last stage of a split model its copy comes last).
  std::vector<Parameter*> parameters() {
    std::vector<Parameter*> p;
    if (embed_) p.push_back(&embed_->weight());
    for (auto& b : blocks_)
      for (auto* q : b->parameters()) p.push_back(q);
    if (final_norm_) p.push_back(&final_norm_->weight());
    if (lm_head_ && !config_.tie_word_embeddings) p.push_back(&lm_head_->weight());
    if (tied_copy_) p.push_back(tied_copy_.get());
    return p;
  }
  /// The parameters of this stage that serving's forward passes multiply by whole
  /// (linear_forward's w [out, in]): the blocks' 2-D parameters but MLA's kv_b_proj (read per
  /// head, MLAttention::kv_b_weight), and the output layer's weight (the embedding table when
  /// tied); not an input embedding that is only looked up.
  std::vector<Parameter*> serving_matmul_weights() {
    std::vector<Parameter*> out;
    for (auto& b : blocks_)
      for (auto* p : b->parameters())
        if (p->value.rank() == 2 && !(b->mla() && p == &b->mla()->kv_b_weight())) out.push_back(p);
    if (lm_head_) out.push_back(&lm_head_->weight());
    return out;
  }

  /// What a checkpoint holds of this stage: parameters(), then the state gradients do not
  /// train (MoE expert biases).
  std::vector<Parameter*> state_parameters() {
    std::vector<Parameter*> out = parameters();
    for (auto& b : blocks_)
      for (auto* q : b->buffers()) out.push_back(q);
    return out;
  }
  /// Values per token of each local layer's paged KV cache on this rank, first to last
  /// (DecoderBlock::kv_values_per_token; global layer layers().first_layer + i).
  std::vector<std::int64_t> kv_values_per_token() const {
    std::vector<std::int64_t> out;
    for (const auto& b : blocks_) out.push_back(b->kv_values_per_token());
    return out;
  }
  /// This stage's MoE layers, first to last (empty for a dense model).
  std::vector<MoELayer<Policy>*> moe_layers() {
    std::vector<MoELayer<Policy>*> out;
    for (auto& b : blocks_)
      if (auto* m = b->moe()) out.push_back(m);
    return out;
  }

  /// parameters() in the order backward finishes their gradients: the output layer (when
  /// untied), the final norm, the blocks from the last to the first, the embedding or its
  /// tied copy (last: a tied table's gradient is final only after the output layer's part and,
  /// over stages, the sum between stages).
  std::vector<Parameter*> grad_ready_order() {
    std::vector<Parameter*> p;
    if (lm_head_ && !config_.tie_word_embeddings) p.push_back(&lm_head_->weight());
    if (final_norm_) p.push_back(&final_norm_->weight());
    for (std::size_t l = blocks_.size(); l-- > 0;)
      for (auto* q : blocks_[l]->parameters()) p.push_back(q);
    if (tied_copy_) p.push_back(tied_copy_.get());
    if (embed_) p.push_back(&embed_->weight());
    return p;
  }

  /// The embedding table whose gradient must be summed with another stage's before the
  /// step: the first stage's table or the last stage's copy when the embeddings are tied and
  /// the model is split over stages; null otherwise.
  Parameter* tied_embedding() {
    if (!config_.tie_word_embeddings || (layers_.pre_process && layers_.post_process)) return nullptr;
    if (tied_copy_) return tied_copy_.get();
    return embed_ ? &embed_->weight() : nullptr;
  }

  /// True when the model was built in an InferenceMode scope: its parameters have no gradients.
  bool inference() const { return inference_; }

  void zero_grad() {
    for (auto* p : parameters()) p->grad.zero();
  }

  const ModelConfig& config() const { return config_; }
  const PartRange& layers() const { return layers_; }
  Comm& tensor_group() { return *tp_; }

 private:
  // The embedding (first stage), this stage's blocks and, on the last stage, the final norm
  // and output layer: hidden states [tokens, hidden] or logits [tokens, vocab_padded / tp].
  // act: keeps what backward needs (null: inference). Throws Error when x (on a stage without
  // the embedding) is not [ctx.tokens(), hidden].
  Tensor run(const ForwardContext& ctx, const std::vector<std::int32_t>& ids, Tensor x, Activations* act) {
    const std::size_t first_block = embed_ ? 1 : 0, parts = parameter_parts().size();
    const auto next = [&](std::size_t part) { return part + 1 < parts ? std::optional(part + 1) : std::nullopt; };
    if (embed_) {
      acquire(0, next(0), false);
      x = embed_->forward(ids);
      release(0);
      precision::round_activations(Backend{}, ctx.activations, x);
    }
    DSP_CHECK(x.rank() == 2 && x.dim(0) == ctx.tokens() && x.dim(1) == config_.hidden_size, "pipeline stage input ",
              shape_str(x.shape()), " is not [", ctx.tokens(), ", ", config_.hidden_size, "]");
    if (act) {
      act->blocks.resize(blocks_.size());
      act->group_inputs.resize(blocks_.size());
      act->packed_blocks.resize(blocks_.size());
      act->packed_inputs.resize(blocks_.size());
    }
    const auto n = static_cast<std::int64_t>(blocks_.size());
    for (std::int64_t l = 0; l < n; ++l) {
      const auto i = static_cast<std::size_t>(l);
      const auto group = act ? ctx.recompute.group(l, n) : std::nullopt;  // full recomputation
      if (group && group->first == l) {
        act->group_inputs[i] = x;
        act->packed_inputs[i].pack(Backend{}, ctx.activations, {&act->group_inputs[i]});
      }
      const std::size_t part = first_block + i;
      acquire(part, next(part), false);
      x = blocks_[i]->forward(ctx, x, act && !group ? &act->blocks[i] : nullptr);
      if (act && !group) act->packed_blocks[i].pack(Backend{}, ctx.activations, act->blocks[i].tensors());
      release(part);
    }
    if (!layers_.post_process) return x;
    if (ctx.logit_rows) {  // serving: only the rows that are sampled
      Tensor rows({static_cast<std::int64_t>(ctx.logit_rows->size()), config_.hidden_size});
      const SpaceArray<std::int64_t> order(*ctx.logit_rows);
      permute_rows(Backend{}, x.data(), order.data(), rows.dim(0), 1, config_.hidden_size, rows.data());
      x = std::move(rows);
    }
    acquire(parts - 1, std::nullopt, false);
    Tensor normed = final_norm_->forward(x, act ? &act->final_norm : nullptr);
    precision::round_activations(Backend{}, ctx.activations, normed);
    Tensor logits = lm_head_->forward(normed);
    precision::round_activations(Backend{}, ctx.activations, logits);  // the loss computes in fp32 from them
    release(parts - 1);
    if (act) act->normed = std::move(normed);
    return logits;
  }

  // Full recomputation: before the backward of local layer l that ends its recompute group,
  // re-runs the group's forward from its kept input, keeping its activations this time.
  void recompute_group_ending_at(std::size_t l, Activations& act) {
    const auto n = static_cast<std::int64_t>(blocks_.size());
    const auto group = act.ctx.recompute.group(static_cast<std::int64_t>(l), n);
    if (!group || group->second != static_cast<std::int64_t>(l) + 1) return;
    trace::Span span("recompute", trace::Kind::Compute);
    ForwardContext ctx = act.ctx;
    ctx.recomputing = true;
    const auto first = static_cast<std::size_t>(group->first);
    act.packed_inputs[first].unpack(Backend{}, {&act.group_inputs[first]});  // 16-bit until its group is needed
    Tensor x = std::move(act.group_inputs[first]);
    const std::size_t first_block = embed_ ? 1 : 0;
    for (std::int64_t k = group->first; k < group->second; ++k) {
      const std::size_t part = first_block + static_cast<std::size_t>(k);
      acquire(part, std::nullopt, true);
      x = blocks_[static_cast<std::size_t>(k)]->forward(ctx, x, &act.blocks[static_cast<std::size_t>(k)]);
      release(part);
    }
  }

  // The hooks around part `part` of parameter_parts() (nothing without hooks).
  void acquire(std::size_t part, std::optional<std::size_t> next, bool backward) {
    if (hooks_.acquire) hooks_.acquire(parts_[part], next ? &parts_[*next] : nullptr, backward);
  }
  void release(std::size_t part) {
    if (hooks_.release) hooks_.release(parts_[part]);
  }

  ModelConfig config_;
  bool inference_ = inference_mode();  // built in an InferenceMode scope: no gradients
  PartRange layers_;
  ModelParts spec_;
  Comm* tp_;
  std::optional<tp::VocabParallelEmbedding<Policy>> embed_;
  std::vector<std::unique_ptr<DecoderBlock<Policy>>> blocks_;
  std::optional<RMSNorm<Policy>> final_norm_;
  std::unique_ptr<Parameter> tied_copy_;
  std::optional<tp::ColumnParallelLinear<Policy>> lm_head_;
  tp::VocabParallelCrossEntropy<Policy> loss_;
  std::unique_ptr<Comm> kv_replicas_;
  std::unique_ptr<Comm> own_ep_;  // expert-parallel group of one when none was given
  ParameterHooks hooks_;
  std::vector<std::vector<Parameter*>> parts_;  // parameter_parts(), built on first use
};

}  // namespace dsp::model
