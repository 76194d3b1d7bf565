#pragma once
// Saving a sharded checkpoint. A checkpoint directory holds one safetensors file per
// (TP rank, PP stage), `model_tp{tp:02}_pp{pp:03}.safetensors`, with that rank's local shards
// under their global spec names (shapes spec.local_shape(TP)), plus manifest.json. It may also
// hold partition files, `optim_tp{tp:02}_pp{pp:03}_dp{dp:03}.safetensors`, each written by one
// data-parallel rank with the elements of TP-local shards it owns (ZeRO's partitioned
// optimizer state; see manifest.hpp), so that no rank has to gather a whole tensor to save it.
//
// Saving is two-phase so that ranks (threads or processes) write in parallel:
//
//   std::optional<AtomicDir> staging;                       // on one rank (say global rank 0)
//   if (rank == 0) staging.emplace(dir);                    // creates <dir>.tmp-<random>
//   broadcast staging->tmp_path() to the other ranks;
//   if (dp_rank == 0) write_shard_file(tmp, state, tp_size, tp_rank, pp_rank);   // phase 1
//   write_partition_file(tmp, partition, tp_size, tp_rank, pp_rank, dp_rank);     // optional
//   barrier;
//   if (rank == 0) write_manifest_and_commit(*staging, meta);                    // phase 2
//
// Phase 1 leaves a small `<shard file>.info.json` next to each shard file (its size, CRC-32,
// ranks and specs); phase 2 gathers them from the directory, so the phases need no
// communication beyond the barrier and the directory name. Only one data-parallel replica
// writes (every replica holds the same shards). If any rank throws, the committing rank's
// AtomicDir removes the temporary directory and the previous checkpoint stays in place.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/checkpoint/atomic_dir.hpp"
#include "dsp/checkpoint/file_io.hpp"
#include "dsp/checkpoint/manifest.hpp"
#include "dsp/checkpoint/safetensors.hpp"
#include "dsp/checkpoint/state.hpp"
#include "dsp/core/error.hpp"
#include "dsp/parallel/layout.hpp"

