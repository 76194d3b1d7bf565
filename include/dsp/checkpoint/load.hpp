#pragma once
// Loading a sharded checkpoint, at any tensor-parallel size. Every global tensor is assembled
// from all the shard files (or the partition files holding its parts) with unshard_into (the
// manifest's spec at the saved TP), and a rank's local tensor is shard_of(spec, global, target
// TP, rank): loading at another TP is resharding straight from the manifest. At the saved TP a
// range of a local shard is read on its own (CheckpointReader::read_local), which is how ZeRO
// loads the slice it owns at any data-parallel size. Every file read is verified against the
// manifest's size and CRC-32 before any data is used; loading a model alone (ReadScope::Model)
// does not read the files of optimizer state.
#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <span>
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

/// Which tensors of a checkpoint a CheckpointReader serves. Model: the model's alone (names
/// not starting with optimizer_prefix); the partition files that hold only optimizer state are
/// then neither verified nor opened, so serving a checkpoint reads none of the AdamW moments
/// (twice the model's bytes) and does not depend on their files.
enum class ReadScope { All, Model };

/// A checkpoint directory whose files (those its ReadScope needs) are verified, read one global
/// tensor at a time (memory: one global tensor plus one shard at a time, beyond the file
/// headers).
class CheckpointReader {
 public:
  /// Loads the manifest (read_manifest, which also checks that partition files tile their
  /// tensors), verifies every file the scope needs against the manifest's size and CRC-32
  /// (verify_file) and reads its header. Throws CheckpointError naming the file when a file is
  /// missing, truncated or corrupted or its header is invalid (read_safetensors), a file holds a
  /// tensor the manifest does not list (or a partition file one its record does not, or other
  /// ranges than its metadata), a shard whose shape is not the spec's
  /// local shape at the saved TP, a part whose length is not its range's, or a tensor both
  /// whole and in parts; or naming the tensor when it lacks the shard of some TP rank.
  explicit CheckpointReader(std::filesystem::path dir, ReadScope scope = ReadScope::All)
      : dir_(std::move(dir)), scope_(scope), manifest_(read_manifest(dir_)) {
    const int tp = manifest_.meta.layout.tensor;
    for (const auto& [name, record] : manifest_.files) {
      if (scope_ == ReadScope::Model && record.partition() &&
          std::all_of(record.ranges.begin(), record.ranges.end(), [&](const auto& r) { return !in_scope(r.first); }))
        continue;
      verify_file(dir_, name, record);
      files_.push_back(read_safetensors(dir_ / name));
      const SafetensorsFile& file = files_.back();
      const auto fail = [&](const auto&... what) {
        return CheckpointError(dsp::detail::concat(file.path().string(), ": ", what...));
      };
      for (const SafetensorsEntry& e : file.entries()) {
        const ShardedTensor* spec = manifest_.find(e.name);
        if (!spec) throw fail("holds tensor ", e.name, ", which ", manifest_file_name, " does not list");
        if (!record.partition()) {
          if (e.shape != spec->local_shape(tp))
            throw fail("tensor ", e.name, " has shape ", shape_str(e.shape), ", its spec at TP ", tp, " gives ",
                       shape_str(spec->local_shape(tp)));
          pieces_[e.name].push_back({record.tp_rank, 0, numel(e.shape), files_.size() - 1, false});
          continue;
        }
        const auto range = record.ranges.find(e.name);
        if (range == record.ranges.end()) throw fail("holds tensor ", e.name, ", which its record does not list");
        const auto [begin, end] = range->second;
        if (e.shape != Shape{end - begin})
          throw fail("tensor ", e.name, " has shape ", shape_str(e.shape), ", its range [", begin, ", ", end,
                     ") needs [", end - begin, "]");
        pieces_[e.name].push_back({record.tp_rank, begin, end, files_.size() - 1, true});
      }
      for (const auto& [tensor, range] : record.ranges)
        if (!file.contains(tensor)) throw fail("lacks tensor ", tensor, ", which its record lists");
      if (record.partition()) {
        const auto own = file.metadata().find("ranges");
        if (own == file.metadata().end() || nlohmann::json::parse(own->second, nullptr, false) != nlohmann::json(record.ranges))
          throw fail("its metadata's ranges are not those ", manifest_file_name, " lists for it");
      }
    }
    for (const ShardedTensor& spec : manifest_.tensors) {
      if (!in_scope(spec.name)) continue;
      auto& pieces = pieces_[spec.name];
      std::sort(pieces.begin(), pieces.end());
      const auto in_part = [](const Piece& p) { return p.part; };
      if (std::any_of(pieces.begin(), pieces.end(), in_part)) {  // tiled: check_partitions
        if (!std::all_of(pieces.begin(), pieces.end(), in_part))
          throw CheckpointError(dsp::detail::concat(dir_.string(), ": tensor ", spec.name,
                                                    " is held both whole and in parts"));
        continue;
      }
      const auto same_rank = [](const Piece& a, const Piece& b) { return a.tp_rank == b.tp_rank; };
      // Ranks lie in [0, tp) (read_manifest checks), so tp shards without a repeat cover them all.
      if (pieces.size() != static_cast<std::size_t>(tp) ||
          std::adjacent_find(pieces.begin(), pieces.end(), same_rank) != pieces.end())
        throw CheckpointError(dsp::detail::concat(dir_.string(), ": tensor ", spec.name, " has ", pieces.size(),
                                                  " shard(s), expected one from each of TP ranks 0..", tp - 1));
    }
  }

