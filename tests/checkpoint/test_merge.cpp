// Merge: one Hugging Face model.safetensors + config.json from a sharded checkpoint.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/checkpoint/merge.hpp"
#include "dsp/checkpoint/reshard.hpp"
#include "dsp/checkpoint/save.hpp"
#include "dsp/model/config.hpp"
#include "fixture.hpp"

using namespace checkpoint_test;
using namespace dsp::checkpoint;

namespace checkpoint_merge_test {

namespace {

// Rows [begin, begin + count) of a 2-D tensor.
Tensor rows_of(const Tensor& t, std::int64_t begin, std::int64_t count) {
  const std::int64_t width = t.dim(1);
  return Tensor({count, width},
                Tensor::Storage(t.values().begin() + begin * width, t.values().begin() + (begin + count) * width));
}

// A 12-layer model (layer i: input_layernorm, fused qkv_proj with q/k/v parts), saved as an
// interleaved pipeline would save it: PP 2 with 2 model chunks of 3 layers per rank, TP 2.
// Rank 0 holds the embedding and layers 0-2, 6-8; rank 1 layers 3-5, 9-11 and the final
// norm; each rank's file holds its parameters, then their Adam moments (as dsp-train saves).
struct InterleavedCheckpoint {
  std::vector<ShardedTensor> specs;  // every tensor, in global order
  std::map<std::string, Tensor> globals;
  std::vector<std::string> hf_names;  // the merged tensors in global layer order 0..11
};

InterleavedCheckpoint save_interleaved_12_layers(const fs::path& dir) {
  constexpr int layers = 12, tp = 2, pp = 2;
  const auto layer_specs = [](int i) {
    const std::string attn = "model.layers." + std::to_string(i) + ".self_attn.";
    return std::vector<ShardedTensor>{
        ShardedTensor::replicated("model.layers." + std::to_string(i) + ".input_layernorm.weight", {6}),
        ShardedTensor::qkv(attn + "qkv_proj.weight", 6, 4, 2, 3,
                           {attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"})};
  };
  const auto with_moments = [](std::vector<ShardedTensor> params) {
    const std::size_t n = params.size();
    for (std::size_t i = 0; i < n; ++i)
      for (const std::string moment : {"exp_avg.", "exp_avg_sq."}) {
        ShardedTensor m = params[i];
        m.name = "optimizer." + moment + m.name;
        params.push_back(m);
      }
    return params;
  };
  InterleavedCheckpoint c;
  std::vector<ShardedTensor> params{ShardedTensor::vocab("model.embed_tokens.weight", {65, 6})};
  c.hf_names.push_back("model.embed_tokens.weight");
  for (int i = 0; i < layers; ++i) {
    for (const auto& s : layer_specs(i)) params.push_back(s);
    const std::string l = "model.layers." + std::to_string(i) + ".";
    for (const char* n : {"input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"})
      c.hf_names.push_back(l + n + ".weight");
  }
  params.push_back(ShardedTensor::replicated("model.norm.weight", {6}));
  c.hf_names.push_back("model.norm.weight");
  c.specs = with_moments(params);
  c.globals = fake_globals(c.specs);

  std::vector<std::vector<ShardedTensor>> by_rank(pp);  // interleaved: chunk k of rank r = virtual stage k * pp + r
  by_rank[0].push_back(params.front());
  for (int stage = 0; stage < 4; ++stage)
    for (int i = 3 * stage; i < 3 * stage + 3; ++i)
      for (const auto& s : layer_specs(i)) by_rank[static_cast<std::size_t>(stage % pp)].push_back(s);
  by_rank[1].push_back(params.back());
  auto meta = fake_meta(tp);
  meta.layout.pipeline = pp;
  AtomicDir staging(dir);
  for (int r = 0; r < pp; ++r)
    for (int t = 0; t < tp; ++t) {
      const RankState state = make_rank_state(with_moments(by_rank[static_cast<std::size_t>(r)]), &c.globals, tp, t);
      write_shard_file(staging.tmp_path(), state.state, tp, t, r);
    }
  write_manifest_and_commit(staging, meta);
  return c;
}

std::vector<std::string> names_of(const std::vector<ShardedTensor>& specs) {
  std::vector<std::string> out;
  for (const auto& s : specs) out.push_back(s.name);
  return out;
}

}  // namespace

TEST_CASE("merge of an interleaved pipeline checkpoint writes tensors in global layer order 0..11") {
  TempDir tmp;
  const InterleavedCheckpoint c = save_interleaved_12_layers(tmp / "pp2");
  const Manifest saved = load_manifest(tmp / "pp2");
  REQUIRE(saved.tensors.size() == c.specs.size());
  CHECK(names_of(saved.tensors) != names_of(c.specs));  // stage order: layers 0-2, 6-8, then 3-5, 9-11
  CHECK(names_of(global_model_order(saved.tensors)) == names_of(c.specs));

  merge(tmp / "pp2", tmp / "hf");
  const auto f = read_safetensors(tmp / "hf" / "model.safetensors");
  std::vector<std::string> names;  // entries() are in data buffer order
  for (const auto& e : f.entries()) names.push_back(e.name);
  CHECK(names == c.hf_names);  // numeric: layers.9 before layers.10 (lexicographic order would not)
  const auto at = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) - names.begin(); };
  CHECK(at("model.layers.9.input_layernorm.weight") < at("model.layers.10.input_layernorm.weight"));
  CHECK(at("model.layers.2.self_attn.v_proj.weight") < at("model.layers.3.input_layernorm.weight"));
  CHECK(same(f.tensor("model.layers.11.self_attn.k_proj.weight"),
             rows_of(c.globals.at("model.layers.11.self_attn.qkv_proj.weight"), 12, 6)));
  CHECK(same(f.tensor("model.layers.7.input_layernorm.weight"), c.globals.at("model.layers.7.input_layernorm.weight")));

  // resharding to one stage lists the tensors as a one-stage save would, values intact
  reshard(tmp / "pp2", tmp / "tp1", 1, 1);
  const GlobalCheckpoint back = load_global(tmp / "tp1");
  CHECK(back.manifest.meta.layout == dsp::ParallelLayout{.tensor = 1, .pipeline = 1, .data = 1, .expert = 1});
  CHECK(back.manifest.meta.extra["resharded_from"]["pipeline"] == 2);
  CHECK(names_of(back.manifest.tensors) == names_of(c.specs));
  for (const auto& [name, t] : c.globals) CHECK_MESSAGE(same(back.tensors.at(name), t), name);
}

TEST_CASE("global_model_order: numeric layer order, embedding first, optimizer state after the parameters") {
  const auto spec = [](std::string name) { return ShardedTensor::replicated(std::move(name), {1}); };
  const std::vector<ShardedTensor> in = {
      spec("optimizer.exp_avg.model.layers.10.a"), spec("lm_head.weight"), spec("model.norm.weight"),
      spec("model.layers.10.b"), spec("model.layers.10.a"), spec("model.layers.9.a"),
      spec("optimizer.exp_avg.model.layers.2.a"), spec("model.layers.x.a"), spec("model.embed_tokens.weight"),
      spec("optimizer.exp_avg.model.embed_tokens.weight")};
  CHECK(names_of(global_model_order(in)) ==
        std::vector<std::string>{"model.embed_tokens.weight", "model.layers.9.a", "model.layers.10.b",
                                 "model.layers.10.a", "lm_head.weight", "model.norm.weight", "model.layers.x.a",
                                 "optimizer.exp_avg.model.embed_tokens.weight", "optimizer.exp_avg.model.layers.2.a",
                                 "optimizer.exp_avg.model.layers.10.a"});
}

TEST_CASE("merge splits fused tensors into Hugging Face parts and drops padding and optimizer state") {
  TempDir tmp;
  const auto specs = fake_specs();
  const auto globals = fake_globals(specs);
  const auto meta = fake_meta(4);
  save_all(tmp / "tp4", states_of(make_tp_states(specs, globals, 4)), meta);  // vocab 65 padded to 68
  merge(tmp / "tp4", tmp / "hf");

  const auto f = read_safetensors(tmp / "hf" / "model.safetensors");
  std::set<std::string> names;
  for (const auto& e : f.entries()) names.insert(e.name);
  const std::string attn = "model.layers.0.self_attn.", mlp = "model.layers.0.mlp.";
  CHECK(names == std::set<std::string>{"model.embed_tokens.weight", attn + "q_proj.weight", attn + "k_proj.weight",
                                       attn + "v_proj.weight", attn + "o_proj.weight", mlp + "gate_proj.weight",
                                       mlp + "up_proj.weight", mlp + "down_proj.weight", "model.norm.weight"});
  CHECK(f.metadata().at("format") == "pt");

  const Tensor& qkv = globals.at(qkv_name);
  CHECK(same(f.tensor(attn + "q_proj.weight"), rows_of(qkv, 0, 12)));  // 4 heads x 3
  CHECK(same(f.tensor(attn + "k_proj.weight"), rows_of(qkv, 12, 6)));  // 2 kv heads x 3
  CHECK(same(f.tensor(attn + "v_proj.weight"), rows_of(qkv, 18, 6)));
  const Tensor& gate_up = globals.at(gate_up_name);
  CHECK(same(f.tensor(mlp + "gate_proj.weight"), rows_of(gate_up, 0, 8)));
  CHECK(same(f.tensor(mlp + "up_proj.weight"), rows_of(gate_up, 8, 8)));
  CHECK(same(f.tensor("model.embed_tokens.weight"), globals.at("model.embed_tokens.weight")));  // [65, 6]
  CHECK(same(f.tensor(attn + "o_proj.weight"), globals.at(attn + "o_proj.weight")));
  CHECK(same(f.tensor("model.norm.weight"), globals.at("model.norm.weight")));

  CHECK(nlohmann::json::parse(read_text(tmp / "hf" / "config.json")) == meta.model_config);
  CHECK(std::distance(fs::directory_iterator(tmp / "hf"), fs::directory_iterator()) == 2);
  CHECK(tmp.names().size() == 2);
}

TEST_CASE("merge writes transformers 5's rope_parameters beside rope_theta, and refuses a GQA MoE model") {
  TempDir tmp;
  const auto specs = fake_specs();
  const auto globals = fake_globals(specs);
  auto meta = fake_meta(1);
  dsp::model::ModelConfig dense;
  meta.model_config = dense.to_hf_json();
  save_all(tmp / "dense", states_of(make_tp_states(specs, globals, 1)), meta);
  merge(tmp / "dense", tmp / "hf");
  auto config = nlohmann::json::parse(read_text(tmp / "hf" / "config.json"));
  CHECK(config["rope_theta"] == meta.model_config["rope_theta"]);
  CHECK(config["rope_parameters"] == nlohmann::json{{"rope_type", "default"}, {"rope_theta", dense.rope_theta}});
  config.erase("rope_parameters");
  CHECK(config == meta.model_config);  // nothing else changed

  dsp::model::ModelConfig moe;
  moe.num_experts = 4;
  moe.moe_ffn_hidden_size = 8;
  meta.model_config = moe.to_hf_json();
  save_all(tmp / "moe", states_of(make_tp_states(specs, globals, 1)), meta);
  CHECK_THROWS_WITH_AS(merge(tmp / "moe", tmp / "hf_moe"),
                       doctest::Contains("mixture-of-experts model (DspMoeForCausalLM: GQA attention"),
                       dsp::CheckpointError);
  CHECK(!fs::exists(tmp / "hf_moe"));
}

}  // namespace checkpoint_merge_test