namespace dsp::checkpoint {

/// "model_tp{tp_rank:02}_pp{pp_rank:03}.safetensors".
inline std::string shard_file_name(int tp_rank, int pp_rank) {
  char name[64];
  std::snprintf(name, sizeof name, "model_tp%02d_pp%03d.safetensors", tp_rank, pp_rank);
  return name;
}

/// "optim_tp{tp_rank:02}_pp{pp_rank:03}_dp{dp_rank:03}.safetensors".
inline std::string partition_file_name(int tp_rank, int pp_rank, int dp_rank) {
  char name[64];
  std::snprintf(name, sizeof name, "optim_tp%02d_pp%03d_dp%03d.safetensors", tp_rank, pp_rank, dp_rank);
  return name;
}

/// What phase 1 wrote: one shard or partition file, its record for the manifest, the TP size it was split
/// for and the specs of the tensors it holds (in state order).
struct ShardFileInfo {
  std::string file;  ///< name inside the checkpoint directory
  FileRecord record;
  int tp_size = 1;
  std::vector<ShardedTensor> tensors;
};

/// {"file", "record" (FileRecord JSON), "tp_size", "tensors" (ShardedTensor JSON)}: the
/// `.info.json` record of phase 1.
inline void to_json(nlohmann::json& j, const ShardFileInfo& s) {
  j = {{"file", s.file}, {"record", s.record}, {"tp_size", s.tp_size}, {"tensors", s.tensors}};
}
/// Inverse of to_json(ShardFileInfo); throws nlohmann::json exceptions or std::invalid_argument
/// on malformed input.
inline void from_json(const nlohmann::json& j, ShardFileInfo& s) {
  s.file = j.at("file").get<std::string>();
  s.record = j.at("record").get<FileRecord>();
  s.tp_size = j.at("tp_size").get<int>();
  s.tensors = j.at("tensors").get<std::vector<ShardedTensor>>();
}

namespace detail {
// Suffix of the phase-1 record written next to each shard file.
inline constexpr std::string_view shard_info_suffix = ".info.json";

// Completes the record of a file just written and writes it as `<file>.info.json`.
inline ShardFileInfo record_written(const std::filesystem::path& tmp_dir, ShardFileInfo info, const FileDigest& digest,
                                    int tp_rank, int pp_rank) {
  info.record.size = digest.size;
  info.record.crc32 = digest.crc32;
  info.record.tp_rank = tp_rank;
  info.record.pp_rank = pp_rank;
  write_text(tmp_dir / (info.file + std::string(shard_info_suffix)), nlohmann::json(info).dump());
  return info;
}
}  // namespace detail

/// Phase 1, on each (TP rank, PP stage) of one data-parallel replica: writes the local shards of
/// `state` to `tmp_dir`/shard_file_name(tp_rank, pp_rank) (fp32 safetensors whose metadata holds
/// "tp_rank", "tp_size", "pp_rank") and its `.info.json` record; returns the record. Throws as
/// check_state when the state does not fit (tp_size, tp_rank), ConfigError when pp_rank < 0,
/// CheckpointError naming the file when writing fails.
inline ShardFileInfo write_shard_file(const std::filesystem::path& tmp_dir, const State& state, int tp_size,
                                      int tp_rank, int pp_rank) {
  check_state(state, tp_size, tp_rank);
  DSP_CHECK_AS(ConfigError, pp_rank >= 0, "pipeline rank must be >= 0, got ", pp_rank);
  ShardFileInfo info{shard_file_name(tp_rank, pp_rank), {}, tp_size, {}};
  std::vector<std::pair<std::string, const Tensor*>> tensors;
  for (const ShardEntry& e : state) {
    tensors.emplace_back(e.spec.name, e.local);
    info.tensors.push_back(e.spec);
  }
  const FileDigest digest = write_safetensors(tmp_dir / info.file, tensors,
                                              {{"tp_rank", std::to_string(tp_rank)},
                                               {"tp_size", std::to_string(tp_size)},
                                               {"pp_rank", std::to_string(pp_rank)}});
  return detail::record_written(tmp_dir, std::move(info), digest, tp_rank, pp_rank);
}

/// Phase 1, optional, on any rank: writes `partition` to `tmp_dir`/partition_file_name(tp_rank,
/// pp_rank, dp_rank), each entry as a 1-D fp32 tensor under its spec's name (the metadata holds
/// the ranks and, as JSON, the ranges: the file describes itself, and loading checks the
/// manifest against it), and its `.info.json` record; returns the record. Throws ConfigError
/// when a rank is negative or tp_rank >= tp_size, Error naming the tensor when an entry is
/// empty, repeats a name or lies outside spec.local_shape(tp_size), CheckpointError naming the
/// file when writing fails.
inline ShardFileInfo write_partition_file(const std::filesystem::path& tmp_dir, const Partition& partition,
                                          int tp_size, int tp_rank, int pp_rank, int dp_rank) {
  DSP_CHECK_AS(ConfigError, tp_size >= 1 && tp_rank >= 0 && tp_rank < tp_size && pp_rank >= 0 && dp_rank >= 0,
               "partition file of TP rank ", tp_rank, " of ", tp_size, ", PP rank ", pp_rank, ", DP rank ", dp_rank);
  ShardFileInfo info{partition_file_name(tp_rank, pp_rank, dp_rank), {}, tp_size, {}};
  info.record.dp_rank = dp_rank;
  std::vector<TensorRef> tensors;
  for (const PartitionEntry& e : partition) {
    const auto n = static_cast<std::int64_t>(e.values.size());
    const std::int64_t local = numel(e.spec.local_shape(tp_size));
    DSP_CHECK(n > 0 && e.begin >= 0 && e.begin + n <= local, "partition: elements [", e.begin, ", ", e.begin + n,
              ") of ", e.spec.name, ", whose shard at TP ", tp_size, " has ", local);
    DSP_CHECK(info.record.ranges.emplace(e.spec.name, ElementRange{e.begin, e.begin + n}).second, "partition: ",
              e.spec.name, " appears twice");
    tensors.push_back({e.spec.name, {n}, e.values});
    info.tensors.push_back(e.spec);
  }
  const FileDigest digest = write_safetensors(tmp_dir / info.file, tensors,
                                              {{"tp_rank", std::to_string(tp_rank)},
                                               {"tp_size", std::to_string(tp_size)},
                                               {"pp_rank", std::to_string(pp_rank)},
                                               {"dp_rank", std::to_string(dp_rank)},
                                               {"ranges", nlohmann::json(info.record.ranges).dump()}});
  return detail::record_written(tmp_dir, std::move(info), digest, tp_rank, pp_rank);
}

/// Phase 2, on one rank after every rank finished phase 1: reads the `.info.json` records in
/// staging.tmp_path(), checks there is exactly one shard file per (TP rank, PP stage) of
/// meta.layout, all written for TP = meta.layout.tensor, that the TP ranks of a stage hold the
/// same tensors and no tensor is in two stages; that partition files hold no tensor of a shard
/// file, give every tensor they share the same spec, and tile each (check_partitions); removes
/// the records, writes manifest.json (tensors in stage order, then state order, then the
/// partition files' tensors) and commits the directory. Throws CheckpointError
/// naming the directory or record when a check fails, ConfigError when a size of meta.layout
/// is < 1 (the AtomicDir then removes the temporary directory when destroyed).
inline void write_manifest_and_commit(AtomicDir& staging, const CheckpointMeta& meta) {
  const std::filesystem::path& tmp = staging.tmp_path();
  const auto fail = [&](const auto&... what) {
    return CheckpointError(dsp::detail::concat(tmp.string(), ": ", what...));
  };
  const ParallelLayout& l = meta.layout;
  DSP_CHECK_AS(ConfigError, l.tensor >= 1 && l.pipeline >= 1 && l.data >= 1 && l.expert >= 1,
               "checkpoint layout ", l.str(), " must have every size >= 1 (resolve it for the world size first)");
  const int tp = l.tensor, pp = l.pipeline;
  std::map<std::pair<int, int>, ShardFileInfo> by_rank;  // (pp_rank, tp_rank) -> record
  std::map<std::string, ShardFileInfo> partitions;       // partition file name -> record
  std::vector<std::filesystem::path> records;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(tmp, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.ends_with(detail::shard_info_suffix)) continue;
    const std::string text = read_text(it->path());
    ShardFileInfo info;
    try {
      info = nlohmann::json::parse(text).get<ShardFileInfo>();
    } catch (const std::exception& e) {
      throw fail(name, ": malformed shard record: ", e.what());
    }
    const FileRecord& r = info.record;
    if (info.tp_size != tp || r.tp_rank < 0 || r.tp_rank >= tp || r.pp_rank < 0 || r.pp_rank >= pp ||
        r.dp_rank >= l.data)
      throw fail(info.file, " was written as TP rank ", r.tp_rank, " of ", info.tp_size, ", PP rank ", r.pp_rank,
                 r.partition() ? dsp::detail::concat(", DP rank ", r.dp_rank) : std::string(),
                 ", outside the checkpoint layout ", meta.layout.str());
    if (r.partition())
      partitions[info.file] = std::move(info);
    else
      by_rank[{r.pp_rank, r.tp_rank}] = std::move(info);
    records.push_back(it->path());
  }
  if (ec) throw fail("cannot list: ", ec.message());