  /// The manifest (every file the scope needs verified).
  const Manifest& manifest() const { return manifest_; }
  /// The checkpoint directory.
  const std::filesystem::path& dir() const { return dir_; }

  /// Throws CheckpointError unless the checkpoint holds `expected.name` split as `expected`:
  /// "checkpoint <dir> has no tensor(s) X", or "checkpoint <dir> has a different model: tensor
  /// X has shape A, model expects B" (or "is split as ..., model expects ..."); also when the
  /// scope leaves X out (as global_tensor).
  void check_matches(const ShardedTensor& expected) const {
    const ShardedTensor* saved = manifest_.find(expected.name);
    if (!saved)
      throw CheckpointError(dsp::detail::concat("checkpoint ", dir_.string(), " has no tensor(s) ", expected.name));
    find(expected.name);  // throws when the scope leaves it out
    check_same_spec(*saved, expected);
  }

  /// The global tensor `name` (shape spec.global_shape, padding removed), assembled from the
  /// shards (or their parts) of all TP ranks. Throws CheckpointError naming the directory when
  /// the checkpoint has no such tensor or the scope leaves it out, or naming the file when a
  /// shard cannot be read.
  Tensor global_tensor(std::string_view name) const {
    const ShardedTensor& spec = find(name);
    Tensor global = Tensor::host_zeros(spec.global_shape);
    const int tp = manifest_.meta.layout.tensor;
    for (int r = 0; r < tp; ++r) {
      Tensor local = Tensor::host_zeros(spec.local_shape(tp));
      read_saved(name, r, 0, local.span());
      unshard_into(spec, local, tp, r, global);
    }
    return global;
  }

  /// Elements [begin, begin + out.size()) of TP rank tp_rank's shard of tensor `name` at TP
  /// tp_size (shard_of its global tensor), flattened row-major. At the saved TP size it reads
  /// just those elements; at another it assembles the global tensor. Throws as global_tensor,
  /// and CheckpointError when the elements lie outside the shard.
  void read_local(std::string_view name, int tp_size, int tp_rank, std::int64_t begin, std::span<float> out) const {
    const ShardedTensor& spec = find(name);
    const std::int64_t n = numel(spec.local_shape(tp_size));
    DSP_CHECK_AS(CheckpointError, begin >= 0 && begin + static_cast<std::int64_t>(out.size()) <= n, dir_.string(),
                 ": tensor ", name, " has ", n, " elements per shard at TP ", tp_size, ", not [", begin, ", ",
                 begin + static_cast<std::int64_t>(out.size()), ")");
    if (tp_size == manifest_.meta.layout.tensor) return read_saved(name, tp_rank, begin, out);
    const Tensor local = shard_of(spec, global_tensor(name), tp_size, tp_rank);
    std::copy_n(local.data() + begin, out.size(), out.data());
  }

 private:
  // Elements [begin, end) of TP rank tp_rank's saved shard, held by file `file` (from its
  // element 0): the whole shard (a shard file) or a part (a partition file).
  struct Piece {
    int tp_rank;
    std::int64_t begin, end;
    std::size_t file;  // index into files_
    bool part;
    auto operator<=>(const Piece&) const = default;
  };

