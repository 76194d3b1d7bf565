// save_iteration / load_checkpoint on a run's folder of iter_* checkpoints with a real trainer:
// retention over five saves, and a process killed (SIGKILL) at every file boundary of a save
// at TP2 x DP2 never loses the previous iteration, which then loads and resumes exactly; the
// next save leaves no .tmp-/.old- folder behind.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <filesystem>
#include <random>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/checkpointing.hpp"
#include "../checkpoint/fixture.hpp"
#include "small_model.hpp"
#include "small_train_config.hpp"

using namespace dsp;

namespace train_save_iteration_test {
using P = Policy<backend::Host, comm::ThreadComm>;
namespace fs = std::filesystem;
using checkpoint_test::TempDir;

namespace {

// Loads `load` (when given), trains `steps` steps, saving each to `save` with `retain`; returns
// rank 0's losses.
std::vector<double> run(int tp, int dp, int steps, const fs::path& load, const fs::path& save, std::int64_t retain = 0) {
  const auto& data = test::shakespeare(test::small_model().seq_length);
  std::vector<double> losses;
  comm::launch(tp * dp, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = tp, .data = dp});
    train::Trainer<P> trainer(test::small_model(), test::small_train_config(8, 12), mesh, data);
    if (!load.empty()) train::load_checkpoint(load, trainer);
    std::vector<double> mine;
    for (int s = 0; s < steps; ++s) {
      mine.push_back(trainer.train_step().loss);
      if (!save.empty()) train::save_iteration(save, trainer, retain);
    }
    if (world.rank() == 0) losses = mine;
  });
  return losses;
}

std::atomic<int> points{0};
int kill_at = 0;  // the save point at which the child kills itself (0: count only)

void on_save_point(const char*) {
  if (++points == kill_at) std::raise(SIGKILL);
}

std::vector<std::string> names(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("--save-retain 2 over five saves keeps iterations 4 and 5, and the tracker names 5") {
  TempDir dir;
  run(1, 1, 5, {}, dir.path, 2);
  CHECK(checkpoint::saved_iterations(dir.path) == std::vector<std::int64_t>{4, 5});
  CHECK(checkpoint::read_tracker(dir.path) == 5);
  CHECK(names(dir.path) == std::vector<std::string>{"iter_0000004", "iter_0000005", "latest_checkpointed_iteration.txt"});
}

TEST_CASE("a kill -9 at any file boundary of a save never loses the previous iteration") {
  TempDir base;
  const auto full = run(2, 2, 3, {}, {});
  run(2, 2, 1, {}, base.path);  // iteration 1
  // Count the save points of saving iteration 2 (files closed, folders and tracker renamed).
  TempDir counting;
  fs::copy(base.path, counting.path, fs::copy_options::recursive);
  checkpoint::detail::save_point_hook = on_save_point;
  points = 0;
  run(2, 2, 1, counting.path, counting.path);
  const int total = points;
  checkpoint::detail::save_point_hook = nullptr;
  MESSAGE("save points of one save at TP2 x DP2: " << total);
  REQUIRE(total >= 10);
  for (int k = 1; k <= total; ++k) {
    CAPTURE(k);
    TempDir dir;
    fs::copy(base.path, dir.path, fs::copy_options::recursive);
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {  // resume iteration 1, train step 2 and save it, killed at point k
      checkpoint::detail::save_point_hook = on_save_point;
      points = 0;
      kill_at = k;
      run(2, 2, 1, dir.path, dir.path);
      _exit(0);
    }
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    REQUIRE(WIFSIGNALED(status));
    CHECK(WTERMSIG(status) == SIGKILL);
    // The tracker names a complete checkpoint: 1, or 2 once the tracker was renamed.
    const auto latest = checkpoint::read_tracker(dir.path);
    REQUIRE(latest.has_value());
    CHECK(*latest == (k == total ? 2 : 1));
    const auto rest = run(2, 2, 3 - static_cast<int>(*latest), dir.path, dir.path);  // loads, trains on, saves
    for (std::size_t s = 0; s < rest.size(); ++s) CHECK(rest[s] == full[static_cast<std::size_t>(*latest) + s]);
    CHECK(names(dir.path) == std::vector<std::string>{"iter_0000001", "iter_0000002", "iter_0000003",
                                                      "latest_checkpointed_iteration.txt"});
  }
}

}  // namespace train_save_iteration_test
