// Hugging Face import (hf_config.hpp, hf_import.hpp, hf_convert.hpp) against the fixtures that
// tools/write_hf_fixtures.py wrote with transformers 5.25.0 (tests/fixtures/hf/).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/backend/host.hpp"
#include "dsp/checkpoint/hf_convert.hpp"
#include "dsp/checkpoint/hf_import.hpp"
#include "dsp/checkpoint/merge.hpp"
#include "dsp/checkpoint/model_io.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/pp/engine.hpp"
#include "dsp/pp/layer_split.hpp"
#include "dsp/pp/pipeline_stage.hpp"
#include "dsp/policy.hpp"
#include "dsp/serve/full_logits.hpp"
#include "dsp/tp/mappings.hpp"
#include "../data_dir.hpp"
#include "../temp_dir.hpp"

using namespace dsp;
using namespace dsp::checkpoint;
namespace fs = std::filesystem;

namespace checkpoint_hf_import_test {

namespace {

fs::path fixture(const std::string& name) {
  return fs::path(test::data_dir()) / ".." / "tests" / "fixtures" / "hf" / name;
}

// The fixture's ids and transformers' logits [tokens, vocab].
std::pair<std::vector<std::int32_t>, Tensor> reference(const fs::path& dir) {
  const SafetensorsFile f = read_safetensors(dir / "logits.safetensors");
  std::vector<std::int32_t> ids;
  const Tensor stored = f.tensor("ids");
  for (float v : stored.values()) ids.push_back(static_cast<std::int32_t>(v));
  return {ids, f.tensor("logits")};
}

// Largest |a - b| over two tensors of one shape.
double max_abs_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  double m = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::abs(double(a.data()[i]) - double(b.data()[i])));
  return m;
}

// Logits of `dir` (a Hugging Face folder or a dsp checkpoint) at TP `tp` (x EP `ep`, the routed
// experts split over ep ranks) for `ids`, from rank 0.
Tensor dsp_logits(const fs::path& dir, int tp, const std::vector<std::int32_t>& ids, int ep = 1) {
  Tensor out;
  comm::launch(tp * ep, [&](comm::ThreadComm& world) {
    using P = Policy<backend::Host, comm::ThreadComm>;
    DeviceMesh<comm::ThreadComm> mesh(world, ParallelLayout{.tensor = tp, .data = ep, .expert = ep});
    model::CausalLM<P> model(read_model_config(dir), mesh, /*seed=*/7);
    load_model(dir, model);
    Tensor logits = serve::full_logits(model, ids);
    if (world.rank() == 0) out = std::move(logits);
  });
  return out;
}

// Logits of the Hugging Face folder `dir` at TP `tp` x PP `pp` for `ids`: the layers split
// evenly over the stages, each stage's ranks reading their own slices of their own layers
// (load_into), stage r running PipelineStage::infer on stage r - 1's hidden states; the last
// stage's logits gathered over its TP group, padding dropped.
Tensor pipeline_logits(const fs::path& dir, int tp, int pp, const std::vector<std::int32_t>& ids) {
  using P = Policy<backend::Host, comm::ThreadComm>;
  const model::ModelConfig config = read_hf_config(dir);
  const auto stages = pp::stage_layers(pp::even_layer_split(config.num_layers, pp), config.num_layers);
  const auto len = static_cast<std::int64_t>(ids.size());
  Tensor out;
  comm::launch(tp * pp, [&](comm::ThreadComm& world) {
    DeviceMesh<comm::ThreadComm> mesh(world, ParallelLayout{.tensor = tp, .pipeline = pp});
    pp::PipelineStage<P> stage(config, mesh.tensor_group(), stages[static_cast<std::size_t>(mesh.pp_rank())], 7);
    load_into(HfFolder(dir), stage_state(stage, StateUse::Load), tp, mesh.tp_rank());
    auto ctx = model::ForwardContext::for_training(1, len);
    ctx.training = false;
    const Tensor x = pp::forward_stages(mesh.pipeline_group(), pp, {len, config.hidden_size},
                                        [&](int, Tensor in) { return stage.infer(ctx, ids, std::move(in)); });
    if (mesh.pp_rank() + 1 < pp) return;
    const Tensor all = tp::GatherFromTpRegion<backend::Host>::forward(mesh.tensor_group(), x);
    Tensor logits({len, config.vocab_size});
    backend::copy_columns(backend::Host{}, all.data(), all.dim(1), 0, logits.data(), config.vocab_size, 0, len,
                          config.vocab_size);
    if (mesh.tp_rank() == 0) out = std::move(logits);
  });
  return out;
}

