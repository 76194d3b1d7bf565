// Validation and layout recommendations on the two worked examples (samples/configs/plan_*.json):
// a 60-layer model of ~64 B parameters (~128 GB of bf16 weights) on 2 nodes x 8 GPUs x 80 GB,
// and a 64-layer model (hidden 7168, 56 heads) on 8 nodes x 8 GPUs with global batch 512.
//  - the valid plans have no problem; the classic mistakes (TP not dividing the heads, more
//    stages than layers, a layer split that misses the layers, a global batch that is not
//    micro x DP x accumulation) are each reported with their numbers, in the sentence of the
//    part that enforces the rule when dsp-train runs; what dsp-train runs is accepted (PP not
//    dividing the layers: the even-as-possible split; fewer micro-batches than stages);
//  - every recommendation keeps TP inside a node and dividing the heads, and the first one
//    fits in memory: TP8 x PP2 for both (the layout the field uses for them);
//  - an MoE model is also tried at every expert-parallel size that divides the experts and DP,
//    and when no layout validates each rejected one carries the rule it breaks.
#include <doctest/doctest.h>

#include <fstream>
#include <string>

#include "../data_dir.hpp"
#include "dsp/plan/recommend.hpp"
#include "dsp/plan/validate.hpp"

using namespace dsp;

