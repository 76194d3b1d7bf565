// Layer assignment: every layer is built exactly once, in order, on contiguous stages, and a
// split that does not add up is refused. The reference is the plain list 0..L-1 of layer
// indices, read back from the parameter names the stages actually built.
#include <doctest/doctest.h>

#include <numeric>
#include <regex>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/policy.hpp"
#include "dsp/pp/pipeline_config.hpp"
#include "dsp/pp/pipeline_stage.hpp"
#include "../train/small_model.hpp"

using namespace dsp;

namespace pp_layer_split_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

// Builds every stage of the split (TP1) and returns the global layer index of each decoder
// layer in build order, plus which stages hold the embedding and the output layer.
struct Built {
  std::vector<std::int64_t> layers;
  std::vector<int> embedding_stages, head_stages;
};
Built build(const std::vector<pp::StageLayers>& stages, model::ModelConfig config) {
  Built out;
  comm::launch(1, [&](comm::ThreadComm& world) {
    const std::regex layer_norm(R"(model\.layers\.(\d+)\.input_layernorm\.weight)");
    for (std::size_t s = 0; s < stages.size(); ++s) {
      pp::PipelineStage<P> stage(config, world, stages[s], 1);
      for (auto* p : stage.parameters()) {
        std::smatch m;
        if (std::regex_match(p->spec.name, m, layer_norm)) out.layers.push_back(std::stoll(m[1]));
        if (p->spec.name == "model.embed_tokens.weight" && !p->tied_copy) out.embedding_stages.push_back(static_cast<int>(s));
        if (p->spec.name == "model.norm.weight") out.head_stages.push_back(static_cast<int>(s));
      }
    }
  });
  return out;
}

}  // namespace

TEST_CASE("pipeline layers: even splits build every layer exactly once, in order") {
  struct Case {
    std::int64_t layers;
    int stages;
    std::vector<std::int64_t> expected;  // extra layers on the first stages
  };
  for (const Case& c : std::vector<Case>{{30, 4, {8, 8, 7, 7}}, {10, 3, {4, 3, 3}}, {5, 2, {3, 2}}, {4, 4, {1, 1, 1, 1}}}) {
    CAPTURE(c.layers);
    CAPTURE(c.stages);
    CHECK(pp::even_layer_split(c.layers, c.stages) == c.expected);
    auto config = test::small_model(true);
    config.num_layers = c.layers;
    const Built b = build(pp::stage_layers(c.expected, c.layers), config);
    std::vector<std::int64_t> all(static_cast<std::size_t>(c.layers));
    std::iota(all.begin(), all.end(), 0);
    CHECK(b.layers == all);
    CHECK(b.embedding_stages == std::vector<int>{0});
    CHECK(b.head_stages == std::vector<int>{c.stages - 1});
  }
}

TEST_CASE("pipeline layers: an explicit split is used as given and must sum to the layer count") {
  const auto stages = pp::stage_layers({1, 4, 0, 5}, 10);
  CHECK(stages[1] == pp::StageLayers{1, 4, false, false});
  CHECK(stages[2] == pp::StageLayers{5, 0, false, false});
  CHECK(stages[3] == pp::StageLayers{5, 5, false, true});
  CHECK_THROWS_WITH_AS(pp::stage_layers({3, 3, 3}, 10), "layer split 3,3,3 sums to 9 layers, but the model has 10",
                       ConfigError);
  CHECK_THROWS_WITH_AS(pp::stage_layers({6, -1, 5}, 10), doctest::Contains("-1 layers"), ConfigError);
  CHECK_THROWS_WITH_AS(pp::even_layer_split(3, 4), doctest::Contains("number of layers (3) is smaller"), ConfigError);
  comm::launch(1, [](comm::ThreadComm& world) {  // layers [1, 6) of a 2-layer model
    CHECK_THROWS_WITH_AS(pp::PipelineStage<P>(test::small_model(), world, {1, 5, true, true}, 1),
                         "stage layers [1, 6) lie outside the model's 2 layers", ConfigError);
  });
}

TEST_CASE("pipeline layers: PipelineConfig derives virtual stages and refuses what does not fit") {
  pp::PipelineConfig c;
  CHECK(c.schedule_name() == "1f1b");
  CHECK(c.virtual_size(8, 2) == 1);
  c.num_layers_per_virtual_stage = 2;
  CHECK(c.schedule_name() == "interleaved");
  CHECK(c.virtual_size(8, 2) == 2);  // 8 layers / (2 ranks x 2 layers)
  const auto stages = c.stages(8, 2);
  REQUIRE(stages.size() == 4);
  CHECK(stages[2] == pp::StageLayers{4, 2, false, false});  // chunk 1 of rank 0
  CHECK_THROWS_WITH_AS(c.virtual_size(6, 2), doctest::Contains("number of layers (6) is not divisible"), ConfigError);
  CHECK_THROWS_WITH_AS(c.virtual_size(4, 2), doctest::Contains("use the 1f1b schedule"), ConfigError);
  c.schedule = "1f1b";
  CHECK_THROWS_WITH_AS(c.schedule_name(), doctest::Contains("needs the interleaved schedule"), ConfigError);
  c = {};
  c.schedule = "interleaved";
  CHECK_THROWS_WITH_AS(c.schedule_name(), doctest::Contains("needs --num-layers-per-virtual-pipeline-stage"), ConfigError);
  c = {};
  c.num_layers_per_virtual_stage = -1;
  CHECK_THROWS_WITH_AS(c.schedule_name(), "--num-layers-per-virtual-pipeline-stage must be >= 0, got -1", ConfigError);
  c = {};
  c.layer_split = {2, 2, 2};
  CHECK_THROWS_WITH_AS(c.stages(6, 2), "layer split has 3 entries for 2 pipeline stages (pipeline size x virtual stages)",
                       ConfigError);
}

}  // namespace pp_layer_split_test
