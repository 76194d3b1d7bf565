// Mixed precision (precision::Bf16Mixed, Fp16Mixed): parameters and gradients stored in 16 bits,
// fp32 master weights and moments (zero::ZeroOptimizer with T = bf16 / fp16).
//   * ZeRO 1, 2 and 3 give ZeRO 0's losses, norms, master weights and moments at DP 4 and at
//     PP 2 x DP 2 (tied embeddings). Tolerance 1e-6 relative, as for fp32 (test_zero_stages):
//     a stage changes only which rank updates an element and all-reduce vs reduce-scatter of
//     the same 16-bit payload (ThreadComm sums in rank order in fp32 and rounds once in both).
//   * The layers see 16-bit values: every fp32 value the forward reads is a bf16 number, the
//     rounding of its master weight, and the master weights are not all bf16 numbers.
//   * A checkpoint holds the fp32 master weights: resumed in Bf16Mixed on the same layout it
//     continues bitwise; loaded into an fp32 trainer its parameters are the master weights.
//   * Bf16Mixed trains tiny Shakespeare to a validation loss within 0.05 of fp32's (the issue's
//     bound) with the same settings, and the two runs do differ (the rounding is real).
//   * Fp16Mixed turns dynamic loss scaling on by default (LossScalerConfig's defaults).
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
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
#include "../zero/run_result.hpp"

using namespace dsp;

namespace precision_mixed_precision_test {
using Fp32 = Policy<backend::Host, comm::ThreadComm>;
using Bf16 = Policy<backend::Host, comm::ThreadComm, precision::Bf16Mixed>;
using Fp16 = Policy<backend::Host, comm::ThreadComm, precision::Fp16Mixed>;

namespace {

using test::Params;
using test::RunResult;

// `steps` steps of the small model at `layout` and ZeRO stage `zero_stage` with policy P
// (settings: base, or small_train_config); with `val_loss` the validation loss after them.
template <class P>
RunResult run(ParallelLayout layout, int zero_stage, const model::ModelConfig& config, int steps,
              const train::TrainConfig* base = nullptr, double* val_loss = nullptr) {
  train::TrainConfig tc = base ? *base : test::small_train_config(8, steps);
  tc.zero_stage = zero_stage;
  RunResult out;
  std::mutex mu;
  comm::launch(layout.tensor * layout.pipeline * layout.data, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, layout);
    train::Trainer<P> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
    test::train_and_collect(trainer, mesh, steps, 1, mu, out);
    const double val = val_loss ? trainer.evaluate() : 0.0;
    if (val_loss && world.rank() == 0) *val_loss = val;
  });
  return out;
}

}  // namespace

TEST_CASE("mixed precision: ZeRO 1, 2 and 3 give ZeRO 0's losses, norms, master weights and moments") {
  const int steps = 8;
  for (const ParallelLayout layout : {ParallelLayout{.data = 4}, ParallelLayout{.pipeline = 2, .data = 2}}) {
    CAPTURE(layout.pipeline);
    const auto config = test::small_model(/*tied=*/layout.pipeline > 1);
    const RunResult bf16 = run<Bf16>(layout, 0, config, steps);
    CHECK(bf16.losses.back() < bf16.losses.front() - 0.1);  // it learns
    for (int stage : {1, 2, 3}) {
      CAPTURE(stage);
      test::check_same(run<Bf16>(layout, stage, config, steps), bf16);
    }
    const RunResult fp16 = run<Fp16>(layout, 0, config, steps);
    test::check_same(run<Fp16>(layout, 3, config, steps), fp16);
    // Neither is fp32: the 16-bit parameters and gradients change the trajectory.
    const RunResult fp32 = run<Fp32>(layout, 0, config, steps);
    CHECK(test::relative_error(bf16.final, fp32.final) > 1e-4);
    CHECK(test::relative_error(fp16.final, fp32.final) > 1e-6);
    CHECK(test::relative_error(bf16.final, fp32.final) < 0.05);  // but stays close after 8 steps
  }
}

