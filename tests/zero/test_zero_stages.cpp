// ZeRO stages 1, 2 and 3 against plain data parallelism (stage 0) on the same layout: the
// same losses, gradient norms and parameters after 10 steps, at DP 4, TP 2 x DP 4, PP 2 x DP 4
// (tied embeddings over the stages), with gradient accumulation, overlapped reduction, an
// interleaved schedule, full recomputation and a DeepSeekMoE model with EP 2; checkpoints
// saved at one stage and DP size resume at another; bf16 reduction on a group of one rounds
// nothing; a rank failing in a stage-3 step (parameter prefetches in flight elsewhere) ends
// every rank with its message.
// Tolerance 1e-6 relative (fp32), norm-wise over every parameter: a stage changes only which
// rank runs Adam on an element (the same arithmetic on the same values) and reduce-scatter
// instead of all-reduce (ThreadComm sums ranks in rank order in both), so the values agree to
// the rounding of a few operations per step. Observed: 0 (bitwise) on the same layout; ~1e-8
// for the checkpoint resumed at DP 1 and DP 2 (other summation order of the DP sum).
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <unistd.h>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/checkpointing.hpp"
#include "dsp/train/trainer.hpp"
#include "../train/small_model.hpp"
#include "../train/small_train_config.hpp"
#include "run_result.hpp"

using namespace dsp;

namespace zero_zero_stages_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

using test::RunResult;

struct Layout {
  int tp = 1, pp = 1, dp = 4, ep = 1;
  int zero = 0;
  bool overlap = false;
  std::int64_t global_batch = 8;
  std::int64_t layers_per_virtual_stage = 0;
  bool full_recompute = false;
};

train::TrainConfig train_config(const Layout& l, int steps) {
  train::TrainConfig tc = test::small_train_config(l.global_batch, steps);
  tc.ddp.overlap_grad_reduce = l.overlap;
  tc.pipeline.num_layers_per_virtual_stage = l.layers_per_virtual_stage;
  tc.zero_stage = l.zero;
  if (l.full_recompute) tc.recompute = model::RecomputeConfig::from_names("full", "uniform", 1);
  return tc;
}

RunResult run(const Layout& l, const model::ModelConfig& config, int steps) {
  const train::TrainConfig tc = train_config(l, steps);
  RunResult out;
  std::mutex mu;
  comm::launch(l.tp * l.pp * l.dp, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = l.tp, .pipeline = l.pp, .data = l.dp, .expert = l.ep});
    train::Trainer<P> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
    test::train_and_collect(trainer, mesh, steps, l.ep, mu, out);
  });
  return out;
}

}  // namespace

TEST_CASE("ZeRO 1, 2 and 3 give plain data parallelism's losses, norms, parameters and moments (DP 4, TP 2, PP 2)") {
  const int steps = 10;
  for (Layout l : {Layout{}, Layout{.tp = 2}, Layout{.pp = 2}, Layout{.overlap = true, .global_batch = 16}}) {
    const model::ModelConfig config = test::small_model(/*tied=*/l.pp > 1);
    const RunResult ref = run(l, config, steps);
    CHECK(ref.losses.back() < ref.losses.front());  // it learns
    for (int stage : {1, 2, 3}) {
      CAPTURE(l.tp);
      CAPTURE(l.pp);
      CAPTURE(l.global_batch);
      CAPTURE(stage);
      l.zero = stage;
      test::check_same(run(l, config, steps), ref);
      l.zero = 0;
    }
  }
}

TEST_CASE("ZeRO 3 with an interleaved schedule, full recomputation and tied embeddings over stages") {
  // 4 layers on PP 2 with 2 virtual stages each, DP 2, 2 micro-batches per step: parameters are
  // gathered per part in forward, backward and the recomputation of each layer.
  auto config = test::small_model(true);
  config.num_layers = 4;
  Layout l{.pp = 2, .dp = 2, .layers_per_virtual_stage = 1, .full_recompute = true};
  const RunResult ref = run(l, config, 6);
  l.zero = 3;
  test::check_same(run(l, config, 6), ref);
}

TEST_CASE("ZeRO with expert parallelism: routed experts partitioned over the expert-data-parallel group") {
  const auto config = test::small_moe_model();
  Layout l{.dp = 4, .ep = 2};
  const RunResult ref = run(l, config, 6);
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    l.zero = stage;
    test::check_same(run(l, config, 6), ref);
  }
}

