// A whole training step on the GPU against the same steps on the Host backend (fp32): the
// model's parameters, gradients, activations and optimizer state live in device memory
// (MemorySpaceScope(memory_space(Cuda))), every op is the CUDA one. One rank, and TP=2 / DP=2
// with two ranks sharing the one GPU through StagingComm (the shared-device path), both
// against the Host backend at TP1/DP1; ZeRO stages 1-3 at DP=2 the same way; and a DeepSeekMoE
// model at EP1 and EP2, and with MLA (DeepSeek-V3's attention) at TP1 and TP2; mixed precision (bf16, fp16) against the Host's mixed-precision step.
// Tolerance 1e-5 relative (issue 7's bound): the two backends differ only in summation order
// (cuBLAS's fp32 GEMM, pure fp32 without TF32, against OpenBLAS; fp64 row sums on both) and fused
// multiply-adds, about 1e-7 relative per op; three Adam steps keep that far below 1e-5, as the
// layout-invariance test sees for TP/DP summation orders (~1e-6 after 20 steps).
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../../relative_error.hpp"
#include "../small_model.hpp"
#include "../small_train_config.hpp"
#include "dsp/backend/cuda.hpp"
#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/comm/staging_comm.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/trainer.hpp"

using namespace dsp;

namespace {

struct Run {
  std::vector<double> losses, grad_norms;
  std::map<std::string, std::vector<float>> params;  // copied to the host
  std::int64_t device_parameter_bytes = 0;
  std::int64_t host_state_bytes = 0, device_state_bytes = 0;  // OptimizerState, rank 0
  memory::Snapshot step_memory;  // the last step's StepResult::memory (where the tensors live)
};

// Trains `steps` steps at TP x DP on Backend; the ranks share the calling process's current
// device and communicate through StagingComm (a pass-through for host tensors).
// moe: the small DeepSeekMoE model (softmax router with renormalised weights and the aux loss;
// dropless, so that a summation-order difference cannot drop a different token) over ep
// expert-parallel ranks.
template <class Backend, class Precision = precision::Fp32>
Run train_run(int steps, int tp = 1, int dp = 1, double offload_ratio = 0.0, bool flash = false, int zero_stage = 0,
              bool moe = false, int ep = 1, dp::GradReduceDType grad_reduce_dtype = dp::GradReduceDType::Fp32,
              bool mla = false) {
  using Comm = comm::StagingComm<comm::ThreadComm>;
  using P = Policy<Backend, Comm, Precision>;
  auto config = moe ? test::small_moe_model() : test::small_model();
  if (mla) config = test::with_mla(config);  // DeepSeek-V3's attention
  config.use_flash_attn = flash;
  const auto& data = test::shakespeare(config.seq_length);
  train::TrainConfig tc = test::small_train_config(8, steps);
  if (moe) tc.moe.aux_loss_coeff = 0.01f;
  tc.ddp.grad_reduce_dtype = grad_reduce_dtype;
  tc.offload_ratio = offload_ratio;
  tc.zero_stage = zero_stage;
  Run out;
  std::mutex mu;
  comm::launch(tp * dp, [&](comm::ThreadComm& world) {
    MemorySpaceScope scope(memory_space(Backend{}));
    Comm rank_comm(world.split(0, world.rank()));
    DeviceMesh mesh(rank_comm, ParallelLayout{.tensor = tp, .data = dp, .expert = ep});
    train::Trainer<P> trainer(config, tc, mesh, data);
    Run r;
    for (int s = 0; s < steps; ++s) {
      const auto step = trainer.train_step();
      r.losses.push_back(step.loss);
      r.grad_norms.push_back(step.skipped ? -1.0 : step.grad_norm);  // a step skipped by loss scaling: NaN
      r.step_memory = step.memory;
    }
    r.host_state_bytes = memory::snapshot()[memory::Category::OptimizerState].live;
    if constexpr (std::is_same_v<Backend, backend::Cuda>) {
      r.device_parameter_bytes = memory::device_snapshot()[memory::Category::Parameters].live;
      r.device_state_bytes = memory::device_snapshot()[memory::Category::OptimizerState].live;
    }
    trainer.optimizer().gather_for_checkpoint();  // ZeRO stage 3: the whole parameters (collective)
    if (world.rank() != 0) return;
    std::lock_guard lk(mu);
    out = std::move(r);
    if (tp > 1) return;  // rank 0 holds only its shards
    for (auto* p : trainer.parameters()) {
      const Tensor host = p->value.to_host();
      out.params[p->spec.name].assign(host.values().begin(), host.values().end());
    }
  });
  return out;
}

// Every step's loss and gradient norm within 1e-5 relative of the Host run's.
void check_steps(const Run& gpu, const Run& host) {
  REQUIRE(gpu.losses.size() == host.losses.size());
  for (std::size_t s = 0; s < host.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(std::abs(gpu.losses[s] - host.losses[s]) <= 1e-5 * std::abs(host.losses[s]));
    CHECK(std::abs(gpu.grad_norms[s] - host.grad_norms[s]) <= 1e-5 * std::abs(host.grad_norms[s]));
  }
}

}  // namespace

