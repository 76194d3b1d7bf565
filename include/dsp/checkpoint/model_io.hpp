#pragma once
// Glue between a CausalLM and the model-agnostic checkpoint code: the model's state (its
// parameters' shards and specs), its config in the manifest, and loading it at any TP size.
#include <filesystem>
#include <vector>

#include "dsp/checkpoint/hf_import.hpp"
#include "dsp/checkpoint/load.hpp"
#include "dsp/checkpoint/manifest.hpp"
#include "dsp/checkpoint/state.hpp"
#include "dsp/model/causal_lm.hpp"

namespace dsp::checkpoint {

/// What a parameter state is for: saving leaves out tied copies (Parameter::tied_copy; the
/// owning stage saves the tensor), loading fills them too.
enum class StateUse { Save, Load };

/// The given parameters of this rank as checkpoint entries (the model owns the tensors).
inline State parameter_state(const std::vector<Parameter*>& params, StateUse use) {
  State s;
  for (auto* p : params)
    if (use == StateUse::Load || !p->tied_copy) s.push_back({p->spec, &p->value});
  return s;
}

/// A pipeline stage's (or whole model's) parameters and buffers (MoE expert biases) as
/// checkpoint entries.
template <class Policy>
State stage_state(model::CausalLM<Policy>& stage, StateUse use) {
  return parameter_state(stage.state_parameters(), use);
}

/// Every parameter and buffer of a whole model as checkpoint entries.
template <class Policy>
State model_state(model::CausalLM<Policy>& m) {
  return stage_state(m, StateUse::Save);
}

/// The model config a checkpoint was saved with (files are not verified here; loading does),
/// or a Hugging Face model folder's (is_hugging_face_folder: read_hf_config). Throws
/// CheckpointError as read_manifest (missing or malformed manifest) and ConfigError when the
/// config lacks a field (or as read_hf_config).
inline model::ModelConfig read_model_config(const std::filesystem::path& dir) {
  if (is_hugging_face_folder(dir)) return read_hf_config(dir);
  return model::ModelConfig::from_hf_json(read_manifest(dir).meta.model_config);
}

/// Throws CheckpointError naming the first differing field when the manifest's model config
/// is not `expected` (a field only one side has, e.g. n_routed_experts, counts too).
inline void check_model_config(const std::filesystem::path& dir, const Manifest& m, const model::ModelConfig& expected) {
  const nlohmann::json want = expected.to_hf_json();
  const nlohmann::json& saved = m.meta.model_config;
  const auto field = [](const nlohmann::json& j, const std::string& key) {
    return j.contains(key) ? j.at(key).dump() : std::string("missing");
  };
  for (const auto* side : {&want, &saved})
    for (const auto& [key, value] : side->items())
      DSP_CHECK_AS(CheckpointError, want.contains(key) && saved.contains(key) && saved.at(key) == want.at(key),
                   "checkpoint ", dir.string(), " is of another model config: ", key, " is ", field(saved, key),
                   ", this run uses ", field(want, key));
}

/// Loads the parameters of `m` (any TP size: resharding straight from the manifest);
/// collective-free, every rank reads what it needs (the model files: ReadScope::Model). A
/// Hugging Face model folder (is_hugging_face_folder) is imported (hf_import.hpp: each rank
/// reads its slices); its config must be m's. Throws CheckpointError as load_into and
/// check_model_config. Returns the manifest (for a Hugging Face folder: one with its config at
/// iteration 0).
template <class Policy>
Manifest load_model(const std::filesystem::path& dir, model::CausalLM<Policy>& m) {
  if (is_hugging_face_folder(dir)) {
    const HfFolder folder(dir);
    Manifest manifest;
    manifest.meta.model_config = folder.config().to_hf_json();
    check_model_config(dir, manifest, m.config());
    load_into(folder, model_state(m), m.tensor_group().size(), m.tensor_group().rank());
    return manifest;
  }
  check_model_config(dir, read_manifest(dir), m.config());  // load_into verifies the model files
  return load_into(dir, model_state(m), m.tensor_group().size(), m.tensor_group().rank());
}

}  // namespace dsp::checkpoint