// Every tensor of a safetensors file, by name.
std::map<std::string, Tensor> all_tensors(const fs::path& file) {
  const SafetensorsFile f = read_safetensors(file);
  std::map<std::string, Tensor> out;
  for (const auto& e : f.entries()) out.emplace(e.name, f.tensor(e.name));
  return out;
}

void write_all(const fs::path& file, const std::map<std::string, Tensor>& tensors) {
  std::vector<std::pair<std::string, const Tensor*>> refs;
  for (const auto& [name, t] : tensors) refs.emplace_back(name, &t);
  write_safetensors(file, refs);
}

// A copy of the Llama fixture's config.json and weights in a fresh folder.
struct LlamaCopy {
  test::TempDir tmp;
  fs::path dir = tmp / "llama";
  LlamaCopy() {
    fs::create_directories(dir);
    for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(fixture("llama") / f, dir / f);
  }
  nlohmann::json config() const { return nlohmann::json::parse(std::ifstream(dir / "config.json")); }
  void set_config(const nlohmann::json& j) const { std::ofstream(dir / "config.json") << j.dump(2); }
};

// The message of the ConfigError/CheckpointError `f` throws ("" when it throws nothing).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("hf import: FP8 e4m3 with 128 x 128 block scales dequantises to torch's values bit for bit") {
  // torch computes w.float() * scale in fp32 (one rounding of an exact product of a widened fp8
  // value and an fp32 scale); apply_block_scale does the same multiplication, so the bits agree.
  const SafetensorsFile f = read_safetensors(fixture("fp8") / "block_scaled.safetensors");
  const SafetensorsEntry& w = f.entry("weight");
  REQUIRE(w.dtype == DType::F8_E4M3);
  REQUIRE(w.shape == Shape{130, 140});
  const Tensor scale = f.tensor("weight_scale_inv"), want = f.tensor("dequantized");
  CHECK(scale.shape() == Shape{2, 2});
  Tensor got = f.tensor("weight");  // widened, unscaled
  apply_block_scale(f.path().string(), w, scale, {128, 128}, 0, got.span());
  std::int64_t nan = 0, differ = 0;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const float a = got.data()[i], b = want.data()[i];
    if (std::isnan(b)) {
      ++nan;
      differ += !std::isnan(a);
    } else {
      differ += std::memcmp(&a, &b, sizeof a) != 0;
    }
  }
  CHECK(nan == 2);  // 0x7f and 0xff among the first 256 elements
  CHECK(differ == 0);
  // A piece from the middle of the second block row reads the same as the whole.
  std::vector<float> piece(200);
  const std::int64_t first = 129 * 140 - 100;  // crosses into the last row
  f.read_elements("weight", first, piece);
  apply_block_scale(f.path().string(), w, scale, {128, 128}, first, piece);
  for (std::size_t i = 0; i < piece.size(); ++i) CHECK(piece[i] == want.data()[first + static_cast<std::int64_t>(i)]);
  // A scale of the wrong shape names the file, the tensor and both shapes.
  const std::string e = error_of([&] { apply_block_scale(f.path().string(), w, Tensor({2, 3}), {128, 128}, 0, got.span()); });
  CHECK(contains(e, "block_scaled.safetensors"));
  CHECK(contains(e, "'weight'"));
  CHECK(contains(e, "[2, 2]"));
  CHECK(contains(e, "[2, 3]"));
}

