#pragma once
// Manifest: the file `manifest.json` at the root of a checkpoint directory. It makes the
// checkpoint self-describing (every tensor's ShardedTensor spec, the layout it was saved at)
// and verifiable (every file's size and CRC-32). Format, version 2:
//
//   {"format": "dsp-checkpoint", "version": 2,
//    "iteration": 1000,
//    "layout": {"tensor": 2, "pipeline": 1, "data": 4, "expert": 1},
//    "model_config": {...},              // opaque, supplied by the caller (Hugging Face config)
//    "tensors": [<ShardedTensor JSON>, ...],
//    "files": {"model_tp00_pp000.safetensors":
//                {"size": 123456, "crc32": "89abcdef", "tp_rank": 0, "pp_rank": 0},
//              "optim_tp00_pp000_dp001.safetensors":
//                {"size": 4567, "crc32": "01234567", "tp_rank": 0, "pp_rank": 0, "dp_rank": 1,
//                 "ranges": {"optimizer.exp_avg.model.norm.weight": [16, 32], ...}}, ...},
//    "extra": {...}}                     // opaque trainer state: LR position, RNG, data position
//
// "size" is in bytes; "crc32" is zlib's crc32 of the whole file as 8 lower-case hex digits.
// A file either holds whole TP-local shards (a model file) or, with "dp_rank", is a partition
// file: each tensor it holds is the elements [begin, end) of a TP-local shard, flattened
// row-major, stored as a 1-D tensor of end - begin elements (ZeRO's partitioned optimizer
// state). The partition files of one TP rank tile every such shard exactly: no gap, no
// overlap. Version 1 (no partition files) is read too.
#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/checkpoint/file_io.hpp"
#include "dsp/core/error.hpp"
#include "dsp/parallel/layout.hpp"
#include "dsp/parallel/sharded_tensor.hpp"

namespace dsp::checkpoint {

/// Name of the manifest inside a checkpoint directory.
inline constexpr std::string_view manifest_file_name = "manifest.json";
/// Value of the manifest's "format" field.
inline constexpr std::string_view manifest_format = "dsp-checkpoint";
/// The manifest version this code writes (it reads this one and version 1).
inline constexpr int manifest_version = 2;

/// Elements [first, second) of a TP-local shard, flattened row-major.
using ElementRange = std::pair<std::int64_t, std::int64_t>;

/// A file of the checkpoint: its size and checksum, and which ranks wrote it.
struct FileRecord {
  std::uint64_t size = 0;   ///< bytes
  std::uint32_t crc32 = 0;  ///< zlib crc32 of the whole file
  int tp_rank = 0;
  int pp_rank = 0;
  /// A partition file's data-parallel rank; -1 for a model file (whole TP-local shards).
  int dp_rank = -1;
  /// A partition file's tensors: name -> the range of its TP-local shard the file holds.
  std::map<std::string, ElementRange> ranges;
  bool partition() const { return dp_rank >= 0; }
  bool operator==(const FileRecord&) const = default;
};

/// What the caller supplies besides tensors; carried unchanged through load, reshard and merge
/// (reshard replaces the layout).
struct CheckpointMeta {
  /// Opaque model description (a Hugging Face config); merge writes it as config.json.
  nlohmann::json model_config = nlohmann::json::object();
  /// The layout the checkpoint was saved at.
  ParallelLayout layout{.tensor = 1, .pipeline = 1, .data = 1, .expert = 1};
  /// Training iteration.
  std::int64_t iteration = 0;
  /// Opaque trainer state: LR schedule position, RNG, data position, per-data-parallel-rank info.
  nlohmann::json extra = nlohmann::json::object();
};

/// The parsed manifest.json.
struct Manifest {
  CheckpointMeta meta;
  std::vector<ShardedTensor> tensors;       ///< every tensor of the checkpoint, in save order
  std::map<std::string, FileRecord> files;  ///< file name (inside the directory) -> record

