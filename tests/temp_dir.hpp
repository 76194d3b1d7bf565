#pragma once
// A self-removing temporary directory for the tests that write files.
#include <filesystem>
#include <random>
#include <string>
#include <system_error>
#include <vector>

namespace dsp::test {

/// A unique directory under the system temp directory (dsp-test-<random>), removed with
/// everything in it.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::random_device rd;
    path = std::filesystem::temp_directory_path() / ("dsp-test-" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  std::filesystem::path operator/(const std::string& name) const { return path / name; }
  /// Names in the directory (checks that no .tmp-/.old- leftovers remain).
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path)) out.push_back(e.path().filename().string());
    return out;
  }
};

}  // namespace dsp::test
