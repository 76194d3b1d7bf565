#pragma once
// Merging a sharded checkpoint into one Hugging Face model directory:
//   model.safetensors  every non-optimizer tensor, global (padding removed), fp32, metadata
//                      {"format": "pt"}; fused tensors split by rows into their parts
//                      (qkv_proj -> q_proj, k_proj, v_proj; gate_up_proj -> gate_proj, up_proj)
//   config.json        the manifest's model_config (a Hugging Face config, supplied at save),
//                      with transformers 5's "rope_parameters" {"rope_type": "default",
//                      "rope_theta": ...} added beside the "rope_theta" of transformers 4 when
//                      it has none (hugging_face_config)
//   tokenizer.json, tokenizer_config.json
//                      a byte-level model's tokenizer (vocab_size 256 or 257: byte b is id b,
//                      the EOD 256; byte_tokenizer_json.hpp); other models get none
// Tensors are written in global model order (global_model_order): the embedding, layers
// 0..L-1 by number (layers.10 after layers.9), then the final norm and the output layer,
// whatever pipeline layout (interleaved stages included) the checkpoint was saved at.
#include <algorithm>
#include <charconv>
#include <compare>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/checkpoint/atomic_dir.hpp"
#include "dsp/checkpoint/byte_tokenizer_json.hpp"
#include "dsp/checkpoint/file_io.hpp"
#include "dsp/checkpoint/load.hpp"
#include "dsp/checkpoint/safetensors.hpp"
#include "dsp/checkpoint/state.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/tensor.hpp"
#include "dsp/parallel/sharded_tensor.hpp"

