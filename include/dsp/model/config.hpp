#pragma once
// ModelConfig: the decoder's hyper-parameters, with Megatron names in C++ and Hugging Face
// names in config.json.
#include <cstdint>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "dsp/core/divide.hpp"
#include "dsp/core/error.hpp"
#include "dsp/ep/router.hpp"
#include "dsp/model/yarn.hpp"

namespace dsp::model {

struct ModelConfig {
  std::int64_t vocab_size = 256;            ///< tokens (bytes for the char-level demo)
  std::int64_t hidden_size = 128;
  std::int64_t num_layers = 2;
  std::int64_t num_attention_heads = 4;
  std::int64_t num_query_groups = 4;        ///< key/value heads (GQA); == heads is MHA
  std::int64_t ffn_hidden_size = 512;       ///< SwiGLU intermediate size
  std::int64_t seq_length = 128;            ///< longest sequence (training and serving)
  float rope_theta = 10000.0f;
  float norm_epsilon = 1e-5f;
  bool tie_word_embeddings = false;
  float init_method_std = 0.02f;

  // Mixture of experts (DeepSeekMoE, Dai et al. 2024): layers from first_k_dense_replace on
  // replace the dense MLP by routed experts plus shared experts. num_experts == 0: dense model.
  std::int64_t num_experts = 0;             ///< --num-experts (n_routed_experts)
  std::int64_t moe_router_topk = 2;         ///< --moe-router-topk (num_experts_per_tok)
  std::int64_t moe_ffn_hidden_size = 0;     ///< --moe-ffn-hidden-size (moe_intermediate_size), per expert
  std::int64_t num_shared_experts = 0;      ///< n_shared_experts, each moe_ffn_hidden_size wide
  std::int64_t first_k_dense_replace = 0;   ///< --first-k-dense-replace: leading dense layers
  ep::ScoreFunction moe_router_score_function = ep::ScoreFunction::Softmax;  ///< --moe-router-score-function (scoring_func)
  bool moe_router_norm_topk_prob = false;   ///< --moe-router-norm-topk-prob (norm_topk_prob)
  std::int64_t moe_router_num_groups = 1;   ///< --moe-router-num-groups (n_group)
  std::int64_t moe_router_group_topk = 1;   ///< --moe-router-group-topk (topk_group)
  float moe_router_topk_scaling_factor = 1.0f;  ///< --moe-router-topk-scaling-factor (routed_scaling_factor)
  bool moe_router_enable_expert_bias = false;  ///< --moe-router-enable-expert-bias (topk_method noaux_tc)
  /// How group-limited routing scores a group: the sum of its top-2 (DeepSeek-V3, Megatron) or
  /// its top-1 (DeepSeek-V2, topk_method group_limited_greedy).
  backend::GroupScore moe_router_group_score = backend::GroupScore::TopTwoSum;

  // Multi-head Latent Attention (DeepSeek-V2, 2024, section 2.1; model/mla_attention.hpp):
  // kv_lora_rank > 0 selects MLA; HF names. Its RMSNorms use transformers' default eps 1e-6.
  std::int64_t q_lora_rank = 0;             ///< q_lora_rank: query latent width (0: HF null, q_proj as in V2-Lite)
  std::int64_t kv_lora_rank = 0;            ///< kv_lora_rank: the cached key/value latent width (0: GQA)
  std::int64_t qk_nope_head_dim = 0;        ///< qk_nope_head_dim: per-head query/key width without RoPE
  std::int64_t qk_rope_head_dim = 0;        ///< qk_rope_head_dim: the decoupled RoPE width (key shared by all heads)
  std::int64_t v_head_dim = 0;              ///< v_head_dim: per-head value width
  RopeScaling rope_scaling{};               ///< rope_scaling / rope_parameters (YaRN), on the rope slice

  /// --use-flash-attn: attention keeps each query's log-sum-exp [batch, heads/tp, seq] for
  /// backward instead of the probabilities [batch, heads/tp, seq, seq] and recomputes them
  /// (backend flash_attention_forward/backward; FlashAttention, Dao et al. 2022). The same
  /// function in a different summation order: in fp32 results agree to ~1e-6 relative, not
  /// bitwise. In mixed precision both round their GEMM inputs (P included) to 16 bits, but the
  /// materialising path computes dS from its kept 16-bit P and this one from the recomputed
  /// fp32 P, so they differ by that rounding. A choice of kernel, not of weights: not written
  /// to config.json.
  bool use_flash_attn = false;

