#pragma once
// Validation of a training plan before anything runs: every rule a layout, a batch and a
// schedule must satisfy, each broken rule reported as a sentence naming the numbers involved.
//   tensor parallelism  TP divides the hidden size, the attention heads and the (MoE) FFN
//       widths; the KV heads and TP divide one another (K/V heads are split when kv >= TP,
//       replicated when kv < TP; ShardedTensor's Qkv split);
//   pipeline  PP divides the layers (Megatron's rule), unless --pipeline-layer-split gives
//       the counts (p x v entries summing to the layers); interleaving: layers divisible by
//       PP x layers-per-virtual-stage, micro-batches a multiple of PP;
//   data  global batch = micro batch x DP x accumulation steps, i.e. micro x DP divides it;
//   schedule  micro-batches >= PP for 1F1B (fewer leave stages idle for most of the step;
//       Narayanan et al. 2021 assume m >= p);
//   experts  EP divides the routed experts and DP;
//   world  TP x PP x DP equals the world size when one is given.
#include <string>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/plan/ledger.hpp"

namespace dsp::plan {

/// Every rule `plan` breaks, one sentence each (empty when it is valid). world_size > 0 also
/// checks TP x PP x DP against it.
inline std::vector<std::string> problems(const TrainingPlan& plan, int world_size = 0) {
  using dsp::detail::concat;
  std::vector<std::string> out;
  const auto& c = plan.model;
  const ParallelLayout& L = plan.layout;
  auto guard = [&](auto&& check) {  // a check that throws ConfigError: its message is the problem
    try {
      check();
      return true;
    } catch (const ConfigError& e) {
      out.emplace_back(e.what());
      return false;
    }
  };
  if (L.tensor < 1 || L.pipeline < 1 || L.data < 1 || L.expert < 1) {
    out.push_back(concat("parallel sizes must be >= 1 (tensor-model-parallel-size ", L.tensor,
                         ", pipeline-model-parallel-size ", L.pipeline, ", data-parallel size ", L.data,
                         ", expert-model-parallel-size ", L.expert, ")"));
    return out;
  }
  if (plan.micro_batch_size < 1 || plan.global_batch_size < 1) {
    out.push_back(concat("micro-batch-size (", plan.micro_batch_size, ") and global-batch-size (",
                         plan.global_batch_size, ") must be >= 1"));
    return out;
  }
  if (world_size > 0 && L.world_size() != world_size)
    out.push_back(concat("tensor (", L.tensor, ") x pipeline (", L.pipeline, ") x data (", L.data,
                         ") = ", L.world_size(), " ranks, but the world has ", world_size,
                         " (data-parallel size = world / (tensor x pipeline) must be whole)"));

  // Tensor parallelism.
  const int t = L.tensor;
  bool tp_ok = true;
  auto tp_divides = [&](const char* what, std::int64_t value) {
    if (value % t == 0) return;
    out.push_back(concat(what, " (", value, ") is not divisible by tensor-model-parallel-size (", t, ")"));
    tp_ok = false;
  };
  tp_divides("hidden size", c.hidden_size);
  tp_divides("number of attention heads", c.num_attention_heads);
  if (c.num_query_groups > 0 && c.num_query_groups % t != 0 && t % c.num_query_groups != 0) {
    out.push_back(concat("number of query groups (", c.num_query_groups, ") and tensor-model-parallel-size (", t,
                         ") must divide one another (K/V heads are split, or replicated when fewer than TP)"));
    tp_ok = false;
  }
  tp_divides("ffn hidden size", c.ffn_hidden_size);
  if (c.is_moe()) tp_divides("moe ffn hidden size", c.moe_ffn_hidden_size);
  if (tp_ok) guard([&] { c.validate(t); });  // the remaining model rules (positive sizes, head dim)

  // Pipeline.
  const int p = L.pipeline;
  bool pp_ok = true;
  if (plan.pipeline.layer_split.empty() && plan.pipeline.num_layers_per_virtual_stage == 0 && c.num_layers % p != 0) {
    out.push_back(concat("number of layers (", c.num_layers, ") is not divisible by pipeline-model-parallel-size (", p,
                         "): give --pipeline-layer-split with ", p, " counts summing to ", c.num_layers));
    pp_ok = false;
  }
  int v = 1;
  pp_ok = pp_ok && guard([&] {
    plan.pipeline.schedule_name();
    v = plan.pipeline.virtual_size(c.num_layers, p);
    plan.pipeline.stages(c.num_layers, p);
  });

  // Experts.
  if (c.is_moe()) {
    if (c.num_experts % L.expert != 0)
      out.push_back(concat("number of experts (", c.num_experts, ") is not divisible by expert-model-parallel-size (",
                           L.expert, ")"));
    if (L.data % L.expert != 0)
      out.push_back(concat("data-parallel size (", L.data, ") is not divisible by expert-model-parallel-size (",
                           L.expert, ")"));
  }

  // Batch: global = micro x DP x accumulation.
  const std::int64_t per_step = plan.micro_batch_size * L.data;
  const bool batch_ok = plan.global_batch_size % per_step == 0;
  if (!batch_ok)
    out.push_back(concat("global batch size (", plan.global_batch_size,
                         ") is not micro-batch-size x data-parallel size x accumulation steps: it is not divisible by ",
                         plan.micro_batch_size, " x ", L.data, " = ", per_step));

  // Schedule.
  if (batch_ok && pp_ok && p > 1) {
    const std::int64_t m = plan.global_batch_size / per_step;
    if (m < p)
      out.push_back(concat("the 1F1B schedule needs at least as many micro-batches as pipeline stages: global batch ",
                           plan.global_batch_size, " / (micro-batch-size ", plan.micro_batch_size,
                           " x data-parallel size ", L.data, ") = ", m, " < pipeline-model-parallel-size ", p));
    else
      guard([&] { pp::make_schedule(plan.pipeline.schedule_name(), p, v, static_cast<int>(m)); });
  }

  // Optimizer and recomputation.
  if (plan.zero_stage < 0 || plan.zero_stage > 3)
    out.push_back(concat("--zero-stage must be 0, 1, 2 or 3, got ", plan.zero_stage));
  if (plan.recompute.granularity == RecomputeGranularity::Full && plan.recompute.num_layers < 1)
    out.push_back(concat("--recompute-num-layers must be >= 1, got ", plan.recompute.num_layers));
  return out;
}

/// Throws ConfigError listing every problem of `plan` (see problems), one per line.
inline void validate(const TrainingPlan& plan, int world_size = 0) {
  const auto found = problems(plan, world_size);
  if (found.empty()) return;
  std::string message = "invalid training plan:";
  for (const auto& p : found) message += "\n  - " + p;
  throw ConfigError(message);
}

}  // namespace dsp::plan