TEST_CASE("a training step on the GPU equals the Host step (fp32, one rank) within 1e-5") {
  const Run host = train_run<backend::Host>(3), gpu = train_run<backend::Cuda>(3);
  CHECK(gpu.device_parameter_bytes > 0);  // the model lived in device memory
  // StepResult::memory reads the device counters: the same model state as the Host step's host
  // counters (activations differ: the CUDA ops' per-call scratch is counted there too)
  for (auto c : {memory::Category::Parameters, memory::Category::Gradients, memory::Category::OptimizerState}) {
    CAPTURE(memory::name(c));
    CHECK(gpu.step_memory[c].live > 0);
    CHECK(gpu.step_memory[c].live == host.step_memory[c].live);
  }
  check_steps(gpu, host);
  REQUIRE(gpu.params.size() == host.params.size());
  for (const auto& [name, want] : host.params) {
    CAPTURE(name);
    CHECK(test::relative_error(gpu.params.at(name), want) <= 1e-5);
  }
}

TEST_CASE("TP=2 and DP=2 on one GPU through the shared-device path equal TP1 within 1e-5") {
  const Run tp1 = train_run<backend::Host>(3);
  for (auto [tp, dp] : {std::pair{2, 1}, std::pair{1, 2}}) {
    CAPTURE(tp);
    CAPTURE(dp);
    const Run gpu = train_run<backend::Cuda>(3, tp, dp);
    CHECK(gpu.device_parameter_bytes > 0);
    check_steps(gpu, tp1);
    if (tp > 1) continue;  // DP: rank 0 holds every parameter whole
    for (const auto& [name, want] : tp1.params) {
      CAPTURE(name);
      CHECK(test::relative_error(gpu.params.at(name), want) <= 1e-5);
    }
  }
}

TEST_CASE("ZeRO stages 1-3 at DP=2 on one GPU (device payloads and slices, through StagingComm) equal DP1 within 1e-5") {
  const Run dp1 = train_run<backend::Host>(3);
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    const Run gpu = train_run<backend::Cuda>(3, 1, 2, stage == 3 ? 0.5 : 0.0, false, stage);  // stage 3: half offloaded
    check_steps(gpu, dp1);
    for (const auto& [name, want] : dp1.params) {
      CAPTURE(name);
      CHECK(test::relative_error(gpu.params.at(name), want) <= 1e-5);
    }
  }
}

TEST_CASE("optimizer offload on the GPU: half the state updated by the CPU equals the Host step within 1e-5") {
  const Run host = train_run<backend::Host>(3), gpu = train_run<backend::Cuda>(3, 1, 1, 0.5);
  CHECK(gpu.host_state_bytes > 0);  // the offloaded moments, in host memory ...
  CHECK(gpu.device_state_bytes > 0);  // ... and the rest on the device
  CHECK(gpu.host_state_bytes >= gpu.device_state_bytes);  // at least half offloaded
  check_steps(gpu, host);
  for (const auto& [name, want] : host.params) {
    CAPTURE(name);
    CHECK(test::relative_error(gpu.params.at(name), want) <= 1e-5);
  }
}

TEST_CASE("--use-flash-attn: a training step with the tiled CUDA kernel equals the Host flash step within 1e-5") {
  const Run host = train_run<backend::Host>(3, 1, 1, 0.0, true), gpu = train_run<backend::Cuda>(3, 1, 1, 0.0, true);
  check_steps(gpu, host);
  for (const auto& [name, want] : host.params) {
    CAPTURE(name);
    CHECK(test::relative_error(gpu.params.at(name), want) <= 1e-5);
  }
}

TEST_CASE("a DeepSeekMoE step on the GPU (routing on the host, token rows on the device) equals the Host step; EP=2 on one GPU equals EP1") {
  const Run host = train_run<backend::Host>(3, 1, 1, 0.0, false, 0, true);
  for (int ep : {1, 2}) {
    CAPTURE(ep);
    const Run gpu = train_run<backend::Cuda>(3, 1, ep, 0.0, false, 0, true, ep);
    CHECK(gpu.device_parameter_bytes > 0);
    check_steps(gpu, host);
    if (ep > 1) continue;  // rank 0 holds half the routed experts
    for (const auto& [name, want] : host.params) {
      CAPTURE(name);
      CHECK(test::relative_error(gpu.params.at(name), want) <= 1e-5);
    }
  }
}

