#pragma once
// The parameters one rank holds, enumerated without allocating: the model's own description of
// its parts (model::describe_parts, model/parts.hpp), from which model::CausalLM (and so every
// pipeline stage) builds itself, with the local shape ShardedTensor gives at the TP size
// (vocabulary padded to a multiple of TP; K/V heads replicated when kv heads < TP). The ledger
// counts parameter, gradient and optimizer bytes from this list, so its parameter count is
// exactly what the model allocates (tests/plan/test_parameters.cpp checks it name by name
// against real stages at TP 1/2/4, PP 2, tied and untied, dense and MoE with EP).
#include <cstdint>
#include <vector>

#include "dsp/model/config.hpp"
#include "dsp/model/parts.hpp"
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
/// for the stage `layers` of model `c`, in the order of model::CausalLM::state_parameters()
/// (model::ModelParts::state()). Every TP rank's shards have the same shape, so the byte count
/// is the same for every rank of a stage; `ep_rank` only changes the routed experts' global
/// indices.
/// Throws ConfigError (naming the numbers) when the model does not split over tp or ep.
inline std::vector<StageParameter> stage_parameters(const model::ModelConfig& c, int tp, int ep,
                                                    const pp::StageLayers& layers, int ep_rank = 0) {
  c.validate(tp);
  c.validate_expert_parallel(ep);
  const model::ModelParts parts = model::describe_parts(c, layers, ep, ep_rank);
  std::vector<StageParameter> out;
  for (const ParameterSpec* p : parts.state())
    out.push_back({p->tensor, p->local_shape(tp), p->expert, p->tied_copy, p->buffer});
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
