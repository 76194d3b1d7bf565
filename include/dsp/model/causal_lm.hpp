#pragma once
// CausalLM: embedding -> decoder blocks -> final RMSNorm -> output layer -> vocab-parallel
// cross-entropy, every part tensor-parallel. Each rank builds only its shards; the global
// model is the same for every layout (parameters drawn from (seed, name, global index)).
// Tied embeddings: the output layer multiplies by the embedding table ([vocab, hidden],
// split by vocabulary rows in both uses), so one parameter gets both gradients.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dsp/core/trace.hpp"
#include "dsp/model/decoder_block.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/tp/vocab_parallel_cross_entropy.hpp"
#include "dsp/tp/vocab_parallel_embedding.hpp"

namespace dsp::model {

template <class Policy>
class CausalLM {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;

  /// Activations of one micro-batch, kept between its forward and its backward.
  struct Activations {
    ForwardContext ctx;
    std::vector<std::int32_t> ids, targets;
    std::vector<typename DecoderBlock<Policy>::Saved> blocks;
    typename RMSNorm<Policy>::Saved final_norm;
    Tensor normed, logits;
    typename tp::VocabParallelCrossEntropy<Policy>::Saved loss;
  };

  /// Builds this rank's shards. Throws ConfigError (naming the numbers) when the config does
  /// not split over the mesh's tensor-parallel size.
  CausalLM(const ModelConfig& config, DeviceMesh<Comm>& mesh, std::uint64_t seed)
      : config_(checked(config, mesh.tp_size())),
        tp_(&mesh.tensor_group()),
        embed_(*tp_, "model.embed_tokens.weight", config.vocab_size, config.hidden_size,
               {Init::Normal, config.init_method_std}, seed),
        final_norm_("model.norm.weight", config.hidden_size, config.norm_epsilon, tp_->size(), tp_->rank()),
        loss_(*tp_, config.vocab_size) {
    if (config.num_query_groups < tp_->size())  // ranks sharing one K/V head
      kv_replicas_ = std::make_unique<Comm>(
          tp_->split(static_cast<int>(tp_->rank() * config.num_query_groups / tp_->size()), tp_->rank()));
    for (std::int64_t l = 0; l < config.num_layers; ++l)
      blocks_.push_back(std::make_unique<DecoderBlock<Policy>>(*tp_, config, l, seed));
    if (config.tie_word_embeddings)
      lm_head_ = std::make_unique<tp::ColumnParallelLinear<Policy>>(*tp_, embed_.weight());
    else
      lm_head_ = std::make_unique<tp::ColumnParallelLinear<Policy>>(
          *tp_, ShardedTensor::vocab("lm_head.weight", {config.vocab_size, config.hidden_size}),
          Init{Init::Normal, config.init_method_std}, seed);
  }

  CausalLM(const CausalLM&) = delete;  // layers hold pointers into the model
  CausalLM& operator=(const CausalLM&) = delete;

  /// Training forward of one micro-batch: ids and targets [batch * seq] -> per-token loss
  /// [batch * seq] in nats (0 where target < 0). Keeps activations in `act` for backward.
  std::vector<float> forward(const ForwardContext& ctx, std::vector<std::int32_t> ids, std::vector<std::int32_t> targets,
                             Activations& act) {
    trace::Span span("forward", trace::Kind::Compute);
    act.ctx = ctx;
    act.ids = std::move(ids);
    act.targets = std::move(targets);
    act.blocks.resize(blocks_.size());
    Tensor x = embed_.forward(act.ids);
    for (std::size_t l = 0; l < blocks_.size(); ++l) x = blocks_[l]->forward(ctx, x, &act.blocks[l]);
    act.normed = final_norm_.forward(x, &act.final_norm);
    act.logits = lm_head_->forward(act.normed);
    return loss_.forward(act.logits, act.targets, act.loss);
  }

  /// Called by backward for each parameter whose gradient is final for the step.
  using GradReadyFn = std::function<void(Parameter&)>;

