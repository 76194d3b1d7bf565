#pragma once
// Loading a sharded checkpoint, at any tensor-parallel size. Every global tensor is assembled
// from all the shard files with unshard_into (the manifest's spec at the saved TP), and a
// rank's local tensor is shard_of(spec, global, target TP, rank): loading at another TP is
// resharding straight from the manifest. Every file is verified against the manifest's size
// and CRC-32 before any data is used.
#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/checkpoint/manifest.hpp"
#include "dsp/checkpoint/safetensors.hpp"
#include "dsp/checkpoint/state.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/tensor.hpp"
#include "dsp/parallel/sharded_tensor.hpp"

namespace dsp::checkpoint {

/// A verified checkpoint directory, read one global tensor at a time (memory: one global
/// tensor plus one shard at a time, beyond the file headers).
class CheckpointReader {
 public:
  /// Loads and verifies the manifest (load_manifest) and reads every shard file's header.
  /// Throws CheckpointError naming the file when a header is invalid (read_safetensors), a file
  /// holds a tensor the manifest does not list or a shard whose shape is not the spec's local
  /// shape at the saved TP, or a listed tensor lacks the shard of some TP rank.
  explicit CheckpointReader(std::filesystem::path dir) : dir_(std::move(dir)), manifest_(load_manifest(dir_)) {
    const int tp = manifest_.meta.layout.tensor;
    for (const auto& [name, record] : manifest_.files) {
      files_.push_back(read_safetensors(dir_ / name));
      const SafetensorsFile& file = files_.back();
      for (const SafetensorsEntry& e : file.entries()) {
        const ShardedTensor* spec = manifest_.find(e.name);
        if (!spec)
          throw CheckpointError(dsp::detail::concat(file.path().string(), ": holds tensor ", e.name, ", which ",
                                                    manifest_file_name, " does not list"));
        if (e.shape != spec->local_shape(tp))
          throw CheckpointError(dsp::detail::concat(file.path().string(), ": tensor ", e.name, " has shape ",
                                                    shape_str(e.shape), ", its spec at TP ", tp, " gives ",
                                                    shape_str(spec->local_shape(tp))));
        shards_[e.name].push_back({record.tp_rank, files_.size() - 1});
      }
    }
    for (const ShardedTensor& spec : manifest_.tensors) {
      // Ranks lie in [0, tp) (read_manifest checks), so tp shards without a repeat cover them all.
      auto& shards = shards_[spec.name];
      std::sort(shards.begin(), shards.end(),
                [](const Shard& a, const Shard& b) { return a.tp_rank < b.tp_rank; });
      const auto same_rank = [](const Shard& a, const Shard& b) { return a.tp_rank == b.tp_rank; };
      if (shards.size() != static_cast<std::size_t>(tp) ||
          std::adjacent_find(shards.begin(), shards.end(), same_rank) != shards.end())
        throw CheckpointError(dsp::detail::concat(dir_.string(), ": tensor ", spec.name, " has ", shards.size(),
                                                  " shard(s), expected one from each of TP ranks 0..", tp - 1));
    }
  }

  /// The verified manifest.
  const Manifest& manifest() const { return manifest_; }

  /// The global tensor `name` (shape spec.global_shape, padding removed), assembled from the
  /// shards of all TP ranks. Throws CheckpointError naming the directory when the checkpoint
  /// has no such tensor, or naming the file when a shard cannot be read.
  Tensor global_tensor(std::string_view name) const {
    const ShardedTensor* spec = manifest_.find(name);
    if (!spec) throw CheckpointError(dsp::detail::concat(dir_.string(), ": no tensor ", name));
    Tensor global(spec->global_shape);
    for (const Shard& s : shards_.at(spec->name))
      unshard_into(*spec, files_[s.file].tensor(name), manifest_.meta.layout.tensor, s.tp_rank, global);
    return global;
  }

 private:
  struct Shard {
    int tp_rank;
    std::size_t file;  // index into files_
  };
  std::filesystem::path dir_;
  Manifest manifest_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, std::vector<Shard>, std::less<>> shards_;  // tensor -> its shards, by TP rank
};

/// A whole checkpoint in memory: the verified manifest and every tensor's global value.
struct GlobalCheckpoint {
  Manifest manifest;
  std::map<std::string, Tensor> tensors;  ///< spec name -> global tensor (shape spec.global_shape)
};

/// Reads every tensor of the checkpoint in `dir` as a global tensor (memory: the whole model).
/// Throws CheckpointError as CheckpointReader.
inline GlobalCheckpoint load_global(const std::filesystem::path& dir) {
  const CheckpointReader reader(dir);
  GlobalCheckpoint out{reader.manifest(), {}};
  for (const ShardedTensor& spec : out.manifest.tensors)
    out.tensors.emplace(spec.name, reader.global_tensor(spec.name));
  return out;
}

/// Fills every local tensor of `state` (rank tp_rank of tp_size, any TP the specs allow) with
/// shard_of(spec, global tensor from `dir`, tp_size, tp_rank) and returns the verified manifest
/// (iteration, extra, model_config for the trainer). Tensors of the checkpoint that the state
/// lacks are ignored. All checks happen before any local tensor is written. Throws as
/// check_state when the state does not fit (tp_size, tp_rank); CheckpointError when the
/// checkpoint is invalid (see CheckpointReader), lacks some of the state's tensors (all
/// named), or was saved from a different model: "checkpoint <dir> has a different model:
/// tensor X has shape A, model expects B" (or "is split as ..., model expects ...").
inline Manifest load_into(const std::filesystem::path& dir, const State& state, int tp_size, int tp_rank) {
  check_state(state, tp_size, tp_rank);
  const CheckpointReader reader(dir);
  std::string missing;
  for (const ShardEntry& e : state) {
    const ShardedTensor* saved = reader.manifest().find(e.spec.name);
    if (!saved) {
      missing += (missing.empty() ? "" : ", ") + e.spec.name;
      continue;
    }
    const auto differ = [&](const auto&... what) {
      return CheckpointError(dsp::detail::concat("checkpoint ", dir.string(), " has a different model: tensor ",
                                                 e.spec.name, what...));
    };
    if (saved->global_shape != e.spec.global_shape)
      throw differ(" has shape ", shape_str(saved->global_shape), ", model expects ",
                   shape_str(e.spec.global_shape));
    if (*saved != e.spec)
      throw differ(" is split as ", nlohmann::json(*saved).dump(), ", model expects ",
                   nlohmann::json(e.spec).dump());
  }
  if (!missing.empty())
    throw CheckpointError(dsp::detail::concat("checkpoint ", dir.string(), " has no tensor(s) ", missing));
  for (const ShardEntry& e : state)
    *e.local = shard_of(e.spec, reader.global_tensor(e.spec.name), tp_size, tp_rank);
  return reader.manifest();
}

}  // namespace dsp::checkpoint
