#pragma once
// Reading a Hugging Face model's config.json into a ModelConfig. Architectures:
//   LlamaForCausalLM        read: dsp's dense model is Llama's (RMSNorm, GQA with rotate-half
//                           RoPE, SwiGLU MLP). Fields as transformers 5 writes them
//                           (rope_parameters {"rope_type": "default", "rope_theta": ...}) or as
//                           transformers 4 did (rope_theta, rope_scaling null).
//   DeepseekV3ForCausalLM,  MLA (q_lora_rank null in V2-Lite), YaRN RoPE, the DeepSeekMoE
//   DeepseekV2ForCausalLM   fields and the router of topk_method (noaux_tc, group_limited_greedy,
//                           greedy).
// Every error names config.json's path and the field, with the value found.
#include <cstdint>
#include <climits>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "dsp/checkpoint/file_io.hpp"
#include "dsp/core/error.hpp"
#include "dsp/model/config.hpp"

namespace dsp::checkpoint {

/// Name of a Hugging Face model folder's config file.
inline constexpr std::string_view hf_config_file = "config.json";

namespace detail {

// Typed, range-checked access to the fields of one config.json; errors name the file and field.
class ConfigFields {
 public:
  ConfigFields(const nlohmann::json& j, std::string where) : j_(j), where_(std::move(where)) {}

  [[noreturn]] void fail(std::string_view field, const auto&... what) const {
    throw ConfigError(dsp::detail::concat(where_, ": field '", field, "' ", what...));
  }
  bool has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }
  const nlohmann::json& at(const char* key) const {
    if (!has(key)) fail(key, "is missing");
    return j_.at(key);
  }
  /// An integer in [min, max].
  std::int64_t integer(const char* key, std::int64_t min, std::int64_t max = INT64_MAX) const {
    const nlohmann::json& v = at(key);
    if (!v.is_number_integer()) fail(key, "must be an integer, got ", v.dump());
    const auto n = v.get<std::int64_t>();
    if (n < min || n > max) {
      if (max == INT64_MAX) fail(key, "must be >= ", min, ", got ", n);
      fail(key, "must be in [", min, ", ", max, "], got ", n);
    }
    return n;
  }
  std::int64_t integer_or(const char* key, std::int64_t fallback, std::int64_t min,
                          std::int64_t max = INT64_MAX) const {
    return has(key) ? integer(key, min, max) : fallback;
  }
  /// A positive finite number.
  double positive(const char* key) const {
    const nlohmann::json& v = at(key);
    if (!v.is_number() || !(v.get<double>() > 0) || v.get<double>() > 1e300) fail(key, "must be a positive number, got ", v.dump());
    return v.get<double>();
  }
  bool boolean_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j_.at(key).is_boolean()) fail(key, "must be true or false, got ", j_.at(key).dump());
    return j_.at(key).get<bool>();
  }
  std::string string_or(const char* key, std::string fallback) const {
    if (!has(key)) return fallback;
    if (!j_.at(key).is_string()) fail(key, "must be a string, got ", j_.at(key).dump());
    return j_.at(key).get<std::string>();
  }
  /// A string field that, when present, must be one of `allowed`.
  std::string one_of(const char* key, std::string fallback, std::initializer_list<std::string_view> allowed) const {
    std::string v = string_or(key, fallback);
    std::string list;
    for (std::string_view a : allowed) {
      if (v == a) return v;
      list += (list.empty() ? "" : ", ") + std::string(a);
    }
    fail(key, "is '", v, "'; dsp computes ", list, " only");
  }
  const std::string& where() const { return where_; }

 private:
  const nlohmann::json& j_;
  std::string where_;
};

// The fields Llama and DeepSeek share: sizes, norm, RoPE base, embeddings.
inline model::ModelConfig common_fields(const ConfigFields& f) {
  model::ModelConfig c;
  c.vocab_size = f.integer("vocab_size", 1);
  c.hidden_size = f.integer("hidden_size", 1);
  c.ffn_hidden_size = f.integer("intermediate_size", 1);
  c.num_layers = f.integer("num_hidden_layers", 1);
  c.num_attention_heads = f.integer("num_attention_heads", 1);
  c.num_query_groups = f.integer_or("num_key_value_heads", c.num_attention_heads, 1, c.num_attention_heads);
  if (c.num_attention_heads % c.num_query_groups != 0)
    f.fail("num_key_value_heads", "(", c.num_query_groups, ") must divide num_attention_heads (",
           c.num_attention_heads, ")");
  c.seq_length = f.integer("max_position_embeddings", 1);
  c.norm_epsilon = static_cast<float>(f.positive("rms_norm_eps"));
  c.tie_word_embeddings = f.boolean_or("tie_word_embeddings", false);
  if (f.has("initializer_range")) c.init_method_std = static_cast<float>(f.positive("initializer_range"));
  f.one_of("hidden_act", "silu", {"silu"});
  if (f.boolean_or("attention_bias", false)) f.fail("attention_bias", "is true; dsp's projections have no bias");
  if (f.boolean_or("mlp_bias", false)) f.fail("mlp_bias", "is true; dsp's projections have no bias");
  return c;
}