TEST_CASE("a checkpoint saved at ZeRO 3 on DP 4 resumes at ZeRO 1 on DP 2 and ZeRO 0 on DP 1") {
  // The files hold whole tensors (no partition padding: loading checks every shape), so the
  // resumed runs continue the uninterrupted ZeRO 0 / DP 4 run.
  const auto config = test::small_model();
  const int first = 3, total = 6;
  const RunResult ref = run(Layout{}, config, total);
  const auto dir = std::filesystem::temp_directory_path() / ("dsp_zero_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  {
    const train::TrainConfig tc = train_config(Layout{.zero = 3}, total);
    comm::launch(4, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.data = 4});
      train::Trainer<P> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
      for (int s = 0; s < first; ++s) trainer.train_step();
      train::save_checkpoint(dir, trainer);
    });
  }
  for (Layout l : {Layout{.dp = 2, .zero = 1}, Layout{.dp = 1, .zero = 0}, Layout{.dp = 4, .zero = 2}}) {
    CAPTURE(l.dp);
    CAPTURE(l.zero);
    const train::TrainConfig tc = train_config(l, total);
    RunResult r;
    std::mutex mu;
    comm::launch(l.dp, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.data = l.dp});
      train::Trainer<P> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
      train::load_checkpoint(dir, trainer);
      test::train_and_collect(trainer, mesh, total - first, 1, mu, r);
    });
    RunResult tail = ref;
    tail.losses.erase(tail.losses.begin(), tail.losses.begin() + first);
    tail.grad_norms.erase(tail.grad_norms.begin(), tail.grad_norms.begin() + first);
    test::check_same(r, tail);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("bad --zero-stage is refused with the value") {
  comm::launch(1, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{});
    train::TrainConfig tc;
    tc.zero_stage = 4;
    CHECK_THROWS_WITH_AS(train::Trainer<P>(test::small_model(), tc, mesh, test::shakespeare(16)),
                         "--zero-stage must be 0, 1, 2 or 3, got 4", ConfigError);
  });
}

TEST_CASE("bf16 gradient reduction on a group of one rank rounds nothing at any stage (DP 1)") {
  // Nothing travels over a group of one, so no stage rounds the gradients to bf16 there.
  const auto config = test::small_model();
  std::vector<double> losses[2];
  for (int stage : {0, 1}) {
    auto tc = train_config(Layout{.dp = 1, .zero = stage}, 4);
    tc.ddp.grad_reduce_dtype = dp::GradReduceDType::Bf16;
    comm::launch(1, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{});
      train::Trainer<P> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
      for (int s = 0; s < 4; ++s) losses[stage].push_back(trainer.train_step().grad_norm);
    });
  }
  CHECK(losses[0] == losses[1]);
}

TEST_CASE("a bad token id met by one rank during a ZeRO 3 step ends every rank with its message") {
  // Rank 0's data window holds a byte outside the vocabulary (127 of 127); the other ranks may be
  // waiting on a parameter prefetch when the communicator aborts, which must not end in
  // std::terminate from a destructor.
  std::string text(4000, 'a');
  for (std::size_t i = 0; i < text.size(); i += 7) text[i] = char('a' + i % 26);
  for (std::size_t i = 1000; i < text.size(); i += 400) text[i] = char(0x7F);
  const auto path = std::filesystem::temp_directory_path() / ("dsp_zero_bad_" + std::to_string(::getpid()) + ".txt");
  {
    std::ofstream(path, std::ios::binary) << text;
  }
  const auto data = train::TokenDataset::from_file(path, 16);
  std::filesystem::remove(path);
  for (Layout l : {Layout{.tp = 2, .dp = 2, .zero = 3}, Layout{.pp = 2, .dp = 2, .zero = 3, .overlap = true}}) {
    CAPTURE(l.tp);
    CAPTURE(l.pp);
    const auto tc = train_config(l, 40);
    CHECK_THROWS_WITH_AS(comm::launch(l.tp * l.pp * l.dp,
                                      [&](comm::ThreadComm& world) {
                                        DeviceMesh mesh(world, ParallelLayout{.tensor = l.tp, .pipeline = l.pp, .data = l.dp});
                                        train::Trainer<P> trainer(test::small_model(), tc, mesh, data);
                                        for (int s = 0; s < 40; ++s) trainer.train_step();
                                      }),
                         doctest::Contains("outside the vocabulary"), InputError);
  }
}

}  // namespace zero_zero_stages_test
