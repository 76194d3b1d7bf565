// A run's checkpoint folder as Megatron keeps it (checkpoint/iterations.hpp), on folders made by
// hand: the tracker, which folder a reader opens, the refusal to save over a later iteration,
// retention, leftovers and the recovery of an interrupted re-save.
#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>

#include "dsp/checkpoint/iterations.hpp"
#include "fixture.hpp"

namespace checkpoint_iterations_test {
using namespace checkpoint_test;
namespace ck = dsp::checkpoint;

// A complete checkpoint folder as far as the layout functions look: one with a manifest.json.
void fake_checkpoint(const fs::path& dir) {
  fs::create_directories(dir);
  std::ofstream(dir / "manifest.json") << "{}";
}

TEST_CASE("iteration folders are named as Megatron names them, and the tracker round-trips") {
  CHECK(ck::iteration_folder_name(400) == "iter_0000400");
  CHECK(ck::iteration_folder_name(12345678) == "iter_12345678");
  TempDir d;
  CHECK_FALSE(ck::read_tracker(d.path).has_value());
  ck::write_tracker(d.path, 400);
  CHECK(ck::read_tracker(d.path) == 400);
  CHECK(dsp::checkpoint::read_text(d / ck::tracker_file_name) == "400");
  std::ofstream(d / ck::tracker_file_name) << "release";
  CHECK_THROWS_WITH_AS(ck::read_tracker(d.path), doctest::Contains("expected an iteration number, got 'release'"),
                       dsp::CheckpointError);
}

TEST_CASE("a reader opens one checkpoint as given, else the tracker's iteration, else --ckpt-step's") {
  TempDir d;
  fake_checkpoint(d / "iter_0000002");
  fake_checkpoint(d / "iter_0000004");
  fs::create_directories(d / "iter_0000006");  // no manifest: incomplete
  CHECK(ck::saved_iterations(d.path) == std::vector<std::int64_t>{2, 4});
  CHECK(ck::resolve_checkpoint(d.path) == d / "iter_0000004");  // no tracker: the newest complete
  ck::write_tracker(d.path, 2);
  CHECK(ck::resolve_checkpoint(d.path) == d / "iter_0000002");
  CHECK(ck::resolve_checkpoint(d.path, 4) == d / "iter_0000004");
  CHECK(ck::resolve_checkpoint(d / "iter_0000004") == d / "iter_0000004");
  CHECK_THROWS_WITH_AS(ck::resolve_checkpoint(d.path, 6),
                       doctest::Contains("no complete checkpoint of iteration 6 (--ckpt-step); it holds iterations 2, 4"),
                       dsp::CheckpointError);
  ck::write_tracker(d.path, 8);
  CHECK_THROWS_WITH_AS(ck::resolve_checkpoint(d.path), doctest::Contains("iteration 8 (named by latest_checkpointed"),
                       dsp::CheckpointError);
  TempDir empty;
  CHECK_THROWS_WITH_AS(ck::resolve_checkpoint(empty.path), doctest::Contains("not a checkpoint"), dsp::CheckpointError);
}

TEST_CASE("saving into a folder that holds a later iteration is refused naming both") {
  TempDir d;
  ck::check_save_root(d / "missing", 2);
  ck::check_save_root(d.path, 2);  // empty
  fake_checkpoint(d / "iter_0000400");
  ck::write_tracker(d.path, 400);
  CHECK_THROWS_WITH_AS(ck::check_save_root(d.path, 2),
                       doctest::Contains("holds iteration 400, and this run would write iteration 2"),
                       dsp::CheckpointError);
  CHECK_THROWS_AS(ck::check_save_root(d.path, 400), dsp::CheckpointError);  // would be replaced
  ck::check_save_root(d.path, 401);                                          // a resumed run
  CHECK_THROWS_WITH_AS(ck::check_save_root(d / "iter_0000400", 500), doctest::Contains("is a single checkpoint"),
                       dsp::CheckpointError);
}

TEST_CASE("retention keeps the newest N and the tracker's; leftovers go; an interrupted re-save is undone") {
  TempDir d;
  for (int i = 1; i <= 5; ++i) fake_checkpoint(d / ck::iteration_folder_name(i));
  ck::write_tracker(d.path, 5);
  ck::retain_newest(d.path, 2);
  CHECK(ck::saved_iterations(d.path) == std::vector<std::int64_t>{4, 5});
  ck::write_tracker(d.path, 4);  // e.g. --overwrite-checkpoints wrote an earlier iteration last
  fake_checkpoint(d / "iter_0000006");
  ck::retain_newest(d.path, 1);
  CHECK(ck::saved_iterations(d.path) == std::vector<std::int64_t>{4, 6});

  // A re-save of iteration 4 killed between its renames: iter_0000004 is aside as .old-, the new
  // one still .tmp-; and a stale .tmp- of another save. Unrelated files are never touched.
  fs::rename(d / "iter_0000004", d / "iter_0000004.old-0123456789abcdef");
  fake_checkpoint(d / "iter_0000004.tmp-fedcba9876543210");
  fs::create_directories(d / "iter_0000007.tmp-0000000000000001");
  std::ofstream(d / "notes.txt") << "mine";
  CHECK(ck::resolve_checkpoint(d.path) == d / "iter_0000004");  // recovered on load
  CHECK(fs::exists(d / "iter_0000004" / "manifest.json"));
  ck::remove_leftovers(d.path);
  auto names = d.names();
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"iter_0000004", "iter_0000006", "latest_checkpointed_iteration.txt", "notes.txt"});
}

}  // namespace checkpoint_iterations_test