  void check_same_spec(const ShardedTensor& saved, const ShardedTensor& expected) const {
    const auto differ = [&](const auto&... what) {
      return CheckpointError(dsp::detail::concat("checkpoint ", dir_.string(), " has a different model: tensor ",
                                                 expected.name, what...));
    };
    if (saved.global_shape != expected.global_shape)
      throw differ(" has shape ", shape_str(saved.global_shape), ", model expects ", shape_str(expected.global_shape));
    if (saved != expected)
      throw differ(" is split as ", nlohmann::json(saved).dump(), ", model expects ", nlohmann::json(expected).dump());
  }

  bool in_scope(std::string_view name) const {
    return scope_ == ReadScope::All || !is_optimizer_state(name);
  }

  const ShardedTensor& find(std::string_view name) const {
    const ShardedTensor* spec = manifest_.find(name);
    if (!spec) throw CheckpointError(dsp::detail::concat(dir_.string(), ": no tensor ", name));
    if (!in_scope(name))
      throw CheckpointError(dsp::detail::concat(dir_.string(), ": tensor ", name,
                                                " is optimizer state, and this reader was opened for the model only"));
    return *spec;
  }

  // Elements [begin, begin + out.size()) of the saved shard of TP rank tp_rank, from the pieces
  // that overlap them.
  void read_saved(std::string_view name, int tp_rank, std::int64_t begin, std::span<float> out) const {
    const std::int64_t end = begin + static_cast<std::int64_t>(out.size());
    for (const Piece& p : pieces_.find(name)->second) {
      const std::int64_t from = std::max(begin, p.begin), to = std::min(end, p.end);
      if (p.tp_rank != tp_rank || from >= to) continue;
      files_[p.file].read_elements(name, from - p.begin, out.subspan(static_cast<std::size_t>(from - begin),
                                                                     static_cast<std::size_t>(to - from)));
    }
  }

  std::filesystem::path dir_;
  ReadScope scope_;
  Manifest manifest_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, std::vector<Piece>, std::less<>> pieces_;  // tensor -> its pieces, by TP rank and begin
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
/// shard_of(spec, global tensor from the checkpoint, tp_size, tp_rank) and returns the
/// manifest (iteration, extra, model_config for the trainer). A local tensor in a memory space
/// (device memory) stays there: the values are copied into it. Tensors of the checkpoint that
/// the state lacks are ignored. All checks happen before any local tensor is written. Throws as
/// check_state when the state does not fit (tp_size, tp_rank); CheckpointError when the
/// checkpoint lacks some of the state's tensors (all named), the reader's scope leaves one out,
/// or it was saved from a different model (see CheckpointReader::check_matches).
inline Manifest load_into(const CheckpointReader& reader, const State& state, int tp_size, int tp_rank) {
  check_state(state, tp_size, tp_rank);
  std::string missing;
  for (const ShardEntry& e : state) {
    if (!reader.manifest().find(e.spec.name))
      missing += (missing.empty() ? "" : ", ") + e.spec.name;
    else
      reader.check_matches(e.spec);
  }
  if (!missing.empty())
    throw CheckpointError(dsp::detail::concat("checkpoint ", reader.dir().string(), " has no tensor(s) ", missing));
  for (const ShardEntry& e : state) {
    Tensor local = shard_of(e.spec, reader.global_tensor(e.spec.name), tp_size, tp_rank);
    if (e.local->on_host()) *e.local = std::move(local);
    else e.local->copy_from_host(local.span());  // same shape: check_state checked it
  }
  return reader.manifest();
}

/// load_into from the checkpoint in `dir`, opening only the files the state needs: a state
/// without optimizer state (names starting with optimizer_prefix) reads the checkpoint with
/// ReadScope::Model. Throws as load_into and, for an invalid checkpoint, as CheckpointReader
/// (after check_state).
inline Manifest load_into(const std::filesystem::path& dir, const State& state, int tp_size, int tp_rank) {
  check_state(state, tp_size, tp_rank);
  const bool optimizer =
      std::any_of(state.begin(), state.end(), [](const ShardEntry& e) { return is_optimizer_state(e.spec.name); });
  return load_into(CheckpointReader(dir, optimizer ? ReadScope::All : ReadScope::Model), state, tp_size, tp_rank);
}

}  // namespace dsp::checkpoint
