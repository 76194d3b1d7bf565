// AtomicDir: commit replaces the target in one step; an exception leaves it untouched.
#include <doctest/doctest.h>

#include <fstream>
#include <stdexcept>
#include <string>

#include "dsp/checkpoint/atomic_dir.hpp"
#include "dsp/checkpoint/file_io.hpp"
#include "fixture.hpp"

using namespace checkpoint_test;

namespace checkpoint_atomic_dir_test {
using dsp::checkpoint::AtomicDir;
using dsp::checkpoint::read_text;
using dsp::checkpoint::write_text;

TEST_CASE("AtomicDir creates, then replaces, the target and leaves nothing behind") {
  TempDir tmp;
  const auto target = tmp / "ckpt";
  {
    AtomicDir staging(target);
    CHECK(staging.tmp_path().parent_path() == tmp.path);
    CHECK(staging.tmp_path().filename().string().starts_with("ckpt.tmp-"));
    write_text(staging.tmp_path() / "manifest.json", "first");
    CHECK(!fs::exists(target));
    staging.commit();
    CHECK_THROWS_AS(staging.commit(), dsp::CheckpointError);
  }
  CHECK(read_text(target / "manifest.json") == "first");
  {
    AtomicDir staging(tmp.path.string() + "/ckpt/");  // trailing slash names the same target
    CHECK(staging.target() == target);
    write_text(staging.tmp_path() / "b.txt", "second");
    staging.commit();
  }
  CHECK(!fs::exists(target / "manifest.json"));
  CHECK(read_text(target / "b.txt") == "second");
  CHECK(tmp.names() == std::vector<std::string>{"ckpt"});
}

TEST_CASE("AtomicDir destroyed without commit removes its temporary directory only") {
  TempDir tmp;
  const auto target = tmp / "ckpt";
  fs::create_directories(target);
  write_text(target / "manifest.json", "old");
  CHECK_THROWS_AS(
      [&] {
        AtomicDir staging(target);
        write_text(staging.tmp_path() / "manifest.json", "new");
        throw std::runtime_error("writer failed");
      }(),
      std::runtime_error);
  CHECK(read_text(target / "manifest.json") == "old");
  CHECK(tmp.names() == std::vector<std::string>{"ckpt"});
}

TEST_CASE("a directory that is not a checkpoint is never replaced") {
  TempDir tmp;
  const std::filesystem::path target = tmp.path / "precious";
  std::filesystem::create_directories(target / "sub");
  { std::ofstream(target / "sub" / "notes.txt") << "keep me"; }
  CHECK_THROWS_WITH_AS([&] { AtomicDir staging(target); }(),
                       doctest::Contains("it exists and is not a checkpoint (no manifest.json)"),
                       dsp::CheckpointError);
  CHECK(std::filesystem::exists(target / "sub" / "notes.txt"));
}

}  // namespace checkpoint_atomic_dir_test
