// The trainer over NcclComm, one GPU per rank (up to 2; with one GPU a single rank): the
// gradient buckets' device payloads and ZeRO's reduce-scatter and all-gathers go through NCCL,
// the trainer's host-side sums (tokens, losses, norms) through NcclComm's staged blocking forms.
// Against three fp32 steps of the Host backend on one rank at the same global batch, 1e-5
// relative (train/cuda/test_train_step explains the bound: the backends differ in summation
// order only, and data parallelism adds the order of the gradient sum). Checkpoints saved and
// loaded over NcclComm (its staged broadcasts and barriers) resume the same run.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <mutex>
#include <vector>

#include "../../checkpoint/fixture.hpp"

#include "../small_model.hpp"
#include "../small_train_config.hpp"
#include "dsp/backend/cuda.hpp"
#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/comm/nccl_comm.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/checkpointing.hpp"
#include "dsp/train/trainer.hpp"

using namespace dsp;

namespace {

struct Steps {
  std::vector<double> losses, grad_norms;
};

// Three steps at DP = ranks with ZeRO `zero_stage`: Backend Host over ThreadComm (ranks = 1), or
// Cuda over NcclComm, rank r on device r. With a `checkpoint` directory: saved there after two
// steps, the third taken by a new trainer that loaded it.
template <class Backend>
Steps train_steps(int ranks, int zero_stage, const std::filesystem::path& checkpoint = {}) {
  const auto config = test::small_model();
  const auto& data = test::shakespeare(config.seq_length);
  train::TrainConfig tc = test::small_train_config(8, 3);
  tc.zero_stage = zero_stage;
  Steps out;
  std::mutex mu;
  comm::launch(ranks, [&](comm::ThreadComm& world) {
    const auto run = [&](auto& rank_comm) {
      using Comm = std::remove_reference_t<decltype(rank_comm)>;
      DeviceMesh<Comm> mesh(rank_comm, ParallelLayout{.data = ranks});
      using T = train::Trainer<Policy<Backend, Comm>>;
      auto trainer = std::make_unique<T>(config, tc, mesh, data);
      Steps s;
      for (int i = 0; i < 3; ++i) {
        if (!checkpoint.empty() && i == 2) {
          train::save_checkpoint(checkpoint, *trainer);
          trainer = std::make_unique<T>(config, tc, mesh, data);
          train::load_checkpoint(checkpoint, *trainer);
        }
        const auto step = trainer->train_step();
        s.losses.push_back(step.loss);
        s.grad_norms.push_back(step.grad_norm);
      }
      std::lock_guard lk(mu);
      if (world.rank() == 0) out = s;
    };
    if constexpr (std::is_same_v<Backend, backend::Host>) {
      comm::ThreadComm rank_comm = world.split(0, world.rank());
      run(rank_comm);
    } else {
      DSP_CUDA_CHECK(cudaSetDevice(world.rank()));
      MemorySpaceScope scope(memory_space(Backend{}));
      comm::NcclComm nccl = comm::NcclComm::create(world, Backend{});
      run(nccl);
    }
  });
  return out;
}

}  // namespace

TEST_CASE("the trainer over NcclComm (device payloads, staged host sums) equals the Host steps within 1e-5") {
  const int ranks = std::min(backend::device_count(), 2);
  const Steps host = train_steps<backend::Host>(1, 0);
  for (int stage : {0, 1, 3}) {
    CAPTURE(stage);
    CAPTURE(ranks);
    const Steps gpu = train_steps<backend::Cuda>(ranks, stage);
    REQUIRE(gpu.losses.size() == host.losses.size());
    for (std::size_t s = 0; s < host.losses.size(); ++s) {
      CAPTURE(s);
      CHECK(std::abs(gpu.losses[s] - host.losses[s]) <= 1e-5 * std::abs(host.losses[s]));
      CHECK(std::abs(gpu.grad_norms[s] - host.grad_norms[s]) <= 1e-5 * std::abs(host.grad_norms[s]));
    }
  }
}

TEST_CASE("checkpoints over NcclComm: saved after two steps and resumed by a new trainer, the third step equals the uninterrupted run within 1e-6") {
  // The same kernels on the same devices at the same sizes: only lost or misplaced state (a
  // moment, the step count, the sampler's position) would change the third step, by far more.
  const int ranks = std::min(backend::device_count(), 2);
  for (int stage : {0, 3}) {
    CAPTURE(stage);
    const Steps straight = train_steps<backend::Cuda>(ranks, stage);
    checkpoint_test::TempDir dir;
    const Steps resumed = train_steps<backend::Cuda>(ranks, stage, dir / "ckpt");
    REQUIRE(resumed.losses.size() == straight.losses.size());
    for (std::size_t s = 0; s < straight.losses.size(); ++s) {
      CAPTURE(s);
      CHECK(std::abs(resumed.losses[s] - straight.losses[s]) <= 1e-6 * std::abs(straight.losses[s]));
      CHECK(std::abs(resumed.grad_norms[s] - straight.grad_norms[s]) <= 1e-6 * std::abs(straight.grad_norms[s]));
    }
  }
}