  /// The spec of tensor `name`, or nullptr when the checkpoint has none.
  const ShardedTensor* find(std::string_view name) const {
    for (const ShardedTensor& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
};

/// 8 lower-case hex digits.
inline std::string crc32_hex(std::uint32_t crc) {
  char hex[9];
  std::snprintf(hex, sizeof hex, "%08x", static_cast<unsigned>(crc));
  return hex;
}

/// Inverse of crc32_hex; throws std::invalid_argument unless `hex` is 8 hex digits.
inline std::uint32_t parse_crc32_hex(std::string_view hex) {
  std::uint32_t crc = 0;
  const auto [end, err] = std::from_chars(hex.data(), hex.data() + hex.size(), crc, 16);
  if (hex.size() != 8 || err != std::errc() || end != hex.data() + hex.size())
    throw std::invalid_argument("crc32 '" + std::string(hex) + "' is not 8 hex digits");
  return crc;
}

/// FileRecord as {"size", "crc32" (crc32_hex), "tp_rank", "pp_rank"}, and for a partition
/// file "dp_rank" and "ranges" ({name: [begin, end]}).
inline void to_json(nlohmann::json& j, const FileRecord& r) {
  j = {{"size", r.size}, {"crc32", crc32_hex(r.crc32)}, {"tp_rank", r.tp_rank}, {"pp_rank", r.pp_rank}};
  if (r.partition()) {
    j["dp_rank"] = r.dp_rank;
    j["ranges"] = r.ranges;
  }
}
/// Inverse of to_json(FileRecord); throws nlohmann::json exceptions or std::invalid_argument
/// (crc32) on malformed input.
inline void from_json(const nlohmann::json& j, FileRecord& r) {
  r.size = j.at("size").get<std::uint64_t>();
  r.crc32 = parse_crc32_hex(j.at("crc32").get<std::string>());
  r.tp_rank = j.at("tp_rank").get<int>();
  r.pp_rank = j.at("pp_rank").get<int>();
  r.dp_rank = j.value("dp_rank", -1);
  r.ranges = j.value("ranges", std::map<std::string, ElementRange>{});
}

/// The manifest JSON described at the top of this header.
inline void to_json(nlohmann::json& j, const Manifest& m) {
  const ParallelLayout& l = m.meta.layout;
  j = {{"format", manifest_format},
       {"version", manifest_version},
       {"iteration", m.meta.iteration},
       {"layout", {{"tensor", l.tensor}, {"pipeline", l.pipeline}, {"data", l.data}, {"expert", l.expert}}},
       {"model_config", m.meta.model_config},
       {"tensors", m.tensors},
       {"files", m.files},
       {"extra", m.meta.extra}};
}
/// Reads every field except "format" and "version" (read_manifest checks those).
inline void from_json(const nlohmann::json& j, Manifest& m) {
  const nlohmann::json& l = j.at("layout");
  m.meta.layout = {.tensor = l.at("tensor").get<int>(),
                   .pipeline = l.at("pipeline").get<int>(),
                   .data = l.at("data").get<int>(),
                   .expert = l.value("expert", 1)};
  m.meta.iteration = j.at("iteration").get<std::int64_t>();
  m.meta.model_config = j.at("model_config");
  m.meta.extra = j.value("extra", nlohmann::json::object());
  m.tensors = j.at("tensors").get<std::vector<ShardedTensor>>();
  m.files = j.at("files").get<std::map<std::string, FileRecord>>();
}

/// Checks that the partition files of `m` tile, for every TP rank, every tensor they hold:
/// each such tensor is listed in m.tensors and in no model file, and its ranges from the files
/// of one TP rank cover [0, numel of its local shard) without gap or overlap. Throws
/// CheckpointError naming the tensor and TP rank (and the file, for a range outside the shard).
inline void check_partitions(const Manifest& m) {
  const int tp = m.meta.layout.tensor;
  std::map<std::string, std::vector<std::vector<ElementRange>>> pieces;  // name -> by TP rank
  for (const auto& [file, r] : m.files) {
    if (!r.partition()) continue;
    for (const auto& [name, range] : r.ranges) {
      const ShardedTensor* spec = m.find(name);
      DSP_CHECK_AS(CheckpointError, spec, file, " holds ", name, ", which the manifest does not list");
      const std::int64_t n = numel(spec->local_shape(tp));
      DSP_CHECK_AS(CheckpointError, 0 <= range.first && range.first < range.second && range.second <= n, file,
                   " holds elements [", range.first, ", ", range.second, ") of ", name, ", whose TP shard has ", n);
      auto& by_rank = pieces[name];
      by_rank.resize(static_cast<std::size_t>(tp));
      by_rank.at(static_cast<std::size_t>(r.tp_rank)).push_back(range);
    }
  }
  for (auto& [name, by_rank] : pieces) {
    const std::int64_t n = numel(m.find(name)->local_shape(tp));
    for (int t = 0; t < tp; ++t) {
      auto& ranges = by_rank[static_cast<std::size_t>(t)];
      std::sort(ranges.begin(), ranges.end());
      std::int64_t covered = 0;
      for (const ElementRange& range : ranges) {
        DSP_CHECK_AS(CheckpointError, range.first >= covered, "tensor ", name, " at TP rank ", t,
                     ": partition files overlap at element ", range.first);
        DSP_CHECK_AS(CheckpointError, range.first <= covered, "tensor ", name, " at TP rank ", t,
                     ": no partition file holds elements [", covered, ", ", range.first, ")");
        covered = range.second;
      }
      DSP_CHECK_AS(CheckpointError, covered == n, "tensor ", name, " at TP rank ", t,
                   ": partition files cover its first ", covered, " of ", n, " elements");
    }
  }
}

/// Writes `dir`/manifest.json (2-space indented). Throws CheckpointError naming the file when
/// it cannot be written.
inline void write_manifest(const std::filesystem::path& dir, const Manifest& m) {
  write_text(dir / manifest_file_name, nlohmann::json(m).dump(2) + "\n");
}

/// Parses `dir`/manifest.json without verifying the files it lists. Throws CheckpointError:
/// "checkpoint directory <dir> does not exist", "no manifest.json in <dir>" when it is absent;
/// naming the file when it is not valid JSON ("<file>: not valid JSON (truncated?)") or not of
/// the form above, its format or version is not this code's, a layout size is < 1, a file name
/// is not a plain name inside the directory, or a file's ranks lie outside the layout.
inline Manifest read_manifest(const std::filesystem::path& dir) {
  const std::filesystem::path path = dir / manifest_file_name;
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec))
    throw CheckpointError(dsp::detail::concat("checkpoint directory ", dir.string(), " does not exist"));
  if (!std::filesystem::is_regular_file(path, ec))
    throw CheckpointError(dsp::detail::concat("no ", manifest_file_name, " in ", dir.string()));
  const auto fail = [&](const auto&... what) {
    return CheckpointError(dsp::detail::concat(path.string(), ": ", what...));
  };
  const nlohmann::json j = nlohmann::json::parse(read_text(path), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw fail("not valid JSON (truncated?)");
  if (!j.is_object()) throw fail("not a JSON object");
  const nlohmann::json format = j.value("format", nlohmann::json()),
                       version = j.value("version", nlohmann::json());
  if (format != nlohmann::json(manifest_format))
    throw fail("not a ", manifest_format, " manifest (format ", format.dump(), ")");
  if (version != manifest_version && version != 1)
    throw fail("version ", version.dump(), " is not supported (this code reads versions 1 and ", manifest_version,
               ")");
  Manifest m;
  try {
    m = j.get<Manifest>();
  } catch (const std::exception& e) {
    throw fail("malformed manifest: ", e.what());
  }
  const ParallelLayout& l = m.meta.layout;
  if (l.tensor < 1 || l.pipeline < 1 || l.data < 1 || l.expert < 1) throw fail("invalid layout ", l.str());
  for (const auto& [name, record] : m.files) {
    if (std::filesystem::path(name).filename() != name || name == "." || name == "..")
      throw fail("file name '", name, "' is not a plain file name");
    if (record.tp_rank < 0 || record.tp_rank >= l.tensor || record.pp_rank < 0 || record.pp_rank >= l.pipeline)
      throw fail(name, " has TP rank ", record.tp_rank, " / PP rank ", record.pp_rank, ", outside layout ",
                 l.str());
    if (record.dp_rank >= l.data) throw fail(name, " has DP rank ", record.dp_rank, ", outside layout ", l.str());
    if (!record.partition() && !record.ranges.empty()) throw fail(name, " lists ranges but no DP rank");
    if (record.partition() && version == 1) throw fail(name, " is a partition file, which version 1 does not have");
  }
  try {
    check_partitions(m);
  } catch (const CheckpointError& e) {
    throw fail(e.what());
  }
  return m;
}

/// Checks the file `name` of the checkpoint in `dir` against its manifest record's size and
/// CRC-32. Throws CheckpointError naming the file when it is missing, or has another size or
/// checksum (the message gives the manifest's value and the file's).
inline void verify_file(const std::filesystem::path& dir, const std::string& name, const FileRecord& record) {
  const std::filesystem::path path = dir / name;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw CheckpointError(dsp::detail::concat(path.string(), ": listed in ", manifest_file_name, " but missing"));
  const std::uint64_t size = size_of_file(path);
  if (size != record.size)
    throw CheckpointError(dsp::detail::concat(path.string(), ": size is ", size, " bytes, ", manifest_file_name,
                                              " expects ", record.size, " (truncated or overwritten)"));
  const FileDigest digest = digest_file(path);
  if (digest.crc32 != record.crc32)
    throw CheckpointError(dsp::detail::concat(path.string(), ": crc32 is ", crc32_hex(digest.crc32), ", ",
                                              manifest_file_name, " expects ", crc32_hex(record.crc32),
                                              " (corrupted)"));
}

/// verify_file for every file the manifest lists.
inline void verify_files(const std::filesystem::path& dir, const Manifest& m) {
  for (const auto& [name, record] : m.files) verify_file(dir, name, record);
}

/// read_manifest + verify_files: the manifest of `dir`, every file it lists verified before
/// any data is used. Throws CheckpointError as those two do.
inline Manifest load_manifest(const std::filesystem::path& dir) {
  Manifest m = read_manifest(dir);
  verify_files(dir, m);
  return m;
}

}  // namespace dsp::checkpoint
