// Merge: one Hugging Face model.safetensors + config.json from a sharded checkpoint.
#include <doctest/doctest.h>

#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "dsp/checkpoint/merge.hpp"
#include "dsp/checkpoint/save.hpp"
#include "fixture.hpp"

using namespace checkpoint_test;
using namespace dsp::checkpoint;

namespace {

// Rows [begin, begin + count) of a 2-D tensor.
Tensor rows_of(const Tensor& t, std::int64_t begin, std::int64_t count) {
  const std::int64_t width = t.dim(1);
  return Tensor({count, width},
                {t.values().begin() + begin * width, t.values().begin() + (begin + count) * width});
}

}  // namespace

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