  std::int64_t head_dim() const { return hidden_size / num_attention_heads; }
  /// Whether attention is MLA (kv_lora_rank > 0) rather than GQA.
  bool is_mla() const { return kv_lora_rank > 0; }

  bool is_moe() const { return num_experts > 0; }
  /// Whether global layer `layer` is an MoE layer (else dense).
  bool is_moe_layer(std::int64_t layer) const { return is_moe() && layer >= first_k_dense_replace; }
  /// The router of the MoE layers.
  ep::RouterConfig router() const {
    return {num_experts, moe_router_topk, moe_router_score_function, moe_router_norm_topk_prob,
            moe_router_num_groups, moe_router_group_topk, moe_router_topk_scaling_factor, moe_router_group_score};
  }

  /// Throws ConfigError naming both numbers when a size does not divide (or is not positive).
  void validate(int tensor_parallel) const {
    DSP_CHECK_AS(ConfigError, num_experts >= 0, "number of experts must be >= 0 (0: dense), got ", num_experts);
    for (auto [name, value] : {std::pair{"vocab size", vocab_size}, {"hidden size", hidden_size},
                               {"number of layers", num_layers}, {"ffn hidden size", ffn_hidden_size},
                               {"sequence length", seq_length}, {"number of attention heads", num_attention_heads},
                               {"number of query groups", num_query_groups}})
      DSP_CHECK_AS(ConfigError, value > 0, name, " must be positive, got ", value);
    divide(hidden_size, num_attention_heads, "hidden size", "number of attention heads");
    DSP_CHECK_AS(ConfigError, head_dim() % 2 == 0, "head dim (", head_dim(), ") must be even for RoPE");
    divide(num_attention_heads, num_query_groups, "number of attention heads", "number of query groups");
    divide(hidden_size, tensor_parallel, "hidden size", "tensor-model-parallel-size");
    divide(num_attention_heads, tensor_parallel, "number of attention heads", "tensor-model-parallel-size");
    DSP_CHECK_AS(ConfigError, num_query_groups % tensor_parallel == 0 || tensor_parallel % num_query_groups == 0,
                 "number of query groups (", num_query_groups, ") and tensor-model-parallel-size (", tensor_parallel,
                 ") must divide one another (K/V heads are split, or replicated when fewer than TP)");
    divide(ffn_hidden_size, tensor_parallel, "ffn hidden size", "tensor-model-parallel-size");
    if (is_mla()) {
      for (auto [name, value] : {std::pair{"qk_nope_head_dim", qk_nope_head_dim}, {"qk_rope_head_dim", qk_rope_head_dim},
                                 {"v_head_dim", v_head_dim}})
        DSP_CHECK_AS(ConfigError, value > 0, name, " must be positive for MLA, got ", value);
      DSP_CHECK_AS(ConfigError, q_lora_rank >= 0, "q_lora_rank must be >= 0 (0: null), got ", q_lora_rank);
      DSP_CHECK_AS(ConfigError, qk_rope_head_dim % 2 == 0, "qk_rope_head_dim (", qk_rope_head_dim,
                   ") must be even for RoPE");
    }
    rope_scaling.validate();
    if (!is_moe()) return;
    router().validate();
    DSP_CHECK_AS(ConfigError, moe_ffn_hidden_size > 0, "moe ffn hidden size must be positive, got ",
                 moe_ffn_hidden_size);
    DSP_CHECK_AS(ConfigError, num_shared_experts >= 0, "number of shared experts must be >= 0, got ",
                 num_shared_experts);
    DSP_CHECK_AS(ConfigError, first_k_dense_replace >= 0 && first_k_dense_replace < num_layers,
                 "first-k-dense-replace (", first_k_dense_replace, ") must be in [0, number of layers = ", num_layers,
                 "): an MoE model needs an MoE layer");
    divide(moe_ffn_hidden_size, tensor_parallel, "moe ffn hidden size", "tensor-model-parallel-size");
  }

  /// Throws ConfigError naming both numbers unless expert_parallel divides the routed experts;
  /// a dense model takes expert_parallel 1 only.
  void validate_expert_parallel(int expert_parallel) const {
    DSP_CHECK_AS(ConfigError, is_moe() || expert_parallel == 1, "expert-model-parallel-size ", expert_parallel,
                 " needs an MoE model (--num-experts > 0)");
    if (!is_moe()) return;
    DSP_CHECK_AS(ConfigError, num_experts % expert_parallel == 0, "number of experts (", num_experts,
                 ") is not divisible by expert-model-parallel-size (", expert_parallel, ")");
  }

