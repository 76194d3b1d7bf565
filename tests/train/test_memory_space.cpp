// Training with every tensor in a memory space the host may not touch (test::GuardedSpace: host
// memory underneath, refused by Tensor's host accessors like GPU memory): the model, the
// optimizer and the trainer reach elements only through ops, communicators and explicit copies,
// which is what running on a GPU needs. The steps must equal the same run in host memory
// bitwise: the same host ops run on the same values, only the allocation differs.
#include <doctest/doctest.h>

#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/comm/staging_comm.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/checkpointing.hpp"
#include "dsp/train/trainer.hpp"
#include "../checkpoint/fixture.hpp"
#include "../guarded_space.hpp"
#include "small_model.hpp"
#include "small_train_config.hpp"

using namespace dsp;

namespace train_memory_space_test {

namespace {

struct Run {
  std::vector<double> losses, grad_norms;
  int skipped = 0;  // steps skipped by loss scaling
  double validation_loss = 0.0;
  std::map<std::string, std::vector<float>> params;  // the last rank's shards, copied to the host
  std::int64_t space_allocations = 0;
  std::int64_t host_moment_bytes = 0, space_moment_bytes = 0;  // OptimizerState, after the steps
  std::int64_t pinned_moment_bytes = 0, pinned_bytes = 0;        // in the pinned space: OptimizerState, all
  std::int64_t host_communication_peak = 0, space_communication_peak = 0;  // bytes: buckets' payloads, gathers
  bool every_parameter_in_space = true;
  memory::Snapshot step_memory;  // the last step's StepResult::memory (where the tensors live)
  std::int64_t step_host_activation_peak = 0;  // the last step's StepResult::host_memory
};

// Spaces of failed runs, never destroyed (reachable, so not a leak): their tensors are freed at
// process exit through them.
void keep_until_exit(std::unique_ptr<test::GuardedSpace> space) {
  static std::mutex mu;
  static auto* kept = new std::vector<std::unique_ptr<test::GuardedSpace>>;
  std::lock_guard lock(mu);
  kept->push_back(std::move(space));
}

// A GuardedSpace with a guarded pinned host space (what ZeRO-Offload's state goes to).
struct Spaces {
  std::unique_ptr<test::GuardedSpace> pinned = std::make_unique<test::GuardedSpace>();
  std::unique_ptr<test::GuardedSpace> device = [this] {
    auto d = std::make_unique<test::GuardedSpace>();
    d->pinned = pinned.get();
    return d;
  }();
};

// Trains `steps` steps at TP x PP x DP (ZeRO `zero_stage`), every tensor in a GuardedSpace
// when `guarded`; the ranks' communicator is Comm (ThreadComm, or StagingComm over it, which
// copies tensors of the space to host buffers around every operation). With a `checkpoint`
// directory it saves there after `checkpoint_after` steps and goes on with a new trainer that
// loaded it.
// An MoE model (`moe`: its config and options) is split over ep expert-parallel ranks.
struct MoeRun {
  model::ModelConfig config;
  ep::MoeOptions options;
  int ep = 1;
};

template <class Comm = comm::ThreadComm, class Precision = precision::Fp32>
Run train_run(bool guarded, int tp, int pp, int dp, int steps, int zero_stage = 0, bool loss_scaling = false,
              double offload_ratio = 0.0, dp::GradReduceDType grad_reduce_dtype = dp::GradReduceDType::Fp32,
              const std::filesystem::path& checkpoint = {}, int checkpoint_after = 0,
              const std::optional<MoeRun>& moe = std::nullopt) {
  using P = Policy<backend::Host, Comm, Precision>;
  const auto config = moe ? moe->config : test::small_model();
  const auto& data = test::shakespeare(config.seq_length);
  train::TrainConfig tc = test::small_train_config(8, steps);
  if (moe) tc.moe = moe->options;
  tc.zero_stage = zero_stage;
  if (loss_scaling) tc.loss_scaler.emplace();  // dynamic; an infinity is injected at step 2 (below)
  tc.offload_ratio = offload_ratio;
  tc.ddp.grad_reduce_dtype = grad_reduce_dtype;
  Run out;
  std::mutex mu;
  comm::launch(tp * pp * dp, [&](comm::ThreadComm& world) {
    // A failing rank keeps its optimizer's tensors until process exit, freed through their
    // space then: on that path the space must outlive the run.
    Spaces spaces;
    test::GuardedSpace* space = spaces.device.get();
    try {
      MemorySpaceScope scope(guarded ? space : nullptr);
      Comm rank_comm = [&] {
        if constexpr (std::is_same_v<Comm, comm::ThreadComm>) return world.split(0, world.rank());
        else return Comm(world.split(0, world.rank()));
      }();
      DeviceMesh mesh(rank_comm, ParallelLayout{.tensor = tp, .pipeline = pp, .data = dp, .expert = moe ? moe->ep : 1});
      auto trainer_ptr = std::make_unique<train::Trainer<P>>(config, tc, mesh, data);
      Run r;
      int step = 0;
      if (loss_scaling)  // the test writes the gradient's memory directly: GuardedSpace is host memory underneath
        trainer_ptr->set_grad_hook([&](train::Trainer<P>& t) {
          using G = std::remove_reference_t<decltype(t.optimizer().gradient(0)[0])>;  // float, bf16, fp16
          if (step == 1) t.optimizer().gradient(0)[0] = G(std::numeric_limits<float>::infinity());
        });
      for (int s = 0; s < steps; ++s, ++step) {
        if (!checkpoint.empty() && s == checkpoint_after) {  // save, then resume in a new trainer
          train::save_checkpoint(checkpoint, *trainer_ptr);
          trainer_ptr = std::make_unique<train::Trainer<P>>(config, tc, mesh, data);
          train::load_checkpoint(checkpoint, *trainer_ptr);
        }
        const auto step = trainer_ptr->train_step();
        r.losses.push_back(step.loss);
        r.grad_norms.push_back(step.skipped ? -1.0 : step.grad_norm);  // a skipped step's norm is NaN
        r.skipped += step.skipped ? 1 : 0;
        r.step_memory = step.memory;
        r.step_host_activation_peak = step.host_memory[memory::Category::Activations].peak;
      }
      auto& trainer = *trainer_ptr;
      r.validation_loss = trainer.evaluate();  // forward only, stage after stage
      trainer.optimizer().gather_for_checkpoint();  // ZeRO stage 3: the whole parameters, all-gathered
      for (auto* p : trainer.parameters()) {
        const Tensor host = p->value.to_host();
        r.params[p->spec.name].assign(host.values().begin(), host.values().end());
        r.every_parameter_in_space =
            r.every_parameter_in_space && p->value.space() == (guarded ? space : nullptr);
      }
      trainer.optimizer().partition_after_checkpoint(false);
      r.space_allocations = space->allocations;
      r.host_moment_bytes = memory::snapshot()[memory::Category::OptimizerState].live;
      r.space_moment_bytes = space->counters[memory::Category::OptimizerState].live;
      r.pinned_moment_bytes = spaces.pinned->counters[memory::Category::OptimizerState].live;
      r.pinned_bytes = spaces.pinned->counters.total.live;
      r.host_communication_peak = memory::snapshot()[memory::Category::Communication].peak;
      r.space_communication_peak = space->counters[memory::Category::Communication].peak;
      std::lock_guard lk(mu);
      if (world.rank() == world.size() - 1) out = std::move(r);  // the last stage reports the loss
    } catch (...) {
      keep_until_exit(std::move(spaces.device));
      keep_until_exit(std::move(spaces.pinned));
      throw;
    }
    CHECK(space->counters.total.live == 0);  // every tensor of the spaces was freed through them
    CHECK(spaces.pinned->counters.total.live == 0);
  });
  return out;
}

// Bitwise the same steps, validation loss and final parameters.
void check_bitwise(const Run& got, const Run& want) {
  CHECK(got.losses == want.losses);
  CHECK(got.grad_norms == want.grad_norms);
  CHECK(got.validation_loss == want.validation_loss);
  CHECK(got.params == want.params);
}

}  // namespace

TEST_CASE("a training step that never touches elements on the host: bitwise the host run, one rank") {
  const Run host = train_run(false, 1, 1, 1, 3), guarded = train_run(true, 1, 1, 1, 3);
  CHECK(guarded.every_parameter_in_space);
  CHECK(guarded.space_allocations > 0);
  CHECK(host.every_parameter_in_space);  // null space: host memory
  check_bitwise(guarded, host);
  // StepResult::memory counts where the tensors live: the space's counters hold what the host
  // run's host counters hold, for the model state and the activations (the same tensors are
  // made in the same order; Workspace differs: the space also holds copies of token ids and
  // targets), and the host counters of the guarded run see only small host copies (a loss's
  // inputs: hundreds of bytes, against tens of kilobytes of activations).
  for (auto c : {memory::Category::Parameters, memory::Category::Gradients, memory::Category::OptimizerState,
                 memory::Category::Activations}) {
    CAPTURE(memory::name(c));
    CHECK(guarded.step_memory[c].live == host.step_memory[c].live);
    CHECK(guarded.step_memory[c].peak == host.step_memory[c].peak);
  }
  CHECK(host.step_memory[memory::Category::Activations].peak > 0);
  CHECK(guarded.step_host_activation_peak * 100 < host.step_memory[memory::Category::Activations].peak);
}

TEST_CASE("the same with dynamic loss scaling: the overflow check copies gradients to the host explicitly") {
  const Run host = train_run(false, 1, 1, 1, 4, 0, true), guarded = train_run(true, 1, 1, 1, 4, 0, true);
  CHECK(host.skipped == 1);  // the injected infinity was found
  CHECK(guarded.skipped == 1);
  CHECK(guarded.losses == host.losses);
  CHECK(guarded.grad_norms == host.grad_norms);
  CHECK(guarded.params == host.params);
}

TEST_CASE("optimizer offload: half the state in pinned host memory, updated by the CPU, bitwise the run without offload") {
  const Run host = train_run(false, 1, 1, 1, 3), offloaded = train_run(true, 1, 1, 1, 3, 0, false, 0.5);
  CHECK(offloaded.losses == host.losses);
  CHECK(offloaded.grad_norms == host.grad_norms);
  CHECK(offloaded.params == host.params);
  // The moments (2 x 4 bytes per element) split at the first parameter past half the elements:
  // at least half in the space's pinned host memory, and the rest in the space.
  const std::int64_t total = offloaded.pinned_moment_bytes + offloaded.space_moment_bytes;
  CHECK(total == host.host_moment_bytes);
  CHECK(offloaded.pinned_moment_bytes >= total / 2);
  CHECK(offloaded.space_moment_bytes > 0);
  CHECK(offloaded.host_moment_bytes == 0);
  // pinned too: a host copy of each offloaded slice's values and gradient (4 bytes each per
  // element, as many bytes as the two moments), allocated once
  CHECK(offloaded.pinned_bytes == 2 * offloaded.pinned_moment_bytes);
  const Run all = train_run(true, 1, 1, 1, 3, 0, false, 1.0);
  CHECK(all.space_moment_bytes == 0);
  check_bitwise(all, host);
  CHECK_THROWS_WITH_AS(train_run(false, 1, 1, 1, 1, 0, false, 1.5), doctest::Contains("offload ratio"), ConfigError);
}

TEST_CASE("the same at TP=2 x PP=2: collectives and pipeline transfers read tensors only through communicators") {
  const Run host = train_run(false, 2, 2, 1, 2), guarded = train_run(true, 2, 2, 1, 2);
  CHECK(guarded.every_parameter_in_space);
  check_bitwise(guarded, host);
}

TEST_CASE("StagingComm (the shared-device path): TP=2 x DP=2 and PP=2 x DP=2 through host copies, bitwise the host run") {
  using Staging = comm::StagingComm<comm::ThreadComm>;
  for (auto [tp, pp] : {std::pair{2, 1}, std::pair{1, 2}}) {
    CAPTURE(tp);
    CAPTURE(pp);
    const Run host = train_run(false, tp, pp, 2, 2), staged = train_run<Staging>(true, tp, pp, 2, 2);
    CHECK(staged.every_parameter_in_space);
    check_bitwise(staged, host);
  }
}

TEST_CASE("ZeRO stages 1-3 at DP=2: packing, reduce-scatter, the sharded update and the all-gathers stay in the space; bitwise the host run") {
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    const Run host = train_run(false, 1, 1, 2, 2, stage), guarded = train_run(true, 1, 1, 2, 2, stage);
    CHECK(guarded.every_parameter_in_space);
    check_bitwise(guarded, host);
    // the payloads and gather buffers were in the space, none on the host (the host peak is
    // the last step's, the space's over the whole run)
    CHECK(host.host_communication_peak > 0);
    CHECK(guarded.space_communication_peak >= host.host_communication_peak);
    CHECK(guarded.host_communication_peak == 0);
  }
}

