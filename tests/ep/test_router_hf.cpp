// ep::route against transformers 5.25's DeepseekV3TopkRouter (noaux_tc: sigmoid, correction
// bias for the choice only, groups scored by their top-2 sum, renormalised, scaled) and
// DeepseekV2TopkRouter (softmax; group_limited_greedy: groups scored by their best; greedy;
// not renormalised, scaled), on the logits transformers computed, from the fixture written by
// tools/write_router_fixture.py (every group and expert choice there wins by >= 1e-3, so the
// choices must be equal exactly). Weights: transformers computes the sigmoid/softmax in fp32
// and the normalisation in fp32; dsp sums in fp64. Each weight is a few fp32 roundings of
// values <= 2.5 apart: 1e-6 absolute is ~8 ulp at the largest weight.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../data_dir.hpp"
#include "dsp/ep/router.hpp"
#include "dsp/model/config.hpp"

namespace ep_router_hf_test {

using dsp::ep::RouterConfig;

namespace {
nlohmann::json fixture() {
  const std::string path = dsp::test::data_dir() + "/../tests/fixtures/router/hf_routers.json";
  std::ifstream f(path);
  REQUIRE_MESSAGE(f.good(), "cannot open ", path);
  return nlohmann::json::parse(f);
}

// The router of a case, through ModelConfig::from_hf_json as an imported config would be read.
RouterConfig router_of(const nlohmann::json& c) {
  nlohmann::json hf = {{"vocab_size", 8}, {"hidden_size", 16}, {"intermediate_size", 16}, {"num_hidden_layers", 1},
                       {"num_attention_heads", 2}, {"num_key_value_heads", 2}, {"max_position_embeddings", 8},
                       {"rope_theta", 10000.0}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false},
                       {"n_routed_experts", c["num_experts"]}, {"num_experts_per_tok", c["top_k"]},
                       {"moe_intermediate_size", 8}, {"scoring_func", c["score"]},
                       {"norm_topk_prob", c["norm_topk_prob"]}, {"n_group", c["n_group"]},
                       {"topk_group", c["topk_group"]}, {"routed_scaling_factor", c["routed_scaling_factor"]},
                       {"topk_method", c["topk_method"]}};
  RouterConfig r = dsp::model::ModelConfig::from_hf_json(hf).router();
  if (c["topk_method"] == "greedy") r.num_groups = r.group_topk = 1;  // transformers ignores n_group then
  return r;
}
}  // namespace

TEST_CASE("router: experts and gate weights equal transformers' DeepSeek-V3 and -V2 routers") {
  const nlohmann::json f = fixture();
  REQUIRE(f["cases"].size() == 3);
  for (const auto& c : f["cases"]) {
    CAPTURE(c["name"].get<std::string>());
    const RouterConfig cfg = router_of(c);
    const auto logits = c["logits"].get<std::vector<float>>();
    const auto bias = c["bias"].get<std::vector<float>>();
    const auto routing = dsp::ep::route(cfg, logits, bias);
    const auto want_experts = c["experts"].get<std::vector<std::int32_t>>();
    const auto want_weights = c["weights"].get<std::vector<float>>();
    const std::int64_t k = cfg.top_k;
    REQUIRE(routing.experts.size() == want_experts.size());
    for (std::int64_t t = 0; t < routing.tokens; ++t) {
      // dsp orders a token's experts best first; the fixture by expert index.
      std::vector<std::pair<std::int32_t, float>> got;
      for (std::int64_t j = 0; j < k; ++j) got.emplace_back(routing.experts[t * k + j], routing.weights[t * k + j]);
      std::sort(got.begin(), got.end());
      for (std::int64_t j = 0; j < k; ++j) {
        CAPTURE(t);
        CHECK(got[j].first == want_experts[t * k + j]);
        CHECK(std::abs(got[j].second - want_weights[t * k + j]) <= 1e-6f);
      }
    }
  }
}

TEST_CASE("router: V2's group_limited_greedy differs from V3's group score on the fixture") {
  // The check above could pass with either group score if the groups never disagreed: show they
  // do, so the test fails when topk_method's group score is ignored.
  const nlohmann::json f = fixture();
  for (const auto& c : f["cases"]) {
    if (c["name"] != "v2_group_limited") continue;
    RouterConfig cfg = router_of(c);
    REQUIRE(cfg.group_score == dsp::backend::GroupScore::Max);
    const auto logits = c["logits"].get<std::vector<float>>();
    const auto with_max = dsp::ep::route(cfg, logits);
    cfg.group_score = dsp::backend::GroupScore::TopTwoSum;
    const auto with_sum = dsp::ep::route(cfg, logits);
    CHECK(with_max.experts != with_sum.experts);
  }
}

}  // namespace ep_router_hf_test
