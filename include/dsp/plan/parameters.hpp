#pragma once
// The parameters one rank holds, enumerated without allocating: the same ShardedTensor specs,
// in the same order, that pp::PipelineStage (and so model::CausalLM) builds for a stage of
// layers on one tensor-parallel rank, with the local shape ShardedTensor gives at that TP size
// (vocabulary padded to a multiple of TP; K/V heads replicated when kv heads < TP). The ledger
// counts parameter, gradient and optimizer bytes from this list, so its parameter count is
// exactly what the model allocates (tests/plan/test_parameters.cpp checks it name by name
// against real stages at TP 1/2/4, PP 2, tied and untied, dense and MoE with EP).
//
// Mirrors (keep in step when they change): pp::PipelineStage's constructor (embedding, blocks,
// final norm, output layer or tied copy), model::DecoderBlock::parameters() (input norm,
// attention, post-attention norm, MLP or MoE), model::Attention (qkv_proj, o_proj),
// model::MLP (gate_up_proj, down_proj), model::MoELayer::parameters() (router, shared experts,
// this EP rank's routed experts) and buffers() (expert bias), i.e. PipelineStage::
// state_parameters().
#include <cstdint>
#include <string>
#include <vector>

#include "dsp/core/divide.hpp"
#include "dsp/model/config.hpp"
#include "dsp/parallel/sharded_tensor.hpp"
#include "dsp/pp/layer_split.hpp"

namespace dsp::plan {

/// One parameter (or saved buffer) of one rank.
struct StageParameter {
  ShardedTensor spec;      ///< global name, global shape and TP split
  Shape local_shape;       ///< spec.local_shape(tp): the shard this rank allocates
  bool expert = false;     ///< a routed expert's weight: data-parallel over expert-DP = DP / EP
  bool tied_copy = false;  ///< the last stage's copy of a tied embedding (trained, not saved)
  bool buffer = false;     ///< saved state without gradient or optimizer state (MoE expert bias)

  std::int64_t elements() const { return numel(local_shape); }
};

/// Elements of a rank's parameters, by how they are reduced and sharded over data parallelism.
struct ParameterCount {
  std::int64_t dense = 0;    ///< trained, data-parallel over DP (embedding, attention, norms, dense MLP, router, shared experts)
  std::int64_t expert = 0;   ///< trained, data-parallel over expert-DP (routed experts)
  std::int64_t buffers = 0;  ///< saved, not trained (no gradient, no optimizer state)

  std::int64_t trained() const { return dense + expert; }
  std::int64_t total() const { return dense + expert + buffers; }
};

/// The parameters, then the buffers, that a TP rank of `tp` and EP rank `ep_rank` of `ep` hold
/// for the stage `layers` of model `c`, in the order of PipelineStage::state_parameters(). Every TP rank's shards have the same shape, so the byte count is the same for
/// every rank of a stage; `ep_rank` only changes the routed experts' global indices.
/// Throws ConfigError (naming the numbers) when the model does not split over tp or ep.
inline std::vector<StageParameter> stage_parameters(const model::ModelConfig& c, int tp, int ep,
                                                    const pp::StageLayers& layers, int ep_rank = 0) {
  c.validate(tp);
  c.validate_expert_parallel(ep);
  std::vector<StageParameter> out, buffers;
  auto add = [&](ShardedTensor spec, bool expert = false, bool tied_copy = false) {
    Shape local = spec.local_shape(tp);
    out.push_back({std::move(spec), std::move(local), expert, tied_copy, false});
  };
  const std::int64_t h = c.hidden_size, d = c.head_dim();
  const std::string embed = "model.embed_tokens.weight";  // pp::PipelineStage::embed_name
  if (layers.pre_process) add(ShardedTensor::vocab(embed, {c.vocab_size, h}));
  for (std::int64_t l = layers.first_layer; l < layers.first_layer + layers.num_layers; ++l) {
    const std::string layer = "model.layers." + std::to_string(l), attn = layer + ".self_attn", mlp = layer + ".mlp";
    add(ShardedTensor::replicated(layer + ".input_layernorm.weight", {h}));
    add(ShardedTensor::qkv(attn + ".qkv_proj.weight", h, c.num_attention_heads, c.num_query_groups, d,
                           {attn + ".q_proj.weight", attn + ".k_proj.weight", attn + ".v_proj.weight"}));
    add(ShardedTensor::split(attn + ".o_proj.weight", {h, c.num_attention_heads * d}, 1));
    add(ShardedTensor::replicated(layer + ".post_attention_layernorm.weight", {h}));
    auto swiglu = [&](const std::string& prefix, std::int64_t ffn, bool expert) {
      add(ShardedTensor::gate_up(prefix + ".gate_up_proj.weight", h, ffn,
                                 {prefix + ".gate_proj.weight", prefix + ".up_proj.weight"}),
          expert);
      add(ShardedTensor::split(prefix + ".down_proj.weight", {h, ffn}, 1), expert);
    };
    if (!c.is_moe_layer(l)) {
      swiglu(mlp, c.ffn_hidden_size, false);
      continue;
    }
    add(ShardedTensor::replicated(mlp + ".gate.weight", {c.num_experts, h}));
    if (c.num_shared_experts > 0) swiglu(mlp + ".shared_experts", c.num_shared_experts * c.moe_ffn_hidden_size, false);
    const std::int64_t local = divide(c.num_experts, ep, "number of experts", "expert-model-parallel-size");
    for (std::int64_t e = local * ep_rank; e < local * (ep_rank + 1); ++e)
      swiglu(mlp + ".experts." + std::to_string(e), c.moe_ffn_hidden_size, true);
    if (c.moe_router_enable_expert_bias) {
      auto spec = ShardedTensor::replicated(mlp + ".gate.e_score_correction_bias", {c.num_experts});
      Shape shape = spec.local_shape(tp);
      buffers.push_back({std::move(spec), std::move(shape), false, false, true});
    }
  }
  if (layers.post_process) {
    add(ShardedTensor::replicated("model.norm.weight", {h}));
    if (!c.tie_word_embeddings) add(ShardedTensor::vocab("lm_head.weight", {c.vocab_size, h}));
    else if (!layers.pre_process) add(ShardedTensor::vocab(embed, {c.vocab_size, h}), false, true);
  }
  out.insert(out.end(), buffers.begin(), buffers.end());
  return out;
}

/// Elements of `params` by kind.
inline ParameterCount count(const std::vector<StageParameter>& params) {
  ParameterCount n;
  for (const auto& p : params) (p.buffer ? n.buffers : p.expert ? n.expert : n.dense) += p.elements();
  return n;
}

/// Elements one rank holds for stage `layers` (see stage_parameters).
inline ParameterCount stage_parameter_count(const model::ModelConfig& c, int tp, int ep, const pp::StageLayers& layers) {
  return count(stage_parameters(c, tp, ep, layers));
}

}  // namespace dsp::plan