namespace plan_validate_recommend_test {

namespace {

model::ModelConfig load(const std::string& name) {
  std::ifstream in(test::data_dir() + "/../samples/configs/" + name);
  REQUIRE(in.good());
  return model::ModelConfig::from_hf_json(nlohmann::json::parse(in));
}

plan::TrainingPlan plan_of(const model::ModelConfig& c, int tp, int pp, int dp, std::int64_t micro,
                           std::int64_t global) {
  plan::TrainingPlan t;
  t.model = c;
  t.layout = {.tensor = tp, .pipeline = pp, .data = dp, .expert = 1};
  t.micro_batch_size = micro;
  t.global_batch_size = global;
  return t;
}

bool mentions(const std::vector<std::string>& problems, const std::string& text) {
  for (const auto& p : problems)
    if (p.find(text) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("the worked examples' models have the sizes the field quotes") {
  const auto a = load("plan_60layer.json"), b = load("plan_64layer_7168.json");
  CHECK(a.num_layers == 60);
  CHECK(2 * a.num_parameters() == doctest::Approx(130e9).epsilon(0.03));  // ~130 GB of bf16 weights
  CHECK(b.num_layers == 64);
  CHECK(b.hidden_size == 7168);
  CHECK(b.num_attention_heads == 56);
}

TEST_CASE("validation accepts the worked examples and rejects the three mistakes with their numbers") {
  const auto a = load("plan_60layer.json"), b = load("plan_64layer_7168.json");
  CHECK(plan::problems(plan_of(a, 8, 2, 1, 1, 16), 16).empty());
  CHECK(plan::problems(plan_of(b, 8, 2, 4, 1, 512), 64).empty());

  // TP 16 does not divide 56 heads.
  auto p = plan::problems(plan_of(b, 16, 2, 2, 1, 512), 64);
  CHECK(p.size() == 1);
  CHECK(mentions(p, "number of attention heads (56) is not divisible by tensor-model-parallel-size (16)"));
  CHECK_THROWS_WITH_AS(plan::validate(plan_of(b, 16, 2, 2, 1, 512), 64),
                       doctest::Contains("number of attention heads (56)"), ConfigError);

  // PP 8 does not divide 60 layers: dsp-train splits them 8, 8, 8, 8, 7, 7, 7, 7, and so does
  // the plan; an explicit split must sum to the layers; more stages than layers is refused.
  auto uneven = plan_of(a, 2, 8, 1, 1, 16);
  CHECK(plan::problems(uneven, 16).empty());
  CHECK(uneven.pipeline.stages(60, 8).front().num_layers == 8);
  CHECK(uneven.pipeline.stages(60, 8).back().num_layers == 7);
  uneven.pipeline.layer_split = {8, 8, 8, 8, 7, 7, 7, 6};
  CHECK(mentions(plan::problems(uneven, 16), "sums to 59 layers, but the model has 60"));
  p = plan::problems(plan_of(a, 1, 64, 1, 1, 64), 64);
  CHECK(p.size() == 1);
  CHECK(mentions(p, "number of layers (60) is smaller than the number of pipeline stages (64)"));

  // 512 is not micro 3 x DP 4 x accumulation: the data sampler's sentence.
  p = plan::problems(plan_of(b, 8, 2, 4, 3, 512), 64);
  CHECK(p.size() == 1);
  CHECK(mentions(p, "global batch size (512) is not divisible by micro batch size x data-parallel size = 3 x 4 = 12"));

  // Fewer micro-batches than stages: 1F1B runs them (a larger bubble), as in dsp-train.
  CHECK(plan::problems(plan_of(b, 8, 4, 2, 1, 4), 64).empty());
  // Interleaving needs a multiple of PP micro-batches (pp::make_schedule's rule).
  auto interleaved = plan_of(a, 2, 4, 2, 1, 6);
  interleaved.pipeline.num_layers_per_virtual_stage = 5;
  CHECK(mentions(plan::problems(interleaved, 16), "interleaved 1F1B needs the number of micro-batches"));
  // A layout that does not fill the world (ParallelLayout::resolved's sentence).
  CHECK(mentions(plan::problems(plan_of(b, 8, 2, 2, 1, 512), 64), "= 32 does not equal the world size 64"));
  // K/V heads and TP that do not divide one another (8 KV groups, TP 3 also misses the heads).
  CHECK(mentions(plan::problems(plan_of(a, 3, 1, 1, 1, 1)), "number of query groups (8)"));
}

TEST_CASE("recommendations: TP inside a node dividing the heads, the first fits, TP8 x PP2 for both examples") {
  const auto a = load("plan_60layer.json"), b = load("plan_64layer_7168.json");
  struct Case {
    model::ModelConfig model;
    plan::Cluster cluster;
    std::int64_t global;
  };
  for (const Case& k : {Case{a, {8, 2, 80'000'000'000}, 16}, Case{b, {8, 8, 80'000'000'000}, 512}}) {
    CAPTURE(k.model.num_layers);
    auto base = plan_of(k.model, 1, 1, 1, 1, k.global);
    const auto recs = plan::recommend(base, k.cluster);
    REQUIRE(!recs.empty());
    for (const auto& r : recs) {
      CHECK(r.plan.layout.tensor <= k.cluster.gpus_per_node);
      CHECK(k.cluster.gpus_per_node % r.plan.layout.tensor == 0);
      CHECK(k.model.num_attention_heads % r.plan.layout.tensor == 0);
      CHECK(r.plan.layout.world_size() == k.cluster.world_size());
      CHECK(plan::problems(r.plan, k.cluster.world_size()).empty());
      CHECK(r.fits == (r.peak_bytes() <= k.cluster.gpu_memory_bytes));
    }
    const auto& first = recs.front();
    CHECK(first.fits);
    CHECK(first.plan.layout.tensor == 8);
    CHECK(first.plan.layout.pipeline == 2);
    // The first fitting layout at TP 8 has the smallest PP that fits: PP 1 does not.
    for (const auto& r : recs)
      if (r.plan.layout.tensor == 8 && r.plan.layout.pipeline == 1) CHECK_FALSE(r.fits);
  }
  // The 60-layer model needs recomputation at TP8 x PP2 (16 bytes per parameter over 16 GPUs
  // is already ~64 GB); the 64-layer one fits without.
  CHECK(plan::recommend(plan_of(a, 1, 1, 1, 1, 16), {8, 2, 80'000'000'000}).front().plan.recompute.granularity ==
        plan::RecomputeGranularity::Full);
  CHECK(plan::recommend(plan_of(b, 1, 1, 1, 1, 512), {8, 8, 80'000'000'000}).front().plan.recompute.granularity ==
        plan::RecomputeGranularity::None);
}

TEST_CASE("recommendations try expert parallelism, and say which rule rejected each layout") {
  // The 60-layer model as an MoE model of 16 routed experts on 2 nodes x 8 GPUs.
  auto moe = load("plan_60layer.json");
  moe.num_experts = 16;
  moe.moe_ffn_hidden_size = moe.ffn_hidden_size / 8;
  moe.moe_router_topk = 2;
  std::vector<plan::Rejection> rejected;
  const auto recs = plan::recommend(plan_of(moe, 1, 1, 1, 1, 64), {8, 2, 80'000'000'000}, &rejected);
  REQUIRE(!recs.empty());
  bool some_ep = false;
  for (const auto& r : recs) {
    CHECK(plan::problems(r.plan, 16).empty());
    CHECK(r.plan.layout.data % r.plan.layout.expert == 0);
    CHECK(moe.num_experts % r.plan.layout.expert == 0);
    some_ep = some_ep || r.plan.layout.expert > 1;
  }
  CHECK(some_ep);
  // Every (TP, PP, EP) tried is either recommended or rejected with its reasons.
  for (const auto& r : rejected) CHECK(!r.problems.empty());

  // Micro-batch 2 never divides a global batch of 3: every layout is rejected, each naming it.
  rejected.clear();
  const auto none = plan::recommend(plan_of(load("plan_60layer.json"), 1, 1, 1, 2, 3), {8, 2, 80'000'000'000}, &rejected);
  CHECK(none.empty());
  REQUIRE(!rejected.empty());
  for (const auto& r : rejected) CHECK(mentions(r.problems, "global batch size (3) is not divisible by micro batch size"));
}

}  // namespace plan_validate_recommend_test
