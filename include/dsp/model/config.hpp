#pragma once
// ModelConfig: the decoder's hyper-parameters, with Megatron names in C++ and Hugging Face
// names in config.json.
#include <cstdint>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "dsp/core/divide.hpp"
#include "dsp/core/error.hpp"

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

  std::int64_t head_dim() const { return hidden_size / num_attention_heads; }

  /// Throws ConfigError naming both numbers when a size does not divide (or is not positive).
  void validate(int tensor_parallel) const {
    for (auto [name, value] : {std::pair{"vocab size", vocab_size}, {"hidden size", hidden_size},
                               {"number of layers", num_layers}, {"ffn hidden size", ffn_hidden_size},
                               {"sequence length", seq_length}, {"number of attention heads", num_attention_heads},
                               {"number of query groups", num_query_groups}})
      DSP_CHECK_AS(ConfigError, value > 0, name, " must be positive, got ", value);
    divide(hidden_size, num_attention_heads, "hidden size");
    DSP_CHECK_AS(ConfigError, head_dim() % 2 == 0, "head dim (", head_dim(), ") must be even for RoPE");
    divide(num_attention_heads, num_query_groups, "number of attention heads");
    divide(hidden_size, tensor_parallel, "hidden size");
    divide(num_attention_heads, tensor_parallel, "number of attention heads");
    DSP_CHECK_AS(ConfigError, num_query_groups % tensor_parallel == 0 || tensor_parallel % num_query_groups == 0,
                 "number of query groups (", num_query_groups, ") and tensor-model-parallel-size (", tensor_parallel,
                 ") must divide one another");
    divide(ffn_hidden_size, tensor_parallel, "ffn hidden size");
  }

  /// Parameters of the global model (embedding counted once when tied).
  std::int64_t num_parameters() const {
    const std::int64_t h = hidden_size, d = head_dim();
    const std::int64_t attn = h * (num_attention_heads + 2 * num_query_groups) * d + num_attention_heads * d * h;
    const std::int64_t mlp = 3 * h * ffn_hidden_size;
    const std::int64_t per_layer = attn + mlp + 2 * h;
    return vocab_size * h * (tie_word_embeddings ? 1 : 2) + num_layers * per_layer + h;
  }

  /// Hugging Face config.json (Llama architecture: the dense DeepSeek-style block with GQA).
  nlohmann::json to_hf_json() const {
    return {{"architectures", {"LlamaForCausalLM"}},
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
    c.rope_theta = get("rope_theta").get<float>();
    c.norm_epsilon = get("rms_norm_eps").get<float>();
    c.tie_word_embeddings = get("tie_word_embeddings").get<bool>();
    c.init_method_std = j.value("initializer_range", 0.02f);
    return c;
  }
  bool operator==(const ModelConfig&) const = default;
};

}  // namespace dsp::model