TEST_CASE("Bf16Mixed: the layers read bf16 values, the roundings of fp32 master weights") {
  const auto config = test::small_model();
  for (int stage : {0, 3}) {
    CAPTURE(stage);
    auto tc = test::small_train_config(8, 4);
    tc.zero_stage = stage;
    comm::launch(2, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.data = 2});
      train::Trainer<Bf16> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
      for (int s = 0; s < 4; ++s) trainer.train_step();
      auto& opt = trainer.optimizer();
      const auto params = opt.parameters();
      for (auto* p : params) CHECK(p->value.empty());  // no fp32 copy between steps
      opt.gather_for_checkpoint();  // the values are now the master weights
      std::vector<Tensor> masters;
      for (auto* p : params) masters.push_back(p->value);
      opt.partition_after_checkpoint(false);
      opt.acquire(params, nullptr, false);  // what a forward reads
      std::int64_t not_bf16 = 0, elements = 0;
      for (std::size_t i = 0; i < params.size(); ++i)
        for (std::int64_t k = 0; k < masters[i].numel(); ++k) {
          const float v = params[i]->value[k], m = masters[i][k];
          CHECK(v == static_cast<float>(bf16(m)));
          not_bf16 += v != m;
          ++elements;
        }
      opt.release(params);
      CHECK(not_bf16 > elements / 2);  // the masters keep fp32's precision
      for (auto* p : params) CHECK(p->value.empty());
    });
  }
}

TEST_CASE("a Bf16Mixed checkpoint holds the master weights: it resumes bitwise and loads into fp32") {
  const auto config = test::small_model();
  const int first = 3, total = 6;
  const ParallelLayout dp4{.data = 4};
  const RunResult ref = run<Bf16>(dp4, 3, config, total);
  const auto dir = std::filesystem::temp_directory_path() / ("dsp_mixed_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto tc = test::small_train_config(8, total);
  tc.zero_stage = 3;
  Params masters;
  std::mutex mu;
  comm::launch(4, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, dp4);
    train::Trainer<Bf16> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
    for (int s = 0; s < first; ++s) trainer.train_step();
    train::save_checkpoint(dir, trainer);
    test::collect_state(trainer, mesh, 1, mu, masters);
  });
  RunResult resumed;
  comm::launch(4, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, dp4);
    train::Trainer<Bf16> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
    train::load_checkpoint(dir, trainer);
    test::train_and_collect(trainer, mesh, total - first, 1, mu, resumed);
  });
  RunResult tail = ref;
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + first);
  tail.grad_norms.erase(tail.grad_norms.begin(), tail.grad_norms.begin() + first);
  CHECK(resumed.losses == tail.losses);
  CHECK(resumed.grad_norms == tail.grad_norms);
  CHECK(test::relative_error(resumed.final, tail.final) == 0.0);
  Params loaded;  // into fp32 on one rank: the master weights and moments, exactly
  tc.zero_stage = 0;
  comm::launch(1, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{});
    train::Trainer<Fp32> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
    train::load_checkpoint(dir, trainer);
    test::collect_state(trainer, mesh, 1, mu, loaded);
  });
  CHECK(test::relative_error(loaded, masters) == 0.0);
  std::filesystem::remove_all(dir);
}

TEST_CASE("Bf16Mixed trains tiny Shakespeare to fp32's validation loss within 0.05") {
  // The bound. 150 steps of the small model at DP 2 (lr 3e-3), ZeRO 1 for bf16: the
  // validation loss falls from ~4.8 to 2.777 (fp32) and 2.776 (bf16: 16-bit activations and
  // GEMM inputs, 2026-12-02); observed difference 0.0006.
  const auto config = test::small_model();
  const int steps = 150;
  auto tc = test::small_train_config(8, steps);
  tc.eval_iters = 8;
  double fp32 = 0.0, bf16 = 0.0;
  run<Fp32>(ParallelLayout{.data = 2}, 0, config, steps, &tc, &fp32);
  run<Bf16>(ParallelLayout{.data = 2}, 1, config, steps, &tc, &bf16);
  MESSAGE("validation loss after ", steps, " steps: fp32 ", fp32, ", bf16 mixed ", bf16);
  CHECK(fp32 < 3.0);  // it did learn (from ln 127 = 4.84)
  CHECK(std::abs(bf16 - fp32) <= 0.05);
  CHECK(bf16 != fp32);
}

TEST_CASE("Fp16Mixed scales the loss by default; mixed precision refuses the other 16-bit gradient dtype") {
  const auto config = test::small_model();
  comm::launch(1, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{});
    auto tc = test::small_train_config(8, 4);
    train::Trainer<Fp16> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
    REQUIRE(trainer.loss_scaler() != nullptr);
    CHECK(trainer.loss_scaler()->scale() == 65536.0f);
    const auto r = trainer.train_step();
    CHECK(r.loss_scale == 65536.0f);
    CHECK(std::isfinite(r.loss));
    tc.ddp.grad_reduce_dtype = dp::GradReduceDType::Fp16;
    CHECK_THROWS_WITH_AS(train::Trainer<Bf16>(config, tc, mesh, test::shakespeare(config.seq_length)),
                         "bf16 mixed precision keeps gradients in bf16: --grad-reduce-dtype must be bf16 (or left at "
                         "its default)",
                         ConfigError);
  });
}

}  // namespace precision_mixed_precision_test
