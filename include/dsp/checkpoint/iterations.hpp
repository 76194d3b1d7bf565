#pragma once
// A training run's checkpoint folder as Megatron-LM keeps it:
//
//   DIR/iter_0000200/                       one complete checkpoint (manifest.json + files)
//   DIR/iter_0000400/
//   DIR/latest_checkpointed_iteration.txt   "400": the newest complete one, written last
//
// Each iteration folder is written under a temporary name and renamed into place
// (AtomicDir); the tracker is replaced atomically only after that, so a crash at any point
// leaves the tracker naming a complete checkpoint. The leftovers of a crash (`iter_*.tmp-*`,
// and `iter_*.old-*` when an iteration was saved twice) are removed at the next save; a crash
// between the two renames of a re-save (the old folder aside, the new one not yet in place)
// is undone on load.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "dsp/checkpoint/file_io.hpp"
#include "dsp/core/error.hpp"

namespace dsp::checkpoint {

/// Megatron's tracker file name inside a checkpoint folder.
inline constexpr const char* tracker_file_name = "latest_checkpointed_iteration.txt";

/// "iter_0000400": the folder of iteration `iteration` (7 digits, as Megatron names it).
inline std::string iteration_folder_name(std::int64_t iteration) {
  char name[32];
  std::snprintf(name, sizeof name, "iter_%07lld", static_cast<long long>(iteration));
  return name;
}

namespace detail {
// The iteration of a folder name "iter_<digits>" (exactly; no suffix), or nullopt.
inline std::optional<std::int64_t> parse_iteration_folder(const std::string& name) {
  if (name.size() <= 5 || name.compare(0, 5, "iter_") != 0) return std::nullopt;
  std::int64_t v = 0;
  const char* end = name.data() + name.size();
  const auto [p, ec] = std::from_chars(name.data() + 5, end, v);
  if (ec != std::errc{} || p != end || v < 0) return std::nullopt;
  return v;
}
// "iter_0000400.tmp-<hex>" / "iter_0000400.old-<hex>": the iteration folder it is a leftover of.
inline std::optional<std::string> leftover_of(const std::string& name) {
  for (const char* tag : {".tmp-", ".old-"})
    if (const auto at = name.find(tag); at != std::string::npos && parse_iteration_folder(name.substr(0, at)))
      return name.substr(0, at);
  return std::nullopt;
}
inline bool is_complete(const std::filesystem::path& dir) {
  std::error_code ec;
  return std::filesystem::exists(dir / "manifest.json", ec);
}
}  // namespace detail

/// The iteration `root`'s tracker names, or nullopt when there is no tracker. Throws
/// CheckpointError naming the file when it holds anything but a non-negative integer.
inline std::optional<std::int64_t> read_tracker(const std::filesystem::path& root) {
  const auto path = root / tracker_file_name;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  std::string text = read_text(path);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  std::int64_t v = -1;
  const auto [p, err] = std::from_chars(text.data(), text.data() + text.size(), v);
  DSP_CHECK_AS(CheckpointError, err == std::errc{} && p == text.data() + text.size() && v >= 0, path.string(),
               ": expected an iteration number, got '", text, "'");
  return v;
}

/// Replaces `root`'s tracker with `iteration` atomically: written to a temporary file, synced,
/// renamed over the tracker, the folder synced. Throws CheckpointError naming the file.
inline void write_tracker(const std::filesystem::path& root, std::int64_t iteration) {
  const auto path = root / tracker_file_name;
  const auto tmp = root / (std::string(tracker_file_name) + ".tmp");
  write_text(tmp, std::to_string(iteration));
  sync_to_disk(tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw CheckpointError(dsp::detail::concat(tmp.string(), ": cannot rename to ", path.string(), ": ", ec.message()));
  detail::save_point("tracker renamed into place");
  sync_to_disk(root);
}

/// The iterations of the complete checkpoints (iter_* folders with a manifest) in `root`,
/// ascending; empty when `root` does not exist.
inline std::vector<std::int64_t> saved_iterations(const std::filesystem::path& root) {
  std::vector<std::int64_t> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec))
    if (const auto i = detail::parse_iteration_folder(it->path().filename().string()); i && detail::is_complete(it->path()))
      out.push_back(*i);
  std::sort(out.begin(), out.end());
  return out;
}

/// Undoes a crash between the two renames of a re-saved iteration: every missing iteration
/// folder whose complete `.old-` copy exists is renamed back. Safe to call from several ranks at
/// once (a rename that lost the race is ignored). Never throws.
inline void recover_iteration_folders(const std::filesystem::path& root) {
  std::error_code ec;
  for (std::filesystem::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const auto of = detail::leftover_of(name);
    if (!of || name.find(".old-") == std::string::npos || !detail::is_complete(it->path())) continue;
    std::error_code ignored;
    if (!std::filesystem::exists(root / *of, ignored)) std::filesystem::rename(it->path(), root / *of, ignored);
  }
}