TEST_CASE("ZeRO stage 2 with dynamic loss scaling: the overflow check copies the reduced slices out of the space") {
  const Run host = train_run(false, 1, 1, 2, 4, 2, true), guarded = train_run(true, 1, 1, 2, 4, 2, true);
  CHECK(host.skipped == 1);
  CHECK(guarded.skipped == 1);
  check_bitwise(guarded, host);
}

TEST_CASE("ZeRO through StagingComm, with TP and PP (stage 2 at PP=2 x DP=2, stage 3 at TP=2 x DP=2); bitwise the host run") {
  using Staging = comm::StagingComm<comm::ThreadComm>;
  for (auto [tp, pp, stage] : {std::tuple{1, 2, 2}, std::tuple{2, 1, 3}}) {
    CAPTURE(tp);
    CAPTURE(pp);
    const Run host = train_run(false, tp, pp, 2, 2, stage), staged = train_run<Staging>(true, tp, pp, 2, 2, stage);
    CHECK(staged.every_parameter_in_space);
    check_bitwise(staged, host);
  }
}

TEST_CASE("ZeRO stages 1-3 with half the optimizer state offloaded: the owned slices are copied out and back; bitwise the host run") {
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    const Run host = train_run(false, 1, 1, 2, 2, stage), offloaded = train_run(true, 1, 1, 2, 2, stage, false, 0.5);
    check_bitwise(offloaded, host);
    CHECK(offloaded.pinned_moment_bytes > 0);
    CHECK(offloaded.space_moment_bytes > 0);
  }
}

