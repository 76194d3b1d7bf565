#pragma once
// AtomicDir: build a directory under a temporary name, then replace the target in one step.
//
//   AtomicDir staging(dir);                       // creates <dir>.tmp-<16 hex digits>
//   write files into staging.tmp_path() ...       // any number of writers, threads or processes
//   staging.commit();                             // fsync everything, rename over <dir>
//
// Readers see either the complete old directory or the complete new one. If the object is
// destroyed without commit() (an exception on the way), the temporary directory is removed
// and the target was never touched.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <system_error>

#include "dsp/checkpoint/file_io.hpp"
#include "dsp/core/error.hpp"

namespace dsp::checkpoint {

/// Throws CheckpointError when `target` exists and is not an empty directory or a previous
/// checkpoint (manifest.json, or a merged model.safetensors + config.json): writing a
/// checkpoint there would replace a directory of other files. Call it before long work whose
/// result will be saved there (dsp-train does, before training).
inline void check_replaceable(const std::filesystem::path& target) {
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::symlink_status(target, ec))) return;
  DSP_CHECK_AS(CheckpointError, std::filesystem::is_directory(target, ec), "refusing to replace ", target.string(),
               ": it exists and is not a directory");
  const bool empty = std::filesystem::is_empty(target, ec);
  const bool checkpoint = std::filesystem::exists(target / "manifest.json", ec) ||
                          (std::filesystem::exists(target / "model.safetensors", ec) &&
                           std::filesystem::exists(target / "config.json", ec));
  DSP_CHECK_AS(CheckpointError, empty || checkpoint, "refusing to replace ", target.string(),
               ": it exists and is not a checkpoint (no manifest.json); choose another directory");
}

/// A directory written under a temporary sibling name and renamed over its target on commit.
/// Not copyable or movable: it owns the temporary directory for its lifetime.
class AtomicDir {
 public:
  /// Creates the empty directory `<target>.tmp-<random>` next to `target` (creating target's
  /// parent directories when missing). Throws CheckpointError naming the path when that fails
  /// or when `target` exists and is neither empty nor a checkpoint (it would be replaced).
  explicit AtomicDir(const std::filesystem::path& target) : target_(normalized(target)), tmp_(sibling(".tmp-")) {
    check_replaceable(target_);
    std::error_code ec;
    std::filesystem::create_directories(target_.parent_path(), ec);
    if (!ec && !std::filesystem::create_directory(tmp_, ec) && !ec) ec = std::make_error_code(std::errc::file_exists);
    if (ec) throw CheckpointError(dsp::detail::concat(tmp_.string(), ": cannot create directory: ", ec.message()));
  }
  AtomicDir(const AtomicDir&) = delete;
  AtomicDir& operator=(const AtomicDir&) = delete;
  /// Removes the temporary directory unless commit() succeeded. Never throws.
  ~AtomicDir() {
    std::error_code ignored;
    if (!committed_) std::filesystem::remove_all(tmp_, ignored);
  }

  /// The directory being replaced (absolute, normalised).
  const std::filesystem::path& target() const { return target_; }
  /// The temporary directory to write into.
  const std::filesystem::path& tmp_path() const { return tmp_; }

  /// Makes the temporary directory the target: fsyncs every file and directory under it,
  /// renames an existing target aside to `<target>.old-<random>`, renames the temporary
  /// directory to the target, fsyncs the parent directory and removes the old one (best
  /// effort: a leftover `.old-` directory is harmless). Throws CheckpointError naming the paths
  /// when a step fails; if the final rename fails, the old target is renamed back first. If the
  /// process dies between the two renames, the previous checkpoint is the `.old-` directory.
  /// Throws CheckpointError when called twice.
  void commit() {
    DSP_CHECK_AS(CheckpointError, !committed_, target_.string(), ": AtomicDir committed twice");
    std::error_code ec;
    for (std::filesystem::recursive_directory_iterator it(tmp_, ec), end; !ec && it != end; it.increment(ec))
      sync_to_disk(it->path());
    if (ec) throw CheckpointError(dsp::detail::concat(tmp_.string(), ": cannot list: ", ec.message()));
    sync_to_disk(tmp_);
    detail::save_point("files synced");

    std::filesystem::path old;
    if (std::filesystem::exists(std::filesystem::symlink_status(target_, ec))) {
      old = sibling(".old-");
      std::filesystem::rename(target_, old, ec);
      if (ec)
        throw CheckpointError(
            dsp::detail::concat(target_.string(), ": cannot rename aside to ", old.string(), ": ", ec.message()));
      detail::save_point("old folder renamed aside");
    }
    std::filesystem::rename(tmp_, target_, ec);
    if (ec) {
      std::error_code ignored;
      if (!old.empty()) std::filesystem::rename(old, target_, ignored);
      throw CheckpointError(
          dsp::detail::concat(tmp_.string(), ": cannot rename to ", target_.string(), ": ", ec.message()));
    }
    committed_ = true;
    detail::save_point("folder renamed into place");
    if (!old.empty()) std::filesystem::remove_all(old, ec);
    sync_to_disk(target_.parent_path());
  }

 private:
  static std::filesystem::path normalized(const std::filesystem::path& p) {
    std::filesystem::path n = std::filesystem::absolute(p).lexically_normal();
    return n.has_filename() ? n : n.parent_path();
  }
  // `<target><tag><16 random hex digits>` in the target's parent directory.
  std::filesystem::path sibling(const char* tag) const {
    std::random_device rd;
    const std::uint64_t r = (std::uint64_t{rd()} << 32) ^ rd();
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(r));
    return target_.parent_path() / (target_.filename().string() + tag + hex);
  }

  std::filesystem::path target_;
  std::filesystem::path tmp_;
  bool committed_ = false;
};

}  // namespace dsp::checkpoint