// RoPE of a Llama config: transformers 5's rope_parameters, or transformers 4's rope_theta with
// rope_scaling null. Scaled RoPE (linear, dynamic, yarn, llama3, ...) is refused.
inline float llama_rope_theta(const ConfigFields& f, const nlohmann::json& j) {
  if (f.has("rope_parameters")) {
    const nlohmann::json& rope = j.at("rope_parameters");
    if (!rope.is_object()) f.fail("rope_parameters", "must be an object, got ", rope.dump());
    const ConfigFields r(rope, f.where() + ": rope_parameters");
    r.one_of("rope_type", "default", {"default"});
    return static_cast<float>(r.positive("rope_theta"));
  }
  if (f.has("rope_scaling")) {
    const ConfigFields r(j.at("rope_scaling"), f.where() + ": rope_scaling");
    r.one_of(r.has("rope_type") ? "rope_type" : "type", "default", {"default"});
  }
  return f.has("rope_theta") ? static_cast<float>(f.positive("rope_theta")) : 10000.0f;  // LlamaConfig's default
}

// DeepSeek-V2/V3 (transformers' DeepseekV2Config / DeepseekV3Config): the MLA and MoE fields
// into `c`. The RoPE of the MLA slice (rope_parameters or rope_scaling, default or YaRN) is
// ModelConfig::from_hf_json's reading. topk_method: noaux_tc is the V3 router (expert bias,
// groups by their top-2 sum), group_limited_greedy groups by their best score, greedy has no
// groups (transformers ignores n_group then).
inline void deepseek_fields(const ConfigFields& f, const nlohmann::json& j, bool v3, model::ModelConfig& c) {
  c.kv_lora_rank = f.integer("kv_lora_rank", 1);
  c.q_lora_rank = f.has("q_lora_rank") ? f.integer("q_lora_rank", 1) : 0;
  c.qk_nope_head_dim = f.integer("qk_nope_head_dim", 1);
  c.qk_rope_head_dim = f.integer("qk_rope_head_dim", 2);
  if (c.qk_rope_head_dim % 2 != 0) f.fail("qk_rope_head_dim", "(", c.qk_rope_head_dim, ") must be even (RoPE rotates pairs)");
  c.v_head_dim = f.integer("v_head_dim", 1);
  if (!f.boolean_or("rope_interleave", true))
    f.fail("rope_interleave", "is false; dsp's MLA rotates interleaved pairs, DeepSeek's layout");
  const char* rope_field = f.has("rope_parameters") ? "rope_parameters" : "rope_scaling";
  try {
    const model::ModelConfig rope = model::ModelConfig::from_hf_json(j);
    c.rope_theta = rope.rope_theta;
    c.rope_scaling = rope.rope_scaling;
    c.rope_scaling.validate();
  } catch (const ConfigError& e) {
    f.fail(rope_field, e.what());
  }
  c.num_experts = f.integer_or("n_routed_experts", 0, 0);
  if (!c.is_moe()) return;
  c.moe_router_topk = f.integer("num_experts_per_tok", 1, c.num_experts);
  c.moe_ffn_hidden_size = f.integer("moe_intermediate_size", 1);
  c.num_shared_experts = f.integer_or("n_shared_experts", 0, 0);
  c.first_k_dense_replace = f.integer_or("first_k_dense_replace", 0, 0, c.num_layers - 1);
  c.moe_router_num_groups = f.integer_or("n_group", 1, 1, c.num_experts);
  if (c.num_experts % c.moe_router_num_groups != 0)
    f.fail("n_group", "(", c.moe_router_num_groups, ") must divide n_routed_experts (", c.num_experts, ")");
  c.moe_router_group_topk = f.integer_or("topk_group", 1, 1, c.moe_router_num_groups);
  c.moe_router_topk_scaling_factor = static_cast<float>(f.has("routed_scaling_factor") ? f.positive("routed_scaling_factor") : 1.0);
  c.moe_router_norm_topk_prob = f.boolean_or("norm_topk_prob", false);
  const std::string scoring = f.one_of("scoring_func", v3 ? "sigmoid" : "softmax", {"softmax", "sigmoid"});
  c.moe_router_score_function = scoring == "sigmoid" ? ep::ScoreFunction::Sigmoid : ep::ScoreFunction::Softmax;
  const std::string method = f.one_of("topk_method", v3 ? "noaux_tc" : "greedy",
                                      {"greedy", "group_limited_greedy", "noaux_tc"});
  c.moe_router_enable_expert_bias = method == "noaux_tc";
  if (method == "group_limited_greedy") c.moe_router_group_score = backend::GroupScore::Max;
  if (method == "greedy") c.moe_router_num_groups = c.moe_router_group_topk = 1;
  // Sigmoid scores: dsp renormalises the k > 1 weights always (DeepSeek's inference code and
  // Megatron); transformers only with norm_topk_prob, so a V3 config without it is another model.
  if (c.moe_router_score_function == ep::ScoreFunction::Sigmoid && c.moe_router_topk > 1 &&
      !c.moe_router_norm_topk_prob)
    f.fail("norm_topk_prob", "is false with sigmoid scores; dsp renormalises the top-k weights of sigmoid routing");
}

}  // namespace detail