TEST_CASE("DeepSeekMoE layers in the space: routing on the host from copied logits, token rows moved in the space; bitwise the host run") {
  // Both routers of the layout-invariance test: softmax with renormalised weights, the aux loss
  // and a capacity that drops tokens (DeepSeek-V2); sigmoid with the expert bias updated every
  // step, group-limited (DeepSeek-V3). One rank, then TP=2 x EP=2 (DP=2) over ThreadComm and
  // EP=2 x DP=2 through StagingComm (the all-to-alls staged through host copies).
  using Staging = comm::StagingComm<comm::ThreadComm>;
  for (bool v3 : {false, true}) {
    CAPTURE(v3);
    MoeRun moe{test::small_moe_model(), {}, 1};
    if (v3) {
      moe.config.moe_router_score_function = ep::ScoreFunction::Sigmoid;
      moe.config.moe_router_enable_expert_bias = true;
      moe.config.moe_router_num_groups = 4;
      moe.config.moe_router_group_topk = 2;
    } else {
      moe.options.aux_loss_coeff = 0.01f;
      moe.options.capacity_factor = 1.0f;
    }
    const auto run = [&](bool guarded, int tp, int dp, int ep, bool staged) {
      MoeRun m = moe;
      m.ep = ep;
      return staged ? train_run<Staging>(guarded, tp, 1, dp, 3, 0, false, 0.0, dp::GradReduceDType::Fp32, {}, 0, m)
                    : train_run(guarded, tp, 1, dp, 3, 0, false, 0.0, dp::GradReduceDType::Fp32, {}, 0, m);
    };
    for (auto [tp, dp, ep, staged] : {std::tuple{1, 1, 1, false}, std::tuple{2, 2, 2, false}, std::tuple{1, 2, 2, true}}) {
      CAPTURE(tp);
      CAPTURE(ep);
      CAPTURE(staged);
      const Run host = run(false, tp, dp, ep, false), guarded = run(true, tp, dp, ep, staged);
      CHECK(guarded.every_parameter_in_space);
      check_bitwise(guarded, host);
    }
  }
}