  /// Parameters of the global model (embedding counted once when tied).
  std::int64_t num_parameters() const {
    const std::int64_t h = hidden_size, d = head_dim();
    const std::int64_t heads = num_attention_heads, qk = qk_nope_head_dim + qk_rope_head_dim;
    const std::int64_t mla_q = q_lora_rank > 0 ? h * q_lora_rank + q_lora_rank + q_lora_rank * heads * qk : h * heads * qk;
    const std::int64_t mla_attn = mla_q + h * (kv_lora_rank + qk_rope_head_dim) + kv_lora_rank +
                                  kv_lora_rank * heads * (qk_nope_head_dim + v_head_dim) + heads * v_head_dim * h;
    const std::int64_t attn =
        is_mla() ? mla_attn : h * (num_attention_heads + 2 * num_query_groups) * d + num_attention_heads * d * h;
    const std::int64_t dense_mlp = 3 * h * ffn_hidden_size;
    const std::int64_t moe_mlp = 3 * h * moe_ffn_hidden_size * (num_experts + num_shared_experts) + num_experts * h;
    std::int64_t layers = 0;
    for (std::int64_t l = 0; l < num_layers; ++l) layers += attn + 2 * h + (is_moe_layer(l) ? moe_mlp : dense_mlp);
    return vocab_size * h * (tie_word_embeddings ? 1 : 2) + layers + h;
  }

  /// Parameters one token's forward multiplies by: all of num_parameters() but the input
  /// embedding table (a lookup; a tied table counts once, as the output layer) and, in each MoE
  /// layer, all but the top-k routed experts (the shared experts and the router count). The
  /// convention of DeepSeek's "activated parameters": DeepSeek-V3 36.6 B ("37 B"), V2-Lite
  /// 2.45 B ("2.4 B") by this count (samples/configs/deepseek_*_config.json, tests/plan).
  std::int64_t num_activated_parameters() const {
    const std::int64_t lookup = tie_word_embeddings ? 0 : vocab_size * hidden_size;
    if (!is_moe()) return num_parameters() - lookup;
    const std::int64_t idle = 3 * hidden_size * moe_ffn_hidden_size * (num_experts - moe_router_topk);
    return num_parameters() - lookup - (num_layers - first_k_dense_replace) * idle;
  }

  /// Bytes one token adds to the serving KV cache of the whole model (every layer, unsharded)
  /// at `dtype_bytes` per value: MLA caches its latent and rope key, layers x (kv_lora_rank +
  /// qk_rope_head_dim) (DeepSeek-V3 in bf16: 61 x 576 x 2 = 70,272); GQA its keys and values,
  /// layers x 2 x kv_heads x head_dim.
  std::int64_t kv_cache_bytes_per_token(std::int64_t dtype_bytes) const {
    const std::int64_t per_layer = is_mla() ? kv_lora_rank + qk_rope_head_dim : 2 * num_query_groups * head_dim();
    return num_layers * per_layer * dtype_bytes;
  }