/// The ModelConfig of a Hugging Face config.json object `j` (read from `where`, named in
/// errors). Throws ConfigError naming `where` and the field when: "architectures" is missing or
/// names none of LlamaForCausalLM, DeepseekV3ForCausalLM, DeepseekV2ForCausalLM; a field dsp
/// needs is missing, of the wrong type or out of range (sizes >= 1, num_key_value_heads
/// dividing num_attention_heads, a positive rms_norm_eps and rope_theta, head_dim equal to
/// hidden_size / num_attention_heads); the model has something dsp does not compute (an
/// activation other than silu, projection biases, scaled RoPE on Llama, RoPE other than default
/// or YaRN on DeepSeek, non-interleaved MLA RoPE, unnormalised sigmoid routing).
inline model::ModelConfig parse_hf_config(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw ConfigError(where + ": not a JSON object");
  const detail::ConfigFields f(j, where);
  const nlohmann::json& archs = f.at("architectures");
  if (!archs.is_array() || archs.size() != 1 || !archs[0].is_string())
    f.fail("architectures", "must list one architecture, got ", archs.dump());
  const std::string arch = archs[0].get<std::string>();
  model::ModelConfig c = detail::common_fields(f);
  if (arch == "LlamaForCausalLM") {
    if (c.hidden_size % c.num_attention_heads != 0 || c.head_dim() % 2 != 0)
      f.fail("num_attention_heads", "(", c.num_attention_heads, ") must divide hidden_size (", c.hidden_size,
             ") into heads of an even dim (RoPE rotates pairs)");
    if (f.has("head_dim") && f.integer("head_dim", 1) != c.head_dim())
      f.fail("head_dim", "is ", f.integer("head_dim", 1), "; dsp's head dim is hidden_size / num_attention_heads = ",
             c.head_dim());
    if (f.integer_or("pretraining_tp", 1, 1) != 1) f.fail("pretraining_tp", "must be 1");
    c.rope_theta = detail::llama_rope_theta(f, j);
    return c;
  }
  if (arch == "DeepseekV3ForCausalLM" || arch == "DeepseekV2ForCausalLM") {
    detail::deepseek_fields(f, j, arch == "DeepseekV3ForCausalLM", c);
    return c;
  }
  f.fail("architectures", "names unknown architecture '", arch,
         "' (dsp reads LlamaForCausalLM, DeepseekV3ForCausalLM and DeepseekV2ForCausalLM)");
}

/// parse_hf_config of `dir`/config.json. Throws CheckpointError naming the file when it is
/// missing or not valid JSON; ConfigError as parse_hf_config.
inline model::ModelConfig read_hf_config(const std::filesystem::path& dir) {
  const std::filesystem::path path = dir / hf_config_file;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw CheckpointError(dsp::detail::concat(path.string(), ": missing (a Hugging Face model folder has one)"));
  const nlohmann::json j = nlohmann::json::parse(read_text(path), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw CheckpointError(path.string() + ": not valid JSON (truncated?)");
  return parse_hf_config(j, path.string());
}

}  // namespace dsp::checkpoint
