#pragma once
// Test and benchmark helper: where the repository's data/ folder is. DSP_DATA_DIR
// (tests/CMakeLists.txt, benchmarks/CMakeLists.txt) is that folder relative to the folder holding
// the binary (build/<preset>/tests -> ../../../data), both resolved through symlinks, not an
// absolute path, so that the compile commands are the same in every checkout and a compiler
// cache (ccache, .ci/run) hits across clones. Nor is it derived from __FILE__, which ccache's
// CCACHE_BASEDIR makes relative. Linux: the binary's folder is read from /proc/self/exe.
#include <filesystem>
#include <string>

namespace dsp::test {

/// Absolute path of data/ (no trailing slash), found from the running binary's location.
inline std::string data_dir() {
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / DSP_DATA_DIR).lexically_normal().string();
}

}  // namespace dsp::test