TEST_CASE("hf import: HfFolder finds an F8_E4M3 tensor's <name>_scale_inv and dequantises it; without it, an error") {
  const LlamaCopy copy;  // its config.json; the weights file replaced by the FP8 fixture
  fs::copy_file(fixture("fp8") / "block_scaled.safetensors", copy.dir / "model.safetensors",
                fs::copy_options::overwrite_existing);
  const HfFolder folder(copy.dir);
  const Tensor got = folder.tensor("weight"), want = folder.tensor("dequantized");
  std::int64_t differ = 0;
  for (std::int64_t i = 0; i < got.numel(); ++i)
    differ += !(got.data()[i] == want.data()[i] || (std::isnan(got.data()[i]) && std::isnan(want.data()[i])));
  CHECK(differ == 0);

  // The FP8 tensor alone, without its scale (write_safetensors writes F32 only: by hand).
  const SafetensorsFile fp8 = read_safetensors(fixture("fp8") / "block_scaled.safetensors");
  const SafetensorsEntry& w = fp8.entry("weight");
  std::string raw(static_cast<std::size_t>(w.end - w.begin), '\0');
  std::ifstream in(fixture("fp8") / "block_scaled.safetensors", std::ios::binary);
  in.seekg(static_cast<std::streamoff>(fs::file_size(fixture("fp8") / "block_scaled.safetensors") -
                                      (fp8.entries().back().end - w.begin)));
  in.read(raw.data(), static_cast<std::streamsize>(raw.size()));
  const std::string header = R"({"weight":{"dtype":"F8_E4M3","shape":[130,140],"data_offsets":[0,18200]}})";
  std::ofstream out(copy.dir / "model.safetensors", std::ios::binary);
  const std::uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << raw;
  out.close();
  CHECK(contains(error_of([&] { HfFolder(copy.dir).tensor("weight"); }),
                 "model.safetensors: F8_E4M3 tensor 'weight' has no block scale 'weight_scale_inv'"));
}

TEST_CASE("hf import: fp8 e4m3 decoding of every byte") {
  CHECK(fp8_e4m3::to_float(0x00) == 0.0f);
  CHECK(std::signbit(fp8_e4m3::to_float(0x80)));
  CHECK(fp8_e4m3::to_float(0x7e) == 448.0f);      // largest finite
  CHECK(fp8_e4m3::to_float(0x08) == 0x1p-6f);     // smallest normal
  CHECK(fp8_e4m3::to_float(0x01) == 0x1p-9f);     // smallest subnormal
  CHECK(fp8_e4m3::to_float(0x38) == 1.0f);
  CHECK(fp8_e4m3::to_float(0xc4) == -3.0f);       // 1.1000.100: -(1 + 4/8) * 2^(8-7)
  CHECK(std::isnan(fp8_e4m3::to_float(0x7f)));
  CHECK(std::isnan(fp8_e4m3::to_float(0xff)));
}

TEST_CASE("hf import: the Llama fixture's logits equal transformers' within 1e-4 at TP1, TP2, TP4 and PP2") {
  // 1e-4: fp32 throughout, logits of order 1 (max |logit| ~4.5); dsp and torch sum in other
  // orders (~1e-6 relative per op over 2 layers); the measured difference is ~1e-6.
  const fs::path dir = fixture("llama");
  const auto [ids, want] = reference(dir);
  const model::ModelConfig c = read_hf_config(dir);
  CHECK(c.vocab_size == 257);
  CHECK(c.num_query_groups == 2);
  CHECK(c.rope_theta == 10000.0f);
  CHECK(c.norm_epsilon == doctest::Approx(1e-5));
  CHECK(!c.tie_word_embeddings);
  for (int tp : {1, 2, 4}) {  // TP 4: each of the 2 K/V heads on two ranks
    CAPTURE(tp);
    const double diff = max_abs_diff(dsp_logits(dir, tp, ids), want);
    MESSAGE("TP", tp, ": max |dsp - transformers| = ", diff);
    CHECK(diff < 1e-4);
  }  const double pp2 = max_abs_diff(pipeline_logits(dir, 1, 2, ids), want);
  MESSAGE("PP2: max |dsp - transformers| = ", pp2);
  CHECK(pp2 < 1e-4);
}

