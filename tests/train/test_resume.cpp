// Resume: stopping after N steps, saving, and resuming in a fresh Trainer gives exactly the
// losses of an uninterrupted run (same layout and thread counts: bitwise equal, because
// parameters, AdamW moments and step, LR position and data position are all restored and
// every operation is deterministic). Also: resuming at another TP size continues with the
// same losses to the layout-invariance tolerance. The same bitwise resume for an MLA +
// DeepSeekMoE model (DeepSeek-V3's attention, its expert bias a saved buffer) at TP2 x EP2.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <random>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/checkpointing.hpp"
#include "small_model.hpp"

using namespace dsp;

namespace train_resume_test {
using P = Policy<backend::Host, comm::ThreadComm>;
namespace fs = std::filesystem;

namespace {


train::TrainConfig train_config() {
  train::TrainConfig tc;
  tc.micro_batch_size = 2;
  tc.global_batch_size = 8;
  tc.train_iters = 12;
  tc.lr = 3e-3f;
  tc.lr_warmup_iters = 3;
  return tc;
}

// The small DeepSeekMoE model with MLA (query and KV latents, decoupled RoPE key, YaRN) and
// V3's router (sigmoid, expert bias).
model::ModelConfig mla_moe_model() {
  auto c = test::with_mla(test::small_moe_model());
  c.moe_router_score_function = ep::ScoreFunction::Sigmoid;
  c.moe_router_enable_expert_bias = true;
  return c;
}

// Runs `steps` steps of `config` at (tp, dp, ep), loading from `load` first and saving to
// `save` after.
std::vector<double> run(int tp, int dp, int steps, const fs::path& load, const fs::path& save,
                        const model::ModelConfig& config = test::small_model(), int ep = 1) {
  const auto& data = test::shakespeare(config.seq_length);
  std::vector<double> losses;
  comm::launch(tp * dp, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = tp, .data = dp, .expert = ep});
    train::Trainer<P> trainer(config, train_config(), mesh, data);
    if (!load.empty()) train::load_checkpoint(load, trainer);
    std::vector<double> mine;
    for (int s = 0; s < steps; ++s) mine.push_back(trainer.train_step().loss);
    if (!save.empty()) train::save_checkpoint(save, trainer);
    if (world.rank() == 0) losses = mine;
  });
  return losses;
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("dsp_resume_" + std::to_string(std::random_device{}()));
  ~TempDir() { fs::remove_all(path); }
};

}  // namespace

TEST_CASE("resume after N steps equals the uninterrupted run exactly") {
  TempDir dir;
  const auto full = run(2, 2, 12, {}, {});
  const auto first = run(2, 2, 5, {}, dir.path);
  const auto rest = run(2, 2, 7, dir.path, {});
  REQUIRE(first.size() == 5);
  REQUIRE(rest.size() == 7);
  for (int s = 0; s < 5; ++s) CHECK(first[s] == full[s]);
  for (int s = 0; s < 7; ++s) CHECK(rest[s] == full[5 + s]);
}

TEST_CASE("resume of an MLA + DeepSeekMoE model at TP2 x EP2 equals the uninterrupted run exactly") {
  TempDir dir;
  const auto config = mla_moe_model();
  const auto full = run(2, 2, 8, {}, {}, config, 2);
  const auto first = run(2, 2, 3, {}, dir.path, config, 2);
  const auto rest = run(2, 2, 5, dir.path, {}, config, 2);
  REQUIRE(first.size() == 3);
  REQUIRE(rest.size() == 5);
  for (int s = 0; s < 3; ++s) CHECK(first[s] == full[s]);
  for (int s = 0; s < 5; ++s) CHECK(rest[s] == full[3 + s]);
}

TEST_CASE("resume at another tensor-parallel size continues with the same losses") {
  TempDir dir;
  const auto full = run(2, 1, 12, {}, {});
  run(2, 1, 6, {}, dir.path);
  const auto rest = run(4, 1, 6, dir.path, {});  // loaded through the manifest at TP4
  for (int s = 0; s < 6; ++s) CHECK(std::abs(rest[s] - full[6 + s]) <= 1e-5 * full[6 + s]);
}

TEST_CASE("loading a checkpoint of another model config is refused with a clear message") {
  TempDir dir;
  run(1, 1, 1, {}, dir.path);
  auto other = test::small_model();
  other.rope_theta = 500000.0f;  // same shapes, different model
  const auto& data = test::shakespeare(other.seq_length);
  CHECK_THROWS_WITH_AS(comm::launch(1,
                                    [&](comm::ThreadComm& world) {
                                      DeviceMesh mesh(world, ParallelLayout{});
                                      train::Trainer<P> trainer(other, train_config(), mesh, data);
                                      train::load_checkpoint(dir.path, trainer);
                                    }),
                       doctest::Contains("another model config: rope_theta"), CheckpointError);
}

}  // namespace train_resume_test
