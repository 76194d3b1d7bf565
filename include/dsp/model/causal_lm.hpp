#pragma once
// CausalLM: the whole decoder on one pipeline stage: embedding -> decoder blocks -> final
// RMSNorm -> output layer -> vocab-parallel cross-entropy, every part tensor-parallel. Each
// rank builds only its shards; the global model is the same for every layout (parameters
// drawn from (seed, name, global index)). Tied embeddings: the output layer multiplies by the
// embedding table ([vocab, hidden], split by vocabulary rows in both uses), so one parameter
// gets both gradients. Split over several pipeline stages, the same parts are pp::PipelineStage.
#include <vector>

#include "dsp/parallel/device_mesh.hpp"
#include "dsp/pp/pipeline_stage.hpp"

namespace dsp::model {

template <class Policy>
class CausalLM : public pp::PipelineStage<Policy> {
  using Base = pp::PipelineStage<Policy>;

 public:
  using typename Base::Activations;
  using typename Base::GradReadyFn;
  using Base::backward;
  using Base::forward;

  /// Builds this rank's shards of every layer over the mesh's tensor group (collective over
  /// it), routed experts split over its expert group. Throws ConfigError (naming the numbers)
  /// when the config does not split over TP or EP.
  template <class Comm>
  CausalLM(const ModelConfig& config, DeviceMesh<Comm>& mesh, std::uint64_t seed)
      : Base(config, mesh.tensor_group(), pp::StageLayers::whole(config.num_layers), seed, &mesh.expert_group()) {}

  /// Training forward of one micro-batch: ids and targets [batch * seq] -> per-token loss
  /// [batch * seq] in nats (0 where target < 0). Keeps activations in `act` for backward.
  std::vector<float> forward(const ForwardContext& ctx, std::vector<std::int32_t> ids, std::vector<std::int32_t> targets,
                             Activations& act) {
    const Tensor loss = Base::forward(ctx, std::move(ids), std::move(targets), Tensor{}, act);
    return {loss.values().begin(), loss.values().end()};
  }

  /// Backward of one micro-batch given dL/dloss per token [batch * seq]; see
  /// PipelineStage::backward (on_grad_ready reports every parameter, the tied table last).
  void backward(Activations& act, const std::vector<float>& dloss, const GradReadyFn* on_grad_ready = nullptr) {
    const auto n = static_cast<std::int64_t>(dloss.size());
    Base::backward(act, Tensor({n}, dloss).to(current_memory_space()), on_grad_ready);
  }

  /// Inference forward: ids [batch * seq] at ctx.positions (through the paged KV cache
  /// ctx.paged when set) -> this rank's logits [rows, vocab_padded / tp], rows = *ctx.logit_rows
  /// (every token without it); padding columns hold logits of zero weight rows, which callers
  /// must mask (see padded_vocab()).
  Tensor logits(const ForwardContext& ctx, const std::vector<std::int32_t>& ids) { return this->infer(ctx, ids, Tensor{}); }

  std::int64_t kv_heads_local() const { return this->blocks_.front()->kv_heads_local(); }
  /// Vocabulary rounded up to a multiple of TP (columns of the gathered logits).
  std::int64_t padded_vocab() const { return this->lm_head_->out_local() * this->tp_->size(); }
};

}  // namespace dsp::model