TEST_CASE("hf import: a sharded folder (model.safetensors.index.json) reads as the single file") {
  const LlamaCopy copy;
  auto tensors = all_tensors(copy.dir / "model.safetensors");
  std::map<std::string, Tensor> first, second;
  nlohmann::json map = nlohmann::json::object();
  for (auto& [name, t] : tensors) {
    const bool one = name.find("layers.1.") == std::string::npos && name != "lm_head.weight";
    (one ? first : second).emplace(name, t);
    map[name] = one ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  fs::remove(copy.dir / "model.safetensors");
  write_all(copy.dir / "model-00001-of-00002.safetensors", first);
  write_all(copy.dir / "model-00002-of-00002.safetensors", second);
  std::ofstream(copy.dir / "model.safetensors.index.json") << nlohmann::json{{"metadata", {}}, {"weight_map", map}}.dump();
  const auto [ids, want] = reference(fixture("llama"));
  CHECK(max_abs_diff(dsp_logits(copy.dir, 2, ids), dsp_logits(fixture("llama"), 2, ids)) == 0.0);

  SUBCASE("a missing shard names the file and a tensor the index lists it for") {
    fs::remove(copy.dir / "model-00002-of-00002.safetensors");
    const std::string e = error_of([&] { HfFolder{copy.dir}; });
    CHECK(contains(e, "model-00002-of-00002.safetensors: missing"));
    CHECK(contains(e, "lm_head.weight"));
  }
  SUBCASE("a tensor the index does not list names the index and the tensor") {
    map.erase("model.layers.1.mlp.up_proj.weight");
    std::ofstream(copy.dir / "model.safetensors.index.json") << nlohmann::json{{"weight_map", map}}.dump();
    const std::string e = error_of([&] { dsp_logits(copy.dir, 1, ids); });
    CHECK(contains(e, "model.safetensors.index.json: no tensor 'model.layers.1.mlp.up_proj.weight'"));
  }
}

TEST_CASE("hf import: a bad folder is an error naming the file and the tensor or field") {
  const LlamaCopy copy;
  const std::vector<std::int32_t> ids{1, 2, 3};
  const auto load = [&] { return error_of([&] { dsp_logits(copy.dir, 2, ids); }); };

  SUBCASE("a tensor of the wrong shape: both shapes") {
    auto tensors = all_tensors(copy.dir / "model.safetensors");
    tensors["model.layers.0.self_attn.k_proj.weight"] = Tensor({16, 64});
    write_all(copy.dir / "model.safetensors", tensors);
    const std::string e = load();
    CHECK(contains(e, "model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has shape [16, 64]"));
    CHECK(contains(e, "expects [32, 64]"));
  }
  SUBCASE("a missing tensor") {
    auto tensors = all_tensors(copy.dir / "model.safetensors");
    tensors.erase("model.layers.1.self_attn.v_proj.weight");
    write_all(copy.dir / "model.safetensors", tensors);
    CHECK(contains(load(), "model.safetensors: no tensor 'model.layers.1.self_attn.v_proj.weight'"));
  }
  SUBCASE("a truncated weights file") {
    fs::resize_file(copy.dir / "model.safetensors", fs::file_size(copy.dir / "model.safetensors") - 100);
    const std::string e = load();
    CHECK(contains(e, "model.safetensors: truncated"));
  }
  SUBCASE("no weights") {
    fs::remove(copy.dir / "model.safetensors");
    CHECK(contains(load(), "no model.safetensors and no model.safetensors.index.json"));
  }
  SUBCASE("an unknown architecture") {
    auto j = copy.config();
    j["architectures"] = {"MistralForCausalLM"};
    copy.set_config(j);
    const std::string e = load();
    CHECK(contains(e, "config.json: field 'architectures' names unknown architecture 'MistralForCausalLM'"));
  }
  SUBCASE("config fields out of range") {
    const std::vector<std::pair<std::string, nlohmann::json>> cases{
        {"num_key_value_heads", 3}, {"hidden_size", -64}, {"rms_norm_eps", 0}, {"vocab_size", "257"},
        {"head_dim", 8}, {"hidden_act", "gelu"}, {"num_attention_heads", 6}};
    const nlohmann::json base = copy.config();
    for (const auto& [field, value] : cases) {
      CAPTURE(field);
      auto j = base;
      j[field] = value;
      copy.set_config(j);
      const std::string e = load();
      CHECK(contains(e, "config.json: field '" + field + "'"));
    }
  }
  SUBCASE("scaled RoPE is refused") {
    auto j = copy.config();
    j["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0}};
    copy.set_config(j);
    CHECK(contains(load(), "rope_parameters: field 'rope_type' is 'llama3'"));
  }
  SUBCASE("transformers 4's rope_theta is read") {
    auto j = copy.config();
    j.erase("rope_parameters");
    j["rope_theta"] = 10000.0;
    j["rope_scaling"] = nullptr;
    copy.set_config(j);
    CHECK(read_hf_config(copy.dir) == read_hf_config(fixture("llama")));
  }
  SUBCASE("a missing config.json") {
    fs::remove(copy.dir / "config.json");
    CHECK(!is_hugging_face_folder(copy.dir));
    CHECK(contains(error_of([&] { read_hf_config(copy.dir); }), "config.json: missing"));
  }
}

TEST_CASE("hf import: DeepSeek-V3 and V2 configs give MLA, YaRN and their routers; a field out of range is named") {
  const model::ModelConfig v3 = read_hf_config(fixture("deepseek_v3"));
  CHECK(v3.is_mla());
  CHECK(v3.q_lora_rank == 24);
  CHECK(v3.kv_lora_rank == 16);
  CHECK(v3.rope_scaling.is_yarn());
  CHECK(v3.rope_scaling.factor == 4.0);
  CHECK(v3.moe_router_enable_expert_bias);
  CHECK(v3.moe_router_group_score == backend::GroupScore::TopTwoSum);
  const model::ModelConfig v2 = read_hf_config(fixture("deepseek_v2"));
  CHECK(v2.is_mla());
  CHECK(v2.q_lora_rank == 0);  // null: q_proj
  CHECK(v2.moe_router_score_function == ep::ScoreFunction::Softmax);
  for (const char* name : {"deepseek_v3", "deepseek_v2"}) {
    CAPTURE(name);
    test::TempDir tmp;
    auto j = nlohmann::json::parse(std::ifstream(fixture(name) / "config.json"));
    j["topk_group"] = 9;
    std::ofstream(tmp / "config.json") << j.dump();
    CHECK(contains(error_of([&] { read_hf_config(tmp.path); }), "field 'topk_group' must be in [1, 4], got 9"));
    j = nlohmann::json::parse(std::ifstream(fixture(name) / "config.json"));
    j["rope_interleave"] = false;
    std::ofstream(tmp / "config.json", std::ios::trunc) << j.dump();
    CHECK(contains(error_of([&] { read_hf_config(tmp.path); }), "field 'rope_interleave' is false"));
  }
}

TEST_CASE("hf export: an MLA model's config.json names the DeepSeek class of its router, or none") {
  // transformers loads a merged V3 / V2 folder with dsp's logits (tools/hf_roundtrip.sh, by
  // hand: it needs PyTorch); here, which class the config names.
  const model::ModelConfig v3 = read_hf_config(fixture("deepseek_v3"));
  const model::ModelConfig v2 = read_hf_config(fixture("deepseek_v2"));
  CHECK(v3.to_hf_json().at("architectures") == nlohmann::json::array({"DeepseekV3ForCausalLM"}));
  CHECK(v3.to_hf_json().at("topk_method") == "noaux_tc");
  CHECK(v2.to_hf_json().at("architectures") == nlohmann::json::array({"DeepseekV2ForCausalLM"}));
  model::ModelConfig dense = v3;
  dense.num_experts = 0;
  CHECK(dense.to_hf_json().at("architectures") == nlohmann::json::array({"DeepseekV3ForCausalLM"}));
  CHECK(dense.to_hf_json().at("first_k_dense_replace") == dense.num_layers);
  model::ModelConfig other = v2;  // softmax scores renormalised: no transformers router
  other.moe_router_norm_topk_prob = true;
  CHECK(other.to_hf_json().at("architectures") == nlohmann::json::array({"DspMoeForCausalLM"}));
  CHECK(model::ModelConfig::from_hf_json(v3.to_hf_json()) == v3);
}

TEST_CASE("hf import: the DeepSeek-V3 and V2 fixtures' logits equal transformers' within 1e-4 at TP1, TP2, EP2 and PP2") {
  // 1e-4 as the Llama fixture: fp32 throughout, 3 layers; the routers' choices win by >= 4e-3
  // in the fixtures (tools/write_hf_fixtures.py), far above fp32 rounding, so dsp picks the
  // same experts. PP2 (and TP2 x PP2): two stages of 2 and 1 layers, each reading its layers'
  // tensors from the folder.
  for (const char* name : {"deepseek_v3", "deepseek_v2"}) {
    const fs::path dir = fixture(name);
    const auto [ids, want] = reference(dir);
    for (auto [tp, ep] : {std::pair{1, 1}, {2, 1}, {1, 2}}) {
      CAPTURE(name);
      CAPTURE(tp);
      CAPTURE(ep);
      const double diff = max_abs_diff(dsp_logits(dir, tp, ids, ep), want);
      MESSAGE(std::string(name), " TP", tp, " EP", ep, ": max |dsp - transformers| = ", diff);
      CHECK(diff < 1e-4);
    }
    for (int tp : {1, 2}) {
      CAPTURE(name);
      CAPTURE(tp);
      const double diff = max_abs_diff(pipeline_logits(dir, tp, 2, ids), want);
      MESSAGE(std::string(name), " TP", tp, " PP2: max |dsp - transformers| = ", diff);
      CHECK(diff < 1e-4);
    }
  }
}

TEST_CASE("hf import: experts in transformers 5's fused layout (gate_up_proj [E, 2I, H], down_proj [E, H, I]) give the per-expert logits") {
  // The DeepSeek-V3 fixture's experts stacked as DeepseekV3Experts holds them (gate rows, then
  // up rows, per expert): the same weights, so the logits are bitwise those of the per-expert
  // folder at TP1 and EP2 (each rank reading its experts' slices).
  test::TempDir tmp;
  const fs::path dir = tmp / "fused";
  fs::create_directories(dir);
  fs::copy_file(fixture("deepseek_v3") / "config.json", dir / "config.json");
  const model::ModelConfig c = read_hf_config(dir);
  auto tensors = all_tensors(fixture("deepseek_v3") / "model.safetensors");
  const std::int64_t E = c.num_experts, I = c.moe_ffn_hidden_size, H = c.hidden_size;
  for (std::int64_t l = c.first_k_dense_replace; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.";
    Tensor gate_up = Tensor::host_zeros({E, 2 * I, H}), down = Tensor::host_zeros({E, H, I});
    for (std::int64_t e = 0; e < E; ++e) {
      const std::string x = p + std::to_string(e) + ".";
      const auto put = [&](Tensor& to, std::int64_t at, const std::string& name) {
        const Tensor& t = tensors.at(name);
        std::copy(t.values().begin(), t.values().end(), to.span().begin() + at);
        tensors.erase(name);
      };
      put(gate_up, e * 2 * I * H, x + "gate_proj.weight");
      put(gate_up, e * 2 * I * H + I * H, x + "up_proj.weight");
      put(down, e * H * I, x + "down_proj.weight");
    }
    tensors.emplace(p + "gate_up_proj", std::move(gate_up));
    tensors.emplace(p + "down_proj", std::move(down));
  }
  write_all(dir / "model.safetensors", tensors);
  const auto [ids, want] = reference(fixture("deepseek_v3"));
  CHECK(max_abs_diff(dsp_logits(dir, 1, ids), dsp_logits(fixture("deepseek_v3"), 1, ids)) == 0.0);
  CHECK(max_abs_diff(dsp_logits(dir, 1, ids, 2), want) < 1e-4);

  // a fused tensor of the wrong shape names the file, the tensor and both shapes
  const std::string name = "model.layers.1.mlp.experts.down_proj";
  tensors.at(name) = Tensor::host_zeros({E, H, I + 1});
  write_all(dir / "model.safetensors", tensors);
  const std::string e = error_of([&] { HfFolder folder(dir); });
  CAPTURE(e);
  CHECK(contains(e, "model.safetensors: fused expert tensor '" + name + "' has shape [" + std::to_string(E) + ", " +
                        std::to_string(H) + ", " + std::to_string(I + 1) + "]"));
}

TEST_CASE("hf import: DeepSeek-V3's multi-token-prediction layer is kept aside on import and written back by merge") {
  // The V3 fixture (3 layers, num_nextn_predict_layers 1) with tensors of an MTP layer at index
  // 3, named as DeepSeek-V3's checkpoints name layer 61's.
  test::TempDir tmp;
  const fs::path dir = tmp / "v3_mtp", ckpt = tmp / "ckpt", merged = tmp / "merged";
  fs::create_directories(dir);
  fs::copy_file(fixture("deepseek_v3") / "config.json", dir / "config.json");
  auto tensors = all_tensors(fixture("deepseek_v3") / "model.safetensors");
  const model::ModelConfig c = read_hf_config(dir);
  const std::int64_t H = c.hidden_size;
  std::map<std::string, Tensor> mtp;
  mtp.emplace("model.layers.3.enorm.weight", Tensor::host_zeros({H}));
  mtp.emplace("model.layers.3.hnorm.weight", Tensor::host_zeros({H}));
  mtp.emplace("model.layers.3.eh_proj.weight", Tensor::host_zeros({H, 2 * H}));
  mtp.emplace("model.layers.3.shared_head.norm.weight", Tensor::host_zeros({H}));
  float v = 0.25f;
  for (auto& [name, t] : mtp)
    for (float& x : t.span()) x = (v += 0.125f);
  for (const auto& [name, t] : mtp) tensors.emplace(name, t);
  write_all(dir / "model.safetensors", tensors);

  comm::launch(2, [&](comm::ThreadComm& world) { import_hugging_face(dir, ckpt, world); });
  const Manifest m = read_manifest(ckpt);
  REQUIRE(m.meta.extra.contains("kept_aside"));
  CHECK(m.meta.extra.at("kept_aside").at("tensors") == 4);
  CHECK(m.meta.extra.at("kept_aside").at("num_nextn_predict_layers") == 1);
  const auto kept = all_tensors(ckpt / "mtp.safetensors");
  CHECK(kept.size() == 4);
  const auto [ids, want] = reference(fixture("deepseek_v3"));
  CHECK(max_abs_diff(dsp_logits(ckpt, 1, ids), want) < 1e-4);  // the model itself is unchanged

  merge(ckpt, merged);
  const auto out = all_tensors(merged / "model.safetensors");
  for (const auto& [name, t] : mtp) {
    CAPTURE(name);
    REQUIRE(out.count(name) == 1);
    CHECK(max_abs_diff(out.at(name), t) == 0.0);
  }
  const auto config = nlohmann::json::parse(std::ifstream(merged / "config.json"));
  CHECK(config.at("num_nextn_predict_layers") == 1);
  // an import without such tensors keeps nothing aside
  comm::launch(1, [&](comm::ThreadComm& world) { import_hugging_face(fixture("deepseek_v3"), tmp / "plain", world); });
  CHECK(!read_manifest(tmp / "plain").meta.extra.contains("kept_aside"));
  CHECK(!fs::exists(tmp / "plain" / "mtp.safetensors"));
}

TEST_CASE("hf import: import -> dsp checkpoint at TP2 -> merge gives the fixture's tensors; the checkpoint's logits are the folder's") {
  test::TempDir tmp;
  const fs::path ckpt = tmp / "ckpt", merged = tmp / "merged";
  comm::launch(2, [&](comm::ThreadComm& world) { import_hugging_face(fixture("llama"), ckpt, world); });
  const Manifest m = read_manifest(ckpt);
  CHECK(m.meta.layout.tensor == 2);
  CHECK(m.meta.extra.contains("imported_from"));
  CHECK(std::none_of(m.tensors.begin(), m.tensors.end(), [](const auto& t) { return is_optimizer_state(t.name); }));
  const auto [ids, want] = reference(fixture("llama"));
  CHECK(max_abs_diff(dsp_logits(ckpt, 1, ids), want) < 1e-4);

  merge(ckpt, merged);
  const auto a = all_tensors(fixture("llama") / "model.safetensors"), b = all_tensors(merged / "model.safetensors");
  REQUIRE(a.size() == b.size());
  for (const auto& [name, t] : a) {
    CAPTURE(name);
    REQUIRE(b.count(name) == 1);
    CHECK(max_abs_diff(t, b.at(name)) == 0.0);
  }
  CHECK(read_hf_config(merged) == read_hf_config(fixture("llama")));
}

}  // namespace checkpoint_hf_import_test