  /// Hugging Face config.json: a dense GQA model is the Llama architecture. An MLA model is
  /// DeepseekV3ForCausalLM (dense, or with V3's router) or DeepseekV2ForCausalLM (V2's router).
  /// Any other MoE model (GQA attention, or a router transformers does not compute, such as
  /// softmax scores with groups scored by their top-2 sum) carries DeepSeek's MoE field names
  /// under its own architecture name, "DspMoeForCausalLM", which only dsp's own programs read
  /// back (from_hf_json).
  nlohmann::json to_hf_json() const {
    nlohmann::json j = {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"vocab_size", vocab_size},
            {"hidden_size", hidden_size},
            {"intermediate_size", ffn_hidden_size},
            {"num_hidden_layers", num_layers},
            {"num_attention_heads", num_attention_heads},
            {"num_key_value_heads", num_query_groups},
            {"max_position_embeddings", seq_length},
            {"rope_theta", rope_theta},
            {"rms_norm_eps", norm_epsilon},
            {"tie_word_embeddings", tie_word_embeddings},
            {"initializer_range", init_method_std},
            {"hidden_act", "silu"},
            {"attention_bias", false},
            {"torch_dtype", "float32"}};
    if (is_mla()) {  // DeepSeek-V2/V3 names; the architecture name is the exporter's (issue 33 item 6)
      j["q_lora_rank"] = q_lora_rank > 0 ? nlohmann::json(q_lora_rank) : nlohmann::json(nullptr);
      j["kv_lora_rank"] = kv_lora_rank;
      j["qk_nope_head_dim"] = qk_nope_head_dim;
      j["qk_rope_head_dim"] = qk_rope_head_dim;
      j["v_head_dim"] = v_head_dim;
      j["rope_interleave"] = true;
    }
    if (rope_scaling.is_yarn())
      j["rope_scaling"] = {{"type", "yarn"},
                           {"factor", rope_scaling.factor},
                           {"original_max_position_embeddings", rope_scaling.original_max_position_embeddings},
                           {"beta_fast", rope_scaling.beta_fast},
                           {"beta_slow", rope_scaling.beta_slow},
                           {"mscale", rope_scaling.mscale},
                           {"mscale_all_dim", rope_scaling.mscale_all_dim}};
    if (is_mla() && !is_moe()) {  // every layer dense: DeepSeek-V3's classes with no MoE layer
      j["architectures"] = {"DeepseekV3ForCausalLM"};
      j["model_type"] = "deepseek_v3";
      j["first_k_dense_replace"] = num_layers;
    }
    if (!is_moe()) return j;
    j["architectures"] = {"DspMoeForCausalLM"};
    j["model_type"] = "dsp_moe";
    j["n_routed_experts"] = num_experts;
    j["num_experts_per_tok"] = moe_router_topk;
    j["moe_intermediate_size"] = moe_ffn_hidden_size;
    j["n_shared_experts"] = num_shared_experts;
    j["first_k_dense_replace"] = first_k_dense_replace;
    j["scoring_func"] = moe_router_score_function == ep::ScoreFunction::Sigmoid ? "sigmoid" : "softmax";
    j["norm_topk_prob"] = router().normalizes();  // sigmoid scores are always renormalised
    j["n_group"] = moe_router_num_groups;
    j["topk_group"] = moe_router_group_topk;
    j["routed_scaling_factor"] = moe_router_topk_scaling_factor;
    // noaux_tc: with e_score_correction_bias; group_limited_greedy: groups scored by their best
    j["topk_method"] = moe_router_enable_expert_bias                            ? "noaux_tc"
                       : moe_router_group_score == backend::GroupScore::Max ? "group_limited_greedy"
                                                                            : "greedy";
    // MLA with a router transformers computes: DeepSeek-V3's (sigmoid, renormalised, groups by
    // their top-2 sum, the bias optional: a missing e_score_correction_bias loads as zeros) or
    // DeepSeek-V2's (softmax, not renormalised, no groups or groups by their best).
    if (is_mla()) {
      const ep::RouterConfig r = router();
      const bool v3 = r.score == ep::ScoreFunction::Sigmoid && (r.normalizes() || r.top_k == 1) &&
                      r.group_score == backend::GroupScore::TopTwoSum &&
                      (r.num_groups == 1 || num_experts / r.num_groups >= 2);
      const bool v2 = r.score == ep::ScoreFunction::Softmax && !r.normalizes() && !moe_router_enable_expert_bias &&
                      (r.num_groups == 1 || r.group_score == backend::GroupScore::Max);
      if (v3 || v2) {
        j["architectures"] = {v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM"};
        j["model_type"] = v3 ? "deepseek_v3" : "deepseek_v2";
        if (v3) j["topk_method"] = "noaux_tc";
      }
    }
    return j;
  }
  /// Inverse of to_hf_json; throws ConfigError naming a missing field.
  static ModelConfig from_hf_json(const nlohmann::json& j) {
    auto get = [&](const char* key) -> const nlohmann::json& {
      DSP_CHECK_AS(ConfigError, j.contains(key), "model config is missing '", key, "'");
      return j.at(key);
    };
    ModelConfig c;
    c.vocab_size = get("vocab_size").get<std::int64_t>();
    c.hidden_size = get("hidden_size").get<std::int64_t>();
    c.ffn_hidden_size = get("intermediate_size").get<std::int64_t>();
    c.num_layers = get("num_hidden_layers").get<std::int64_t>();
    c.num_attention_heads = get("num_attention_heads").get<std::int64_t>();
    c.num_query_groups = get("num_key_value_heads").get<std::int64_t>();
    c.seq_length = get("max_position_embeddings").get<std::int64_t>();
    // transformers 5 writes rope_theta and the scaling into rope_parameters; older files rope_scaling
    const nlohmann::json* rope = j.contains("rope_parameters") && j.at("rope_parameters").is_object()
                                     ? &j.at("rope_parameters")
                                 : j.contains("rope_scaling") && j.at("rope_scaling").is_object() ? &j.at("rope_scaling")
                                                                                                   : nullptr;
    c.rope_theta = j.contains("rope_theta") ? get("rope_theta").get<float>()
                   : rope && rope->contains("rope_theta") ? rope->at("rope_theta").get<float>()
                                                          : get("rope_theta").get<float>();
    if (rope) {
      const std::string type = rope->value("rope_type", rope->value("type", std::string("default")));
      DSP_CHECK_AS(ConfigError, type == "default" || type == "yarn",
                   "model config rope type must be default or yarn, got '", type, "'");
      if (type == "yarn") {
        auto number = [&](const char* key, double fallback) {
          return rope->contains(key) && !rope->at(key).is_null() ? rope->at(key).get<double>() : fallback;
        };
        c.rope_scaling.type = "yarn";
        DSP_CHECK_AS(ConfigError, rope->contains("factor"), "model config rope_scaling is missing 'factor'");
        c.rope_scaling.factor = number("factor", 1.0);
        c.rope_scaling.original_max_position_embeddings = static_cast<std::int64_t>(
            number("original_max_position_embeddings", static_cast<double>(c.seq_length)));
        c.rope_scaling.beta_fast = number("beta_fast", 32.0);
        c.rope_scaling.beta_slow = number("beta_slow", 1.0);
        c.rope_scaling.mscale = number("mscale", 0.0);
        c.rope_scaling.mscale_all_dim = number("mscale_all_dim", 0.0);
      }
    }
    if (j.contains("kv_lora_rank") && !j.at("kv_lora_rank").is_null()) {
      c.kv_lora_rank = get("kv_lora_rank").get<std::int64_t>();
      c.q_lora_rank = j.contains("q_lora_rank") && !j.at("q_lora_rank").is_null() ? get("q_lora_rank").get<std::int64_t>() : 0;
      c.qk_nope_head_dim = get("qk_nope_head_dim").get<std::int64_t>();
      c.qk_rope_head_dim = get("qk_rope_head_dim").get<std::int64_t>();
      c.v_head_dim = get("v_head_dim").get<std::int64_t>();
    }
    c.norm_epsilon = get("rms_norm_eps").get<float>();
    c.tie_word_embeddings = get("tie_word_embeddings").get<bool>();
    c.init_method_std = j.value("initializer_range", 0.02f);
    c.num_experts = j.contains("n_routed_experts") && !j.at("n_routed_experts").is_null()
                        ? j.at("n_routed_experts").get<std::int64_t>()
                        : 0;  // absent or null (DeepSeek's dense configs): dense
    if (!c.is_moe()) return c;
    c.moe_router_topk = get("num_experts_per_tok").get<std::int64_t>();
    c.moe_ffn_hidden_size = get("moe_intermediate_size").get<std::int64_t>();
    c.num_shared_experts = j.value("n_shared_experts", std::int64_t{0});
    c.first_k_dense_replace = j.value("first_k_dense_replace", std::int64_t{0});
    const std::string scoring = j.value("scoring_func", std::string("softmax"));
    DSP_CHECK_AS(ConfigError, scoring == "softmax" || scoring == "sigmoid", "model config scoring_func must be softmax or sigmoid, got '", scoring, "'");
    c.moe_router_score_function = scoring == "sigmoid" ? ep::ScoreFunction::Sigmoid : ep::ScoreFunction::Softmax;
    c.moe_router_norm_topk_prob = j.value("norm_topk_prob", false);
    c.moe_router_num_groups = j.value("n_group", std::int64_t{1});
    c.moe_router_group_topk = j.value("topk_group", std::int64_t{1});
    c.moe_router_topk_scaling_factor = j.value("routed_scaling_factor", 1.0f);
    const std::string topk_method = j.value("topk_method", std::string());
    c.moe_router_enable_expert_bias = topk_method == "noaux_tc";
    if (topk_method == "group_limited_greedy") c.moe_router_group_score = backend::GroupScore::Max;
    return c;
  }
  bool operator==(const ModelConfig&) const = default;
};

}  // namespace dsp::model
