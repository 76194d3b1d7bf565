// The trainer over NcclComm, one GPU per rank (up to 2; with one GPU a single rank): the
// gradient buckets' device payloads and ZeRO's reduce-scatter and all-gathers go through NCCL,
// the trainer's host-side sums (tokens, losses, norms) through NcclComm's staged blocking forms.
// Against three fp32 steps of the Host backend on one rank at the same global batch, 1e-5
// relative (train/cuda/test_train_step explains the bound: the backends differ in summation
// order only, and data parallelism adds the order of the gradient sum).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "../small_model.hpp"
#include "../small_train_config.hpp"
#include "dsp/backend/cuda.hpp"
#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/comm/nccl_comm.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/trainer.hpp"

using namespace dsp;

namespace {

struct Steps {
  std::vector<double> losses, grad_norms;
};

// Three steps at DP = ranks with ZeRO `zero_stage`: Backend Host over ThreadComm (ranks = 1), or
// Cuda over NcclComm, rank r on device r.
template <class Backend>
Steps train_steps(int ranks, int zero_stage) {
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
      train::Trainer<Policy<Backend, Comm>> trainer(config, tc, mesh, data);
      Steps s;
      for (int i = 0; i < 3; ++i) {
        const auto step = trainer.train_step();
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