TEST_CASE("16-bit gradient transport in the space (--grad-reduce-dtype bf16 / fp16 at DP=2, ZeRO 0-3): rounded and widened by the backend's convert ops; bitwise the host run") {
  for (auto dtype : {dp::GradReduceDType::Bf16, dp::GradReduceDType::Fp16})
    for (int stage : {0, 1, 2, 3}) {  // all-reduce of whole gradients; reduce-scatter into owned slices
      CAPTURE(static_cast<int>(dtype));
      CAPTURE(stage);
      const Run host = train_run(false, 1, 1, 2, 2, stage, false, 0.0, dtype),
                guarded = train_run(true, 1, 1, 2, 2, stage, false, 0.0, dtype);
      check_bitwise(guarded, host);
      CHECK(guarded.host_communication_peak == 0);  // the 16-bit payloads were in the space
      CHECK(guarded.space_communication_peak >= host.host_communication_peak);
      // rounding changed the steps: they are not the fp32 run's
      CHECK(host.params != train_run(false, 1, 1, 2, 2, stage).params);
    }
}

TEST_CASE("mixed precision in the space (bf16 and fp16 parameters, gradients and activations, fp32 master weights) at DP=2, ZeRO 0-3: rounded and widened by the backend's convert ops; bitwise the host run") {
  // fp16 runs with dynamic loss scaling (its default), an infinity injected at step 2: the
  // overflow check reads 16-bit gradients copied out of the space.
  const auto both = [](auto precision, int stage) {
    using Precision = decltype(precision);
    const bool fp16 = Precision::dynamic_loss_scaling;
    const int steps = fp16 ? 3 : 2;
    const Run host = train_run<comm::ThreadComm, Precision>(false, 1, 1, 2, steps, stage, fp16),
              guarded = train_run<comm::ThreadComm, Precision>(true, 1, 1, 2, steps, stage, fp16);
    CHECK(guarded.every_parameter_in_space);
    check_bitwise(guarded, host);
    CHECK(host.skipped == (fp16 ? 1 : 0));
    // 16-bit parameters (2 bytes) in the space, fp32 master weights and moments (12 bytes per
    // owned element) there too, nothing on the host
    CHECK(guarded.space_moment_bytes == host.host_moment_bytes);
    CHECK(guarded.host_moment_bytes == 0);
    CHECK(guarded.host_communication_peak == 0);
    CHECK(host.params != train_run(false, 1, 1, 2, steps, stage, fp16).params);  // not the fp32 run
  };
  for (int stage : {0, 1, 2, 3}) {
    CAPTURE(stage);
    both(precision::Bf16Mixed{}, stage);
    both(precision::Fp16Mixed{}, stage);
  }
}