namespace dsp::checkpoint {

/// Name of the merged weights file.
inline constexpr std::string_view merged_model_file = "model.safetensors";
/// Name of the merged config file.
inline constexpr std::string_view merged_config_file = "config.json";

namespace detail {

// Sort key of a parameter name in global model order: group 0 the embedding
// ("model.embed_tokens.*"), group 1 the decoder layers ("model.layers.<i>.*", by i), group 2
// everything else (final norm, output layer).
struct ModelOrderKey {
  int group = 2;
  std::int64_t layer = 0;
  auto operator<=>(const ModelOrderKey&) const = default;
};

inline ModelOrderKey model_order_key(std::string_view name) {
  constexpr std::string_view embed = "model.embed_tokens.", layers = "model.layers.";
  if (name.starts_with(embed)) return {0, 0};
  if (!name.starts_with(layers)) return {};
  name.remove_prefix(layers.size());
  std::int64_t layer = 0;
  const auto [end, err] = std::from_chars(name.data(), name.data() + name.size(), layer);
  if (err != std::errc() || end == name.data() || end == name.data() + name.size() || *end != '.') return {};
  return {1, layer};
}

}  // namespace detail

/// `specs` in global model order: parameters first, then optimizer tensors
/// ("optimizer.<moment>.<parameter>"); within each, the embedding, then the decoder layers by
/// their global number (numerically: layers.10 after layers.9), then the rest (final norm,
/// output layer), an optimizer tensor placed by its parameter's name. Ties keep their relative
/// order (a layer's tensors stay in the order the model lists them). A pipeline-parallel
/// checkpoint's manifest lists tensors stage by stage, each stage's parameters then its
/// optimizer state (with interleaving, PP 2: layers 0, 2, then 1, 3); this is the order the
/// same model saved on one stage lists them in.
inline std::vector<ShardedTensor> global_model_order(std::vector<ShardedTensor> specs) {
  const auto key = [](std::string_view name) {
    const bool optimizer = is_optimizer_state(name);
    if (optimizer) {  // "optimizer.<moment>.<parameter>": placed by the parameter
      name.remove_prefix(optimizer_prefix.size());
      name.remove_prefix(std::min(name.size(), name.find('.') + 1));
    }
    return std::pair{optimizer, detail::model_order_key(name)};
  };
  std::vector<std::pair<std::pair<bool, detail::ModelOrderKey>, std::size_t>> keys;
  keys.reserve(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) keys.emplace_back(key(specs[i].name), i);
  std::stable_sort(keys.begin(), keys.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<ShardedTensor> out;
  out.reserve(specs.size());
  for (const auto& k : keys) out.push_back(std::move(specs[k.second]));
  return out;
}

/// The Hugging Face tensors of one global tensor: (part name, rows) pieces in order when the
/// spec lists parts, else the tensor itself under the spec's name. Throws CheckpointError
/// naming the tensor when its parts' rows do not add up to its first dimension.
inline std::vector<std::pair<std::string, Tensor>> hugging_face_tensors(const ShardedTensor& spec, Tensor global) {
  std::vector<std::pair<std::string, Tensor>> out;
  if (spec.parts.empty()) {
    out.emplace_back(spec.name, std::move(global));
    return out;
  }
  std::int64_t rows = 0;
  for (const TensorPart& p : spec.parts) rows += p.rows;
  DSP_CHECK_AS(CheckpointError, !global.shape().empty() && rows == global.dim(0), "tensor ", spec.name,
               ": parts have ", rows, " rows in all, the tensor has shape ", shape_str(global.shape()));
  const std::int64_t row_size = global.dim(0) == 0 ? 0 : global.numel() / global.dim(0);
  std::int64_t first_row = 0;
  for (const TensorPart& p : spec.parts) {
    Shape shape = global.shape();
    shape[0] = p.rows;
    Tensor part(std::move(shape));
    std::copy_n(global.data() + first_row * row_size, p.rows * row_size, part.data());
    first_row += p.rows;
    out.emplace_back(p.name, std::move(part));
  }
  return out;
}

/// The config.json merge writes for a checkpoint's model_config: `config` with, when it has a
/// "rope_theta" and no "rope_parameters", transformers 5's {"rope_type": "default",
/// "rope_theta": <the same>} added (LlamaConfig reads both spellings; 5.x writes the second), and
/// for MLA num_key_value_heads = num_attention_heads (dsp's MLA has no query groups).
/// Throws CheckpointError naming `dir` for a mixture-of-experts model no transformers class
/// computes ("architectures" DspMoeForCausalLM: GQA attention, or a router unlike DeepSeek-V2's
/// and V3's; ModelConfig::to_hf_json), so a merged folder would load nowhere.
inline nlohmann::json hugging_face_config(const std::filesystem::path& dir, nlohmann::json config) {
  const bool gqa_moe = config.contains("architectures") && config.at("architectures") == nlohmann::json::array({"DspMoeForCausalLM"});
  DSP_CHECK_AS(CheckpointError, !gqa_moe, "checkpoint ", dir.string(),
               " holds a mixture-of-experts model (DspMoeForCausalLM: GQA attention, or a router unlike DeepSeek-V2/V3's) ",
               "which no transformers class computes (DeepseekV2/V3ForCausalLM take MLA attention and their own routers): ",
               "--merge would write a Hugging Face folder ",
               "nothing loads; serve it with dsp-generate / dsp-serve, or reshard it with dsp-reshard");
  // MLA: one key/value head per query head in transformers' DeepseekV2/V3Attention (its
  // repeat_kv would otherwise multiply heads that are already all there)
  if (config.contains("kv_lora_rank") && config.at("kv_lora_rank").is_number_integer() &&
      config.at("kv_lora_rank").get<std::int64_t>() > 0 && config.contains("num_attention_heads"))
    config["num_key_value_heads"] = config.at("num_attention_heads");
  if (config.contains("rope_theta") && !config.contains("rope_parameters"))
    config["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", config.at("rope_theta")}};
  return config;
}

/// Writes the checkpoint in `dir` (its model files verified first) to `out_dir` as
/// model.safetensors + config.json (+ tokenizer.json and tokenizer_config.json when the model
/// config's vocab_size is byte-level, is_byte_level_vocab), atomically (an existing `out_dir` is replaced only on
/// success), the tensors in global_model_order whatever layout the checkpoint was saved at (any
/// TP and PP), then what an import kept aside (manifest extra "kept_aside": DeepSeek-V3's MTP
/// layers, with num_nextn_predict_layers in config.json). Tensors whose name starts with
/// optimizer_prefix are left out (ReadScope::Model:
/// their partition files are not read). Memory: every parameter's global tensor. Throws
/// CheckpointError when the checkpoint is invalid (see CheckpointReader), is of a model no
/// transformers class computes (hugging_face_config), a fused tensor's parts do not fit, two
/// tensors end up with the same name, or writing fails.
inline void merge(const std::filesystem::path& dir, const std::filesystem::path& out_dir) {
  const CheckpointReader reader(dir, ReadScope::Model);
  nlohmann::json config = hugging_face_config(dir, reader.manifest().meta.model_config);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const ShardedTensor& spec : global_model_order(reader.manifest().tensors)) {
    if (is_optimizer_state(spec.name)) continue;
    for (auto& piece : hugging_face_tensors(spec, reader.global_tensor(spec.name)))
      tensors.push_back(std::move(piece));
  }
  // What an import kept aside (hf_convert.hpp: the MTP layers), written back as it was.
  const nlohmann::json& extra = reader.manifest().meta.extra;
  if (extra.contains("kept_aside")) {
    const auto& kept = extra.at("kept_aside");
    const SafetensorsFile file = read_safetensors(dir / kept.at("file").get<std::string>());
    for (const auto& e : file.entries()) tensors.emplace_back(e.name, file.tensor(e.name));
    config["num_nextn_predict_layers"] = kept.at("num_nextn_predict_layers");
  }
  std::vector<std::pair<std::string, const Tensor*>> refs;
  for (const auto& [name, t] : tensors) refs.emplace_back(name, &t);

  AtomicDir staging(out_dir);
  write_safetensors(staging.tmp_path() / merged_model_file, refs, {{"format", "pt"}});
  write_text(staging.tmp_path() / merged_config_file, config.dump(2) + "\n");
  const auto number = [&](const char* key) {
    return config.contains(key) && config.at(key).is_number_integer() ? config.at(key).get<std::int64_t>() : 0;
  };
  if (const std::int64_t vocab = number("vocab_size"); is_byte_level_vocab(vocab)) {
    write_text(staging.tmp_path() / merged_tokenizer_file, byte_tokenizer_json(vocab).dump(2) + "\n");
    const std::int64_t seq = number("max_position_embeddings");
    write_text(staging.tmp_path() / merged_tokenizer_config_file,
               byte_tokenizer_config_json(vocab, seq > 0 ? seq : 1 << 20).dump(2) + "\n");
  }
  staging.commit();
}

}  // namespace dsp::checkpoint
