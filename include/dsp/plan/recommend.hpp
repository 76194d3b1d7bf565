#pragma once
// Layout recommendations for a cluster, the way experienced users choose (Narayanan et al.,
// "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21,
// section 3, takeaways 1-2): tensor parallelism inside a node (its all-reduces on every layer
// need NVLink bandwidth) and dividing the heads, then the smallest pipeline parallelism that
// fits in memory (its bubble (p - 1) / (m + p - 1) grows with p), then data parallelism for
// the rest; more pipeline stages rather than tensor parallelism across nodes.
//
// Every (TP, PP, EP) with TP a divisor of the GPUs per node, TP x PP dividing the world and,
// for an MoE model, EP a divisor of the routed experts and of DP (1 for a dense model) is built
// from the base plan (model, batch sizes, precision, ZeRO stage, recomputation, schedule),
// validated by the rules dsp-train applies (plan/validate.hpp: so PP need not divide the
// layers, the layers are split as evenly as possible; a layout that breaks a rule is kept
// aside with the rule's sentence) and predicted (plan/ledger.hpp); where it does not fit with
// the base plan's recomputation, selective and then full recomputation are tried, and the
// first that fits is kept. Ranking: layouts whose worst rank fits in GPU memory first; among
// them the least recomputation (full recomputation costs 30-40 % more time, Korthikanti et al.
// 2022, section 1), then the smallest model-parallel size TP x PP (the most data parallelism),
// then the smallest PP (the least bubble; for one TP x PP that is the largest TP, which stays
// in the node), then the smallest EP (the least all-to-all traffic; a larger EP is chosen where
// only it fits, its experts spread over more ranks); layouts that do not fit follow, smallest
// predicted memory first.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "dsp/plan/ledger.hpp"
#include "dsp/plan/validate.hpp"

namespace dsp::plan {

/// --gpus-per-node, --num-nodes, --gpu-memory (bytes here; GB on the command line).
struct Cluster {
  int gpus_per_node = 8;
  int num_nodes = 1;
  std::int64_t gpu_memory_bytes = 80'000'000'000;
  int world_size() const { return gpus_per_node * num_nodes; }
};

struct Recommendation {
  TrainingPlan plan;              ///< the base plan with this layout
  TrainingPrediction prediction;  ///< per-rank memory and bubble
  bool fits = false;              ///< the worst rank's total <= the GPU memory
  std::int64_t peak_bytes() const { return prediction.worst_rank().bytes.total(); }
};

/// A layout recommend() tried and dropped, with every rule it breaks (plan/validate.hpp).
struct Rejection {
  ParallelLayout layout;
  std::vector<std::string> problems;
};

/// Ranked layouts of `base` on `cluster` (see the file comment). The base plan's layout sizes
/// are replaced (its expert-parallel size too: every EP is tried); an explicit layer split is
/// dropped (it belongs to one PP size), and interleaving is kept only where its layers per
/// virtual stage still divide. `rejected` (optional) receives every layout tried that breaks a
/// rule, with the rules' sentences. Throws ConfigError when the cluster has no GPU.
inline std::vector<Recommendation> recommend(const TrainingPlan& base, const Cluster& cluster,
                                             std::vector<Rejection>* rejected = nullptr) {
  DSP_CHECK_AS(ConfigError, cluster.gpus_per_node >= 1 && cluster.num_nodes >= 1,
               "a cluster needs >= 1 GPU per node and >= 1 node, got ", cluster.gpus_per_node, " x ",
               cluster.num_nodes);
  const int world = cluster.world_size();
  std::vector<Recommendation> out;
  for (int t = 1; t <= cluster.gpus_per_node; ++t) {
    if (cluster.gpus_per_node % t != 0 || world % t != 0) continue;
    for (int p = 1; p <= world / t; ++p) {
      if ((world / t) % p != 0) continue;
      const int d = world / (t * p);
      for (int e = 1; e <= d; ++e) {
        if (d % e != 0 || (e > 1 && (!base.model.is_moe() || base.model.num_experts % e != 0))) continue;
        TrainingPlan plan = base;
        plan.layout = {.tensor = t, .pipeline = p, .data = d, .expert = e};
        plan.pipeline.layer_split.clear();
        if (p == 1 || (plan.pipeline.num_layers_per_virtual_stage > 0 &&
                       base.model.num_layers % (std::int64_t(p) * plan.pipeline.num_layers_per_virtual_stage) != 0)) {
          plan.pipeline.num_layers_per_virtual_stage = 0;
          if (plan.pipeline.schedule == "interleaved") plan.pipeline.schedule.clear();
        }
        if (auto found = problems(plan, world); !found.empty()) {
          if (rejected) rejected->push_back({plan.layout, std::move(found)});
          continue;
        }
        // The base plan's recomputation first; where that does not fit, selective, then full
        // (one checkpointed layer per group), as users turn it on: the cheapest that fits.
        Recommendation r{plan, predict_training(plan), false};
        r.fits = r.peak_bytes() <= cluster.gpu_memory_bytes;
        for (auto g : {RecomputeGranularity::Selective, RecomputeGranularity::Full}) {
          if (r.fits || g <= plan.recompute.granularity) continue;
          TrainingPlan more = plan;
          more.recompute = {g, RecomputeMethod::Uniform, 1};
          r = {more, predict_training(more), false};
          r.fits = r.peak_bytes() <= cluster.gpu_memory_bytes;
        }
        out.push_back(std::move(r));
      }
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const Recommendation& a, const Recommendation& b) {
    if (a.fits != b.fits) return a.fits;
    if (!a.fits) return a.peak_bytes() < b.peak_bytes();
    if (a.plan.recompute.granularity != b.plan.recompute.granularity)
      return a.plan.recompute.granularity < b.plan.recompute.granularity;
    const int ma = a.plan.layout.tensor * a.plan.layout.pipeline, mb = b.plan.layout.tensor * b.plan.layout.pipeline;
    if (ma != mb) return ma < mb;
    if (a.plan.layout.pipeline != b.plan.layout.pipeline) return a.plan.layout.pipeline < b.plan.layout.pipeline;
    return a.plan.layout.expert < b.plan.layout.expert;
  });
  return out;
}

}  // namespace dsp::plan
