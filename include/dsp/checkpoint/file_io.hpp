#pragma once
// Checked file I/O for checkpoints. Every failure is a CheckpointError whose message starts
// with the file's path and ends with the operating system's reason. Writes and whole-file
// reads track the size and the CRC-32 (zlib's crc32_z: the gzip/PNG polynomial) that
// manifests record.
#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "dsp/core/error.hpp"

namespace dsp::checkpoint {

/// Size in bytes and CRC-32 of a file's whole content.
struct FileDigest {
  std::uint64_t size = 0;
  std::uint32_t crc32 = 0;
  bool operator==(const FileDigest&) const = default;
};

namespace detail {

inline std::string os_reason(int err) { return std::error_code(err, std::generic_category()).message(); }

inline std::uint32_t crc32_update(std::uint32_t crc, std::span<const std::byte> bytes) {
  return static_cast<std::uint32_t>(
      crc32_z(crc, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<z_size_t>(bytes.size())));
}

// An open POSIX file descriptor, closed on destruction. `what` ("open", "create") names the
// operation in the error thrown when open(2) fails.
class Fd {
 public:
  Fd(const std::filesystem::path& path, int flags, std::string_view what)
      : fd_(::open(path.c_str(), flags | O_CLOEXEC, 0644)) {
    if (fd_ < 0)
      throw CheckpointError(dsp::detail::concat(path.string(), ": cannot ", what, ": ", os_reason(errno)));
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now; returns errno of a failed close(2), 0 on success.
  int close() { return ::close(std::exchange(fd_, -1)) == 0 ? 0 : errno; }

 private:
  int fd_;
};

/// Fault injection for tests: when set, called at every boundary of a checkpoint save (a file
/// closed, a folder or the tracker renamed) with what was just done, from whichever rank did
/// it; a test makes it kill the process there (tests/checkpoint/test_iterations.cpp). Null in
/// programs.
inline void (*save_point_hook)(const char* what) = nullptr;
inline void save_point(const char* what) {
  if (save_point_hook) save_point_hook(what);
}

}  // namespace detail

/// Writes a new file (created, or truncated when it exists) and accumulates its FileDigest.
/// Not thread-safe; one writer per file.
class FileWriter {
 public:
  /// Throws CheckpointError naming the file when it cannot be created.
  explicit FileWriter(std::filesystem::path path)
      : path_(std::move(path)), fd_(path_, O_WRONLY | O_CREAT | O_TRUNC, "create") {}

  /// Appends bytes. Throws CheckpointError naming the file when write(2) fails (e.g. disk full).
  void write(std::span<const std::byte> bytes) {
    digest_.crc32 = detail::crc32_update(digest_.crc32, bytes);
    digest_.size += bytes.size();
    while (!bytes.empty()) {
      const ::ssize_t n = ::write(fd_.get(), bytes.data(), bytes.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0)
        throw CheckpointError(dsp::detail::concat(path_.string(), ": write failed: ", detail::os_reason(errno)));
      bytes = bytes.subspan(static_cast<std::size_t>(n));
    }
  }
  /// Closes the file and returns the digest of everything written. Throws CheckpointError
  /// naming the file when close(2) reports an error (delayed write failures show up here).
  FileDigest close() {
    if (const int err = fd_.close(); err != 0)
      throw CheckpointError(dsp::detail::concat(path_.string(), ": close failed: ", detail::os_reason(err)));
    detail::save_point("file closed");
    return digest_;
  }

 private:
  std::filesystem::path path_;
  detail::Fd fd_;
  FileDigest digest_;
};

/// Writes `text` as the whole content of `path`; returns its digest. Throws CheckpointError
/// naming the file on failure.
inline FileDigest write_text(const std::filesystem::path& path, std::string_view text) {
  FileWriter out(path);
  out.write(std::as_bytes(std::span(text)));
  return out.close();
}

/// Size of a file in bytes. Throws CheckpointError naming the file when it does not exist or
/// is not a regular file.
inline std::uint64_t size_of_file(const std::filesystem::path& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) throw CheckpointError(dsp::detail::concat(path.string(), ": cannot read size: ", ec.message()));
  return size;
}

/// Reads exactly out.size() bytes starting at byte `offset`. Throws CheckpointError naming the
/// file when it cannot be opened or read, or ends before offset + out.size() ("truncated").
inline void read_at(const std::filesystem::path& path, std::uint64_t offset, std::span<std::byte> out) {
  detail::Fd fd(path, O_RDONLY, "open");
  for (std::size_t done = 0; done < out.size();) {
    const ::ssize_t n =
        ::pread(fd.get(), out.data() + done, out.size() - done, static_cast<::off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw CheckpointError(dsp::detail::concat(path.string(), ": read failed: ", detail::os_reason(errno)));
    if (n == 0)
      throw CheckpointError(dsp::detail::concat(path.string(), ": truncated: ends at byte ", offset + done,
                                                ", expected ", out.size(), " bytes from byte ", offset));
    done += static_cast<std::size_t>(n);
  }
}

/// The whole content of a (small) file: manifests, configs. Throws CheckpointError naming the
/// file when it cannot be read.
inline std::string read_text(const std::filesystem::path& path) {
  std::string text(size_of_file(path), '\0');
  read_at(path, 0, std::as_writable_bytes(std::span(text)));
  return text;
}

/// Size and CRC-32 of a file's content, read in 1 MiB chunks. Throws CheckpointError naming
/// the file when it cannot be opened or read.
inline FileDigest digest_file(const std::filesystem::path& path) {
  detail::Fd fd(path, O_RDONLY, "open");
  std::vector<std::byte> chunk(std::size_t{1} << 20);
  FileDigest digest;
  for (;;) {
    const ::ssize_t n = ::read(fd.get(), chunk.data(), chunk.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw CheckpointError(dsp::detail::concat(path.string(), ": read failed: ", detail::os_reason(errno)));
    if (n == 0) return digest;
    digest.crc32 = detail::crc32_update(digest.crc32, std::span(chunk).first(static_cast<std::size_t>(n)));
    digest.size += static_cast<std::uint64_t>(n);
  }
}

/// Flushes a file or directory to stable storage (fsync(2); for a directory this makes the
/// names it holds durable). Throws CheckpointError naming the path on failure.
inline void sync_to_disk(const std::filesystem::path& path) {
  std::error_code ec;
  const bool directory = std::filesystem::is_directory(path, ec);
  detail::Fd fd(path, O_RDONLY | (directory ? O_DIRECTORY : 0), "open");
  if (::fsync(fd.get()) != 0)
    throw CheckpointError(dsp::detail::concat(path.string(), ": fsync failed: ", detail::os_reason(errno)));
}

}  // namespace dsp::checkpoint