/// Removes the leftovers of interrupted saves in `root` (`iter_*.tmp-*` and `iter_*.old-*`),
/// after recover_iteration_folders. Call it only while no other writer saves into `root`.
/// Never throws (a leftover that cannot be removed stays).
inline void remove_leftovers(const std::filesystem::path& root) {
  recover_iteration_folders(root);
  std::vector<std::filesystem::path> stale;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec))
    if (detail::leftover_of(it->path().filename().string())) stale.push_back(it->path());
  for (const auto& p : stale) std::filesystem::remove_all(p, ec);
}

/// Keeps the newest `keep` complete iteration folders of `root` (and always the one the tracker
/// names), removing the others. keep <= 0 keeps all. Never throws.
inline void retain_newest(const std::filesystem::path& root, std::int64_t keep) {
  if (keep <= 0) return;
  const std::vector<std::int64_t> saved = saved_iterations(root);
  std::optional<std::int64_t> latest;
  try {
    latest = read_tracker(root);
  } catch (const CheckpointError&) {
    return;  // a tracker we cannot read: remove nothing
  }
  std::error_code ec;
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < saved.size(); ++i)
    if (saved[i] != latest) std::filesystem::remove_all(root / iteration_folder_name(saved[i]), ec);
}

/// The checkpoint folder a reader opens for `path`: `path` itself when it is one checkpoint
/// (a manifest.json, an iter_* folder or a resharded/merged folder) or a Hugging Face model
/// folder (model.safetensors or model.safetensors.index.json), else `path`'s iteration
/// `iteration` when given (--ckpt-step), else the one its tracker names, else its newest
/// complete iteration folder. Recovers an interrupted re-save first
/// (recover_iteration_folders). Throws CheckpointError naming `path` when it does not exist or
/// holds no such checkpoint (listing the iterations it holds).
inline std::filesystem::path resolve_checkpoint(const std::filesystem::path& path,
                                                std::optional<std::int64_t> iteration = std::nullopt) {
  std::error_code ec;
  DSP_CHECK_AS(CheckpointError, std::filesystem::exists(path, ec), path.string(), ": checkpoint folder does not exist");
  if (!iteration && (detail::is_complete(path) || std::filesystem::exists(path / "model.safetensors", ec) ||
                     std::filesystem::exists(path / "model.safetensors.index.json", ec)))
    return path;  // a checkpoint, or a Hugging Face model folder (merged, or sharded by its index)
  recover_iteration_folders(path);
  const std::vector<std::int64_t> saved = saved_iterations(path);
  std::string held;
  for (auto i : saved) held += (held.empty() ? "" : ", ") + std::to_string(i);
  held = saved.empty() ? "no iter_* checkpoints" : "iterations " + held;
  const std::optional<std::int64_t> want = iteration ? iteration : read_tracker(path);
  if (want) {
    const auto dir = path / iteration_folder_name(*want);
    DSP_CHECK_AS(CheckpointError, detail::is_complete(dir), path.string(), ": no complete checkpoint of iteration ",
                 *want, iteration ? " (--ckpt-step)" : std::string(" (named by ") + tracker_file_name + ")",
                 "; it holds ", held);
    return dir;
  }
  DSP_CHECK_AS(CheckpointError, !saved.empty(), path.string(),
               ": not a checkpoint (no manifest.json, no ", tracker_file_name, ", no iter_* folders)");
  return path / iteration_folder_name(saved.back());
}

/// Refuses (CheckpointError naming both iterations) a run that would save into `root`, which
/// already holds iteration `latest` >= `first_save`, the first iteration this run writes: that
/// checkpoint would be replaced or left behind by a run that started over (--load forgotten).
/// Also refuses a `root` that is itself one checkpoint (a manifest.json: the single-folder
/// layout), which iteration folders must not be written into. `root` missing or empty passes.
inline void check_save_root(const std::filesystem::path& root, std::int64_t first_save) {
  std::error_code ec;
  DSP_CHECK_AS(CheckpointError, !std::filesystem::exists(root, ec) || std::filesystem::is_directory(root, ec),
               "--save ", root.string(), " exists and is not a directory");
  DSP_CHECK_AS(CheckpointError, !detail::is_complete(root), "--save ", root.string(),
               " is a single checkpoint (manifest.json), not a folder of iter_* checkpoints: load it with --load and "
               "save to another folder");
  std::optional<std::int64_t> latest = read_tracker(root);
  if (const auto saved = saved_iterations(root); !saved.empty()) latest = std::max(latest.value_or(0), saved.back());
  DSP_CHECK_AS(CheckpointError, !latest || *latest < first_save, "--save ", root.string(), " holds iteration ",
               *latest, ", and this run would write iteration ", first_save,
               " over or before it: resume with --load ", root.string(),
               ", save elsewhere, or pass --overwrite-checkpoints to write anyway");
}

}  // namespace dsp::checkpoint
