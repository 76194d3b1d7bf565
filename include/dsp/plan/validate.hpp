#pragma once
// Validation of a training plan before anything runs: every rule a layout, a batch and a
// schedule must satisfy, each broken rule reported as a sentence naming the numbers involved.
// dsp-train runs the same function on its flags before it builds anything, and each rule's
// sentence is the one the part that enforces it at run time throws (ParallelLayout::resolved,
// ModelConfig::validate, pp::PipelineConfig, pp::make_schedule, dp::check_global_batch), so
// dsp-plan accepts exactly the plans dsp-train runs:
//   world  TP x PP divides the world, TP x PP x DP equals it, EP divides DP;
//   tensor parallelism  TP divides the hidden size, the attention heads and the (MoE) FFN
//       widths; the KV heads and TP divide one another (K/V heads are split when kv >= TP,
//       replicated when kv < TP; ShardedTensor's Qkv split);
//   pipeline  at least one layer per stage: layers split as evenly as possible (L = q P + r:
//       the first r stages get q + 1), or --pipeline-layer-split's p x v counts summing to the
//       layers; interleaving: layers divisible by PP x layers-per-virtual-stage, micro-batches a
//       multiple of PP. Fewer micro-batches than stages is allowed (1F1B then runs them with a
//       larger bubble, (p - 1) / (m + p - 1); the ledger shows it);
//   data  global batch = micro batch x DP x accumulation steps, i.e. micro x DP divides it;
//   experts  EP divides the routed experts (and DP, above);
//   optimizer  ZeRO stage 0-3; full recomputation of >= 1 layer per group.
#include <string>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/dp/data_sampler.hpp"
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
  // The world: TP x PP divides it, TP x PP x DP equals it, EP divides DP.
  guard([&] { L.resolved(world_size > 0 ? world_size : L.world_size()); });

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

  // Pipeline: dsp-train's split (even as possible, or the explicit one) and schedule.
  const int p = L.pipeline;
  int v = 1;
  const bool pp_ok = guard([&] {
    plan.pipeline.schedule_name();
    v = plan.pipeline.virtual_size(c.num_layers, p);
    plan.pipeline.stages(c.num_layers, p);
  });

  // Experts.
  if (c.is_moe()) guard([&] { c.validate_expert_parallel(L.expert); });

  // Batch: global = micro x DP x accumulation.
  const bool batch_ok = guard([&] { dp::check_global_batch(plan.micro_batch_size, plan.global_batch_size, L.data); });

  // Schedule (interleaving needs a multiple of PP micro-batches).
  if (batch_ok && pp_ok && p > 1)
    guard([&] { pp::make_schedule(plan.pipeline.schedule_name(), p, v, plan.micro_batches()); });

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