TEST_CASE("an MLA + DeepSeekMoE step on the GPU (interleaved RoPE, YaRN) equals the Host step; TP=2 on one GPU equals TP1") {
  const Run host = train_run<backend::Host>(3, 1, 1, 0.0, false, 0, true, 1, dp::GradReduceDType::Fp32, true);
  const Run gpu = train_run<backend::Cuda>(3, 1, 1, 0.0, false, 0, true, 1, dp::GradReduceDType::Fp32, true);
  check_steps(gpu, host);
  for (const auto& [name, want] : host.params) {
    CAPTURE(name);
    CHECK(test::relative_error(gpu.params.at(name), want) <= 1e-5);
  }
  check_steps(train_run<backend::Cuda>(3, 2, 1, 0.0, false, 0, true, 1, dp::GradReduceDType::Fp32, true), host);
}

TEST_CASE("--grad-reduce-dtype bf16 / fp16 at DP=2 on one GPU (gradients rounded on the device) equal the Host run with the same transport") {
  // The device's fp32 gradients differ from the host's by ~1e-7 relative (summation order), so
  // rounding them to 16 bits can land on the other side of a tie: one 16-bit ulp (2^-8 for bf16,
  // 2^-11 for fp16) on about 1e-7 / 2^-8 = 3e-5 of the elements. Adam's normalised update moves
  // such an element by at most that fraction of one step, so the parameters stay within 1e-4
  // relative (bf16's ulp x the flipped fraction, far below) and the losses within 1e-5.
  for (auto dtype : {dp::GradReduceDType::Bf16, dp::GradReduceDType::Fp16}) {
    CAPTURE(static_cast<int>(dtype));
    const Run host = train_run<backend::Host>(3, 1, 2, 0.0, false, 0, false, 1, dtype);
    const Run gpu = train_run<backend::Cuda>(3, 1, 2, 0.0, false, 0, false, 1, dtype);
    check_steps(gpu, host);
    for (const auto& [name, want] : host.params) {
      CAPTURE(name);
      CHECK(test::relative_error(gpu.params.at(name), want) <= 1e-4);
    }
  }
}

TEST_CASE("mixed precision on the GPU (16-bit parameters, gradients and activations rounded by the device, fp32 master weights), one rank (also with flash attention), ZeRO 1 at DP=2 half offloaded and ZeRO 3 at DP=2: the Host mixed-precision step") {
  // As for the 16-bit transport (above), with more rounding points: every kept activation, the
  // gradients and the stored parameters are rounded, and a summation-order difference of ~1e-7
  // relative flips a rounding tie by one 16-bit ulp (bf16 2^-8) on ~1e-7 / 2^-8 = 3e-5 of the
  // elements each time. A flip moves its element by one ulp and the loss (a mean over 8 x 64
  // tokens of smooth functions of them) by ~3e-5 x 2^-8 ~ 1e-7 relative per rounding point;
  // through the two layers and three steps that stays below 1e-5 for the losses and norms, and
  // the fp32 master weights move by at most the flipped fraction of one Adam step: within 1e-4.
  // fp16 runs with dynamic loss scaling (its default; no overflow at these magnitudes). With
  // --use-flash-attn the CUDA step runs the tensor-core flash kernels and the Host's flash tile
  // GEMMs round the same inputs. Their P and dS come from sums that differ by ~1e-6 relative
  // (the flash test's fp32 bound), not 1e-7, so ~3e-4 of those roundings flip; each moves the
  // loss by ~3e-4 x 2^-8 ~ 1e-6 relative: still below the 1e-5 bound, with less room (derived,
  // not yet run on a GPU).
  const auto compare = [](auto precision) {
    using Precision = decltype(precision);
    for (auto [dp, stage, offload, flash] : {std::tuple{1, 0, 0.0, false}, std::tuple{1, 0, 0.0, true},
                                             std::tuple{2, 1, 0.5, false}, std::tuple{2, 3, 0.0, false}}) {
      CAPTURE(dp);
      CAPTURE(stage);
      CAPTURE(flash);
      const Run host = train_run<backend::Host, Precision>(3, 1, dp, offload, flash, stage);
      const Run gpu = train_run<backend::Cuda, Precision>(3, 1, dp, offload, flash, stage);
      CHECK(gpu.device_parameter_bytes > 0);  // the 16-bit parameters lived in device memory
      check_steps(gpu, host);
      for (const auto& [name, want] : host.params) {
        CAPTURE(name);
        CHECK(test::relative_error(gpu.params.at(name), want) <= 1e-4);
      }
    }
  };
  compare(precision::Bf16Mixed{});
  compare(precision::Fp16Mixed{});
}
