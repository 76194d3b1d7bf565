#pragma once
// Test helper: where the repository's data/ folder is. DSP_TEST_DATA_DIR (tests/CMakeLists.txt)
// is that folder relative to the folder holding the test binary (build/<preset>/tests ->
// ../../../data), not an absolute path, so that the compile commands are the same in every
// checkout and a compiler cache (ccache, .ci/run) hits across clones. Linux: the binary's
// folder is read from /proc/self/exe.
#include <filesystem>
#include <string>

namespace dsp::test {

/// Absolute path of data/ (no trailing slash), found from the running binary's location.
inline std::string data_dir() {
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / DSP_TEST_DATA_DIR).lexically_normal().string();
}

}  // namespace dsp::test