TEST_CASE("mixed precision in the space with TP=2 x PP=2 through StagingComm, and with half the optimizer state offloaded (ZeRO 0, 2 and 3): the master slices updated in pinned memory, the rounded slices copied back; bitwise the host run") {
  using Bf16 = precision::Bf16Mixed;
  using Staging = comm::StagingComm<comm::ThreadComm>;
  const Run host = train_run<comm::ThreadComm, Bf16>(false, 2, 2, 1, 2),
            staged = train_run<Staging, Bf16>(true, 2, 2, 1, 2);
  CHECK(staged.every_parameter_in_space);
  check_bitwise(staged, host);
  for (int stage : {0, 2, 3}) {
    CAPTURE(stage);
    const Run want = train_run<comm::ThreadComm, Bf16>(false, 1, 1, 2, 2, stage),
              offloaded = train_run<comm::ThreadComm, Bf16>(true, 1, 1, 2, 2, stage, false, 0.5);
    check_bitwise(offloaded, want);
    CHECK(offloaded.pinned_moment_bytes > 0);
    CHECK(offloaded.space_moment_bytes > 0);
    // pinned at stage 0 (no slice padding): the moments and master weights (12 bytes per
    // element), and the copies of the 16-bit gradient (2) and of the rounded slice (2)
    if (stage == 0) CHECK(offloaded.pinned_bytes * 12 == offloaded.pinned_moment_bytes * (12 + 2 + 2));
  }
}

TEST_CASE("checkpoints from and into the space: save after 2 steps, resume in a new trainer; bitwise the uninterrupted host run") {
  // TP=2 at ZeRO 0 (moments whole, rank 0 of DP saves them) and DP=2 at stage 3 (parameters
  // all-gathered for saving, moments partitioned, half offloaded)
  for (auto [tp, dp, stage, offload] : {std::tuple{2, 1, 0, 0.0}, std::tuple{1, 2, 3, 0.5}}) {
    CAPTURE(tp);
    CAPTURE(stage);
    const Run host = train_run(false, tp, 1, dp, 3, stage);
    checkpoint_test::TempDir dir;
    const Run resumed = train_run(true, tp, 1, dp, 3, stage, false, offload, dp::GradReduceDType::Fp32, dir / "ckpt", 2);
    CHECK(resumed.every_parameter_in_space);
    check_bitwise(resumed, host);
  }
  // DeepSeekMoE at EP=2 x DP=2: the routed experts travel to the writer in the space
  MoeRun moe{test::small_moe_model(), {}, 2};
  const Run moe_host = train_run(false, 1, 1, 2, 3, 0, false, 0.0, dp::GradReduceDType::Fp32, {}, 0, moe);
  checkpoint_test::TempDir moe_dir;
  const Run moe_resumed =
      train_run(true, 1, 1, 2, 3, 0, false, 0.0, dp::GradReduceDType::Fp32, moe_dir / "ckpt", 2, moe);
  check_bitwise(moe_resumed, moe_host);
  // bf16 at DP=2, stage 1, half offloaded: the master weights saved (all-gathered from pinned
  // slices through the space) and loaded back into pinned slices and 16-bit storage
  using Bf16 = precision::Bf16Mixed;
  const Run host = train_run<comm::ThreadComm, Bf16>(false, 1, 1, 2, 3, 1);
  checkpoint_test::TempDir dir;
  const Run resumed =
      train_run<comm::ThreadComm, Bf16>(true, 1, 1, 2, 3, 1, false, 0.5, dp::GradReduceDType::Fp32, dir / "ckpt", 2);
  CHECK(resumed.every_parameter_in_space);
  check_bitwise(resumed, host);
}

}  // namespace train_memory_space_test