  /// Backward of one micro-batch given dL/dloss per token (e.g. 1 / global loss tokens);
  /// accumulates into every parameter's grad. Frees the activations.
  /// On the last micro-batch of a step pass `on_grad_ready`: backward then also sums, layer
  /// by layer, the partial gradients of K/V heads replicated over TP ranks (kv heads < TP;
  /// collective over the TP group) and calls on_grad_ready(p) for every parameter as soon as
  /// its gradient for the step is final, in grad_ready_order() (what the data-parallel
  /// buckets overlap their all-reduces with).
  void backward(Activations& act, const std::vector<float>& dloss, const GradReadyFn* on_grad_ready = nullptr) {
    trace::Span span("backward", trace::Kind::Compute);
    const auto ready = [&](Parameter& p) {
      if (on_grad_ready) (*on_grad_ready)(p);
    };
    Tensor dx = lm_head_->backward(act.normed, loss_.backward(act.logits, act.targets, dloss, act.loss));
    if (!config_.tie_word_embeddings) ready(lm_head_->weight());
    dx = final_norm_.backward(dx, act.final_norm);
    ready(final_norm_.weight());
    for (std::size_t l = blocks_.size(); l-- > 0;) {
      dx = blocks_[l]->backward(act.ctx, dx, act.blocks[l]);
      if (!on_grad_ready) continue;
      if (kv_replicas_) kv_replicas_->all_reduce(blocks_[l]->replicated_kv_grad());
      for (auto* p : blocks_[l]->parameters()) ready(*p);
    }
    embed_.backward(act.ids, dx);
    ready(embed_.weight());
    act = Activations{};
  }

  /// Inference forward: ids [batch * seq] at ctx.positions (appending to ctx.cache when set)
  /// -> this rank's logits [batch * seq, vocab_padded / tp]; padding columns are garbage-free
  /// zeros-weight logits that callers must mask (see padded_vocab()).
  Tensor logits(const ForwardContext& ctx, const std::vector<std::int32_t>& ids) {
    Tensor x = embed_.forward(ids);
    for (auto& b : blocks_) x = b->forward(ctx, x, nullptr);
    return lm_head_->forward(final_norm_.forward(x, nullptr));
  }

  /// Every parameter of this rank once, in a fixed order (the tied table appears once).
  std::vector<Parameter*> parameters() {
    std::vector<Parameter*> p{&embed_.weight()};
    for (auto& b : blocks_)
      for (auto* q : b->parameters()) p.push_back(q);
    p.push_back(&final_norm_.weight());
    if (!config_.tie_word_embeddings) p.push_back(&lm_head_->weight());
    return p;
  }
  /// parameters() in the order backward finishes their gradients: the output layer (when
  /// untied), the final norm, the blocks from the last to the first, the embedding (tied:
  /// last, since the output layer also writes its gradient).
  std::vector<Parameter*> grad_ready_order() {
    std::vector<Parameter*> p;
    if (!config_.tie_word_embeddings) p.push_back(&lm_head_->weight());
    p.push_back(&final_norm_.weight());
    for (std::size_t l = blocks_.size(); l-- > 0;)
      for (auto* q : blocks_[l]->parameters()) p.push_back(q);
    p.push_back(&embed_.weight());
    return p;
  }

  void zero_grad() {
    for (auto* p : parameters()) p->grad.zero();
  }

  const ModelConfig& config() const { return config_; }
  Comm& tensor_group() { return *tp_; }
  std::int64_t kv_heads_local() const { return blocks_.front()->kv_heads_local(); }
  /// Vocabulary rounded up to a multiple of TP (columns of the gathered logits).
  std::int64_t padded_vocab() const { return lm_head_->out_local() * tp_->size(); }

 private:
  static const ModelConfig& checked(const ModelConfig& c, int tp) {
    c.validate(tp);
    return c;
  }

  ModelConfig config_;
  Comm* tp_;
  tp::VocabParallelEmbedding<Policy> embed_;
  std::vector<std::unique_ptr<DecoderBlock<Policy>>> blocks_;
  RMSNorm<Policy> final_norm_;
  std::unique_ptr<tp::ColumnParallelLinear<Policy>> lm_head_;
  tp::VocabParallelCrossEntropy<Policy> loss_;
  std::unique_ptr<Comm> kv_replicas_;
};

}  // namespace dsp::model
