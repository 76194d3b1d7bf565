#pragma once
// Writing a Hugging Face model folder as a dsp checkpoint at a tensor-parallel size (what
// `dsp-reshard --load HF_DIR --save CKPT --tensor-model-parallel-size T` does): every rank builds
// its shards of the model the folder's config.json describes, fills them from the folder (each
// rank reading only its slices, hf_import.hpp) and writes its shard file; the result is a
// checkpoint like one dsp-reshard --no-save-optim writes (pipeline 1, no optimizer state,
// iteration 0), which training (at any TP and PP), serving, reshard and merge read.
// Tensors of layers past num_hidden_layers (DeepSeek-V3's multi-token-prediction layer, which
// dsp does not train) are kept aside, not dropped: copied as fp32 into `mtp.safetensors` beside
// the shards (manifest extra "kept_aside"), which dsp-reshard --merge of this checkpoint writes
// back. (A checkpoint that training or reshard saves later does not carry the file.)
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dsp/backend/host.hpp"
#include "dsp/checkpoint/atomic_dir.hpp"
#include "dsp/checkpoint/hf_import.hpp"
#include "dsp/checkpoint/safetensors.hpp"
#include "dsp/checkpoint/model_io.hpp"
#include "dsp/checkpoint/save.hpp"
#include "dsp/comm/communicator.hpp"
#include "dsp/model/causal_lm.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/policy.hpp"

namespace dsp::checkpoint {

/// The file of an imported checkpoint holding the tensors import kept aside (hf_convert.hpp).
inline constexpr std::string_view kept_aside_file = "mtp.safetensors";

/// Writes the Hugging Face model folder `hf_dir` to `out_dir` (atomically: an existing one is
/// replaced only on success) as a dsp checkpoint at TP world.size(), PP 1, DP 1: manifest
/// model_config the folder's model (ModelConfig::to_hf_json), extra {"imported_from": hf_dir},
/// and, when the folder has tensors of layers >= num_hidden_layers, those in
/// `kept_aside_file` and extra "kept_aside" {"file", "tensors", "num_nextn_predict_layers"}.
/// Collective over `world` (every rank one TP rank, global rank 0 writing the manifest).
/// Memory: each rank its shards. Throws ConfigError when the model does not split world.size()
/// ways or as read_hf_config, and CheckpointError naming the file and tensor as
/// load_into(HfFolder) or when writing fails.
template <comm::Communicator Comm>
void import_hugging_face(const std::filesystem::path& hf_dir, const std::filesystem::path& out_dir, Comm& world) {
  using P = Policy<backend::Host, Comm>;
  const model::ModelConfig config = read_hf_config(hf_dir);
  DeviceMesh<Comm> mesh(world, ParallelLayout{.tensor = world.size()});
  const InferenceMode inference;  // values only: no gradient buffers
  model::CausalLM<P> model(config, mesh, /*seed=*/0);  // its random values are all overwritten
  load_model(hf_dir, model);
  std::optional<AtomicDir> staging;
  std::string tmp;
  if (world.rank() == 0) {
    staging.emplace(out_dir);
    tmp = staging->tmp_path().string();
  }
  std::vector<std::int64_t> length{static_cast<std::int64_t>(tmp.size())};
  world.broadcast(std::span(length), 0);
  tmp.resize(static_cast<std::size_t>(length[0]));
  world.broadcast(std::span(tmp.data(), tmp.size()), 0);
  write_shard_file(tmp, model_state(model), world.size(), world.rank(), 0);
  world.barrier();
  if (world.rank() == 0) {
    CheckpointMeta meta;
    meta.model_config = config.to_hf_json();
    meta.layout = {.tensor = world.size(), .pipeline = 1, .data = 1, .expert = 1};
    meta.extra = {{"imported_from", std::filesystem::absolute(hf_dir).lexically_normal().string()}};
    const HfFolder folder(hf_dir);
    if (const auto names = folder.tensors_from_layer(config.num_layers); !names.empty()) {
      std::vector<Tensor> kept;
      std::vector<std::pair<std::string, const Tensor*>> refs;
      for (const auto& name : names) kept.push_back(folder.tensor(name));
      for (std::size_t i = 0; i < names.size(); ++i) refs.emplace_back(names[i], &kept[i]);
      write_safetensors(staging->tmp_path() / kept_aside_file, refs, {{"format", "pt"}});
      const nlohmann::json raw = nlohmann::json::parse(read_text(hf_dir / hf_config_file), nullptr, false);
      meta.extra["kept_aside"] = {{"file", std::string(kept_aside_file)},
                                  {"tensors", names.size()},
                                  {"num_nextn_predict_layers", raw.value("num_nextn_predict_layers", 0)}};
    }
    write_manifest_and_commit(*staging, meta);
  }
  world.barrier();  // nobody reads out_dir before it is complete
}

}  // namespace dsp::checkpoint