  Manifest m{meta, {}, {}};
  for (int p = 0; p < pp; ++p) {
    for (int t = 0; t < tp; ++t) {
      const auto it = by_rank.find({p, t});
      if (it == by_rank.end())
        throw fail("no ", shard_file_name(t, p), ": ", by_rank.size(), " of ", tp * pp, " shard files (TP ", tp,
                   " x PP ", pp, ") were written");
      const ShardFileInfo& info = it->second;
      if (t == 0) {
        for (const ShardedTensor& spec : info.tensors) {
          if (m.find(spec.name)) throw fail("tensor ", spec.name, " is saved by more than one pipeline stage");
          m.tensors.push_back(spec);
        }
      } else if (info.tensors != by_rank.at({p, 0}).tensors) {
        throw fail(info.file, " holds other tensors than ", shard_file_name(0, p));
      }
      m.files[info.file] = info.record;
    }
  }
  const std::size_t whole = m.tensors.size();  // tensors of the shard files come first
  for (const auto& [file, info] : partitions) {
    for (const ShardedTensor& spec : info.tensors) {
      const auto* known = m.find(spec.name);
      if (known && known - m.tensors.data() < static_cast<std::ptrdiff_t>(whole))
        throw fail(file, " holds part of ", spec.name, ", which a shard file holds whole");
      if (known && *known != spec) throw fail(file, " gives ", spec.name, " another spec than an earlier partition file");
      if (!known) m.tensors.push_back(spec);
    }
    m.files[file] = info.record;
  }
  try {
    check_partitions(m);
  } catch (const CheckpointError& e) {
    throw fail(e.what());
  }
  for (const auto& record : records)
    if (!std::filesystem::remove(record, ec))
      throw fail("cannot remove ", record.filename().string(), ": ", ec.message());
  write_manifest(tmp, m);
  staging.commit();
}

/// Single-process save of a whole TP group (pipeline 1): states_by_tp_rank[r] is TP rank r's
/// state. Writes `dir` atomically (an existing checkpoint there is replaced only on success).
/// Throws ConfigError when meta.layout is not TP = states_by_tp_rank.size() with pipeline 1;
/// otherwise as write_shard_file and write_manifest_and_commit.
inline void save_all(const std::filesystem::path& dir, const std::vector<State>& states_by_tp_rank,
                     const CheckpointMeta& meta) {
  const int tp = static_cast<int>(states_by_tp_rank.size());
  DSP_CHECK_AS(ConfigError, meta.layout.tensor == tp && meta.layout.pipeline == 1, "save_all: ", tp,
               " tensor-parallel states, but the layout is ", meta.layout.str());
  AtomicDir staging(dir);
  for (int r = 0; r < tp; ++r)
    write_shard_file(staging.tmp_path(), states_by_tp_rank[static_cast<std::size_t>(r)], tp, r, 0);
  write_manifest_and_commit(staging, meta);
}

}  // namespace dsp::checkpoint
