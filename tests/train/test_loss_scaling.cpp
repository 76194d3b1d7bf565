// Dynamic loss scaling in the trainer (TrainConfig::loss_scaler, precision::DynamicLossScaler):
// a power-of-two scale changes nothing (scaling by 2^k and back is exact in fp32, so the runs
// are bitwise equal); an infinity injected into one gradient element on one rank makes every
// rank of a TP 2 x PP 2 x DP 2 mesh skip the step atomically (parameters, moments, optimizer
// step count and LR position bitwise unchanged, the scale backed off to the same value
// everywhere) and training continues, at ZeRO 0 and 2. (fp32 gradients do not overflow from
// the scale alone: the largest fp32 scale times these gradients stays finite, so the fault is
// injected through Trainer::set_grad_hook.) The same with precision::Fp16Mixed (fp16 gradients).
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/trainer.hpp"
#include "small_model.hpp"

using namespace dsp;

namespace train_loss_scaling_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

train::TrainConfig train_config(int zero_stage) {
  train::TrainConfig tc;
  tc.micro_batch_size = 2;
  tc.global_batch_size = 8;
  tc.lr = 3e-3f;
  tc.lr_warmup_iters = 3;
  tc.train_iters = 8;
  tc.zero_stage = zero_stage;
  return tc;
}

// This rank's parameter values (mixed precision: the master weights) and the moments it owns, flattened.
template <class Pol>
std::vector<float> snapshot(train::Trainer<Pol>& t) {
  auto& opt = t.optimizer();
  opt.gather_for_checkpoint();
  std::vector<float> out;
  const auto params = opt.parameters();
  for (std::size_t i = 0; i < params.size(); ++i)
    for (const Tensor* x : {&params[i]->value, &opt.exp_avg(i), &opt.exp_avg_sq(i)})
      out.insert(out.end(), x->data(), x->data() + x->numel());
  opt.partition_after_checkpoint(false);
  return out;
}

}  // namespace

TEST_CASE("a power-of-two loss scale trains bitwise like no scaling") {
  const auto config = test::small_model();
  std::vector<double> losses[2];
  for (int scaled : {0, 1}) {
    auto tc = train_config(0);
    if (scaled) tc.loss_scaler = precision::LossScalerConfig{.initial_scale = 1024.0f, .growth_interval = 3};
    comm::launch(2, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.data = 2});
      train::Trainer<P> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
      for (int s = 0; s < 8; ++s) {
        const auto r = trainer.train_step();
        CHECK_FALSE(r.skipped);
        if (world.rank() == 0) losses[scaled].push_back(r.loss);
      }
      if (scaled) CHECK(trainer.loss_scaler()->scale() == 1024.0f * 4);  // grew after steps 3 and 6
    });
  }
  CHECK(losses[0] == losses[1]);
}

// The fault injection of the next two test cases, trained with policy Pol.
template <class Pol>
void skip_on_injected_infinity() {
  using Storage = typename train::Trainer<Pol>::Storage;
  const auto config = test::small_model(/*tied=*/true);
  for (int zero_stage : {0, 2}) {
    CAPTURE(zero_stage);
    auto tc = train_config(zero_stage);
    tc.loss_scaler = precision::LossScalerConfig{.initial_scale = 4096.0f, .growth_interval = 100, .hysteresis = 1};
    const int inject_step = 3, inject_rank = 5;  // TP rank 1, DP rank 0, last pipeline stage
    std::mutex mu;
    std::vector<float> scales_after;
    comm::launch(8, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.tensor = 2, .pipeline = 2, .data = 2});
      train::Trainer<Pol> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
      int step = 0;
      trainer.set_grad_hook([&](train::Trainer<Pol>& t) {
        if (step != inject_step || world.rank() != inject_rank) return;
        for (std::size_t i = 0; i < t.optimizer().parameters().size(); ++i)
          if (auto g = t.optimizer().gradient(i); !g.empty()) {
            g[g.size() / 2] = Storage(std::numeric_limits<float>::infinity());
            return;
          }
      });
      float lr_before = 0.0f;
      for (step = 1; step < inject_step; ++step) lr_before = trainer.train_step().lr;
      const std::vector<float> before = snapshot(trainer);
      const std::int64_t iteration = trainer.iteration();
      const auto skipped = trainer.train_step();  // step == inject_step
      CHECK(skipped.skipped);
      CHECK(std::isnan(skipped.grad_norm));
      CHECK(skipped.loss_scale == 4096.0f);
      CHECK(trainer.iteration() == iteration);
      CHECK(snapshot(trainer) == before);  // parameters and moments bitwise unchanged
      ++step;
      const auto next = trainer.train_step();  // the LR position did not move: the step the skipped one would have been
      CHECK_FALSE(next.skipped);
      CHECK(next.loss_scale == 2048.0f);  // backed off once (hysteresis 1)
      CHECK(next.iteration == iteration + 1);
      CHECK(next.lr == skipped.lr);
      CHECK(next.lr > lr_before);  // still warming up: the schedule continues from where it was
      CHECK(std::isfinite(next.loss));
      CHECK(snapshot(trainer) != before);
      for (++step; step <= 6; ++step) CHECK_FALSE(trainer.train_step().skipped);
      std::lock_guard lk(mu);
      scales_after.push_back(trainer.loss_scaler()->scale());
      CHECK(trainer.loss_scaler()->skipped_steps() == 1);
    });
    REQUIRE(scales_after.size() == 8);
    for (float s : scales_after) CHECK(s == 2048.0f);  // identical on every rank
  }
}

TEST_CASE("an infinity in one gradient on one rank: every rank skips the step, the scale backs off, training continues") {
  skip_on_injected_infinity<P>();
}

TEST_CASE("Fp16Mixed: an infinity in one fp16 gradient on one rank skips the step on every rank alike") {
  // The same with fp16 parameters and gradients and fp32 master weights: the snapshot compares
  // the master weights and moments.
  skip_on_injected_infinity<Policy<backend::Host, comm::ThreadComm, precision::Fp16Mixed>>();
}

// Without loss scaling nothing skips a step: a NaN in one gradient element on one rank (TP 2 x
// DP 2, injected at step 2 on rank 1 after the data-parallel reduction, so that only its model
// group's norm is NaN), and with check_for_nan_in_loss_and_grad (the default) every rank's
// train_step throws Error naming the step and the flag, before the update: parameters and
// moments bitwise those of step 1. Turned off, the step goes through.
template <class Pol>
void stop_on_injected_nan() {
  using Storage = typename train::Trainer<Pol>::Storage;
  const auto config = test::small_model();
  for (bool check : {true, false}) {
    CAPTURE(check);
    auto tc = train_config(0);
    tc.check_for_nan_in_loss_and_grad = check;
    std::atomic<int> threw{0};
    comm::launch(4, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.tensor = 2, .data = 2});
      train::Trainer<Pol> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
      int step = 1;
      trainer.set_grad_hook([&](train::Trainer<Pol>& t) {
        if (step != 2 || world.rank() != 1) return;
        auto g = t.optimizer().gradient(0);
        REQUIRE_FALSE(g.empty());
        g[g.size() / 2] = Storage(std::numeric_limits<float>::quiet_NaN());
      });
      CHECK(std::isfinite(trainer.train_step().grad_norm));
      step = 2;
      const std::vector<float> before = snapshot(trainer);
      if (check) {
        try {
          trainer.train_step();
        } catch (const Error& e) {
          ++threw;
          const std::string what = e.what();
          CHECK(what.find("step 2: the gradient norm is not finite on some rank") != std::string::npos);
          CHECK(what.find("--no-check-for-nan-in-loss-and-grad") != std::string::npos);
        }
        CHECK(trainer.iteration() == 1);
        CHECK(snapshot(trainer) == before);
      } else {
        const float norm = trainer.train_step().grad_norm;
        CHECK(std::isnan(norm) == (world.rank() < 2));  // the NaN's model group (ranks 0 and 1)
        CHECK(trainer.iteration() == 2);
      }
    });
    CHECK(threw == (check ? 4 : 0));
  }
}

TEST_CASE("without loss scaling, a NaN gradient on one rank stops every rank before the update (fp32 and bf16)") {
  stop_on_injected_nan<P>();
  stop_on_injected_nan<Policy<backend::Host, comm::ThreadComm, precision::Bf16Mixed>>();
}

TEST_CASE("fp16 gradient transport: a scale that overflows it backs off until steps succeed, on every rank alike") {
  // --grad-reduce-dtype fp16 with a scale of 2^40: the scaled gradients pass fp16's 65504 and
  // arrive as infinities; each overflow skips the step and halves the scale (hysteresis 1) until
  // the gradients fit. ZeRO 0 (all-reduce) and 2 (reduce-scatter).
  const auto config = test::small_model();
  for (int zero_stage : {0, 2}) {
    CAPTURE(zero_stage);
    auto tc = train_config(zero_stage);
    tc.ddp.grad_reduce_dtype = dp::GradReduceDType::Fp16;
    tc.loss_scaler = precision::LossScalerConfig{.initial_scale = 1099511627776.0f, .max_scale = 1099511627776.0f,
                                                 .growth_interval = 100, .hysteresis = 1};
    std::mutex mu;
    std::vector<float> scales;
    comm::launch(4, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.data = 4});
      train::Trainer<P> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
      int skipped = 0, calls = 0;
      double first_loss = 0, loss = 0;
      while (trainer.iteration() < 4 && calls++ < 60) {
        const auto r = trainer.train_step();
        skipped += r.skipped ? 1 : 0;
        if (!r.skipped) (trainer.iteration() == 1 ? first_loss : loss) = r.loss;
      }
      CHECK(trainer.iteration() == 4);
      CHECK(skipped >= 5);  // 2^40 is far past what fp16 holds
      CHECK(trainer.loss_scaler()->skipped_steps() == skipped);
      CHECK(trainer.loss_scaler()->scale() == std::ldexp(1.0f, 40 - skipped));
      CHECK(std::isfinite(loss));
      CHECK(loss < first_loss);  // it trains once the scale fits
      std::lock_guard lk(mu);
      scales.push_back(trainer.loss_scaler()->scale());
    });
    REQUIRE(scales.size() == 4);
    for (float s : scales) CHECK(s == scales.front());
  }
}

TEST_CASE("a power-of-two loss scale leaves MoE training (with the aux loss) bitwise unchanged") {
  // The aux loss's gradient starts inside the MoE layers: it must be scaled like the main loss's.
  const auto config = test::small_moe_model();
  std::vector<double> losses[2];
  for (int scaled : {0, 1}) {
    auto tc = train_config(1);
    tc.moe.aux_loss_coeff = 0.01f;
    if (scaled) tc.loss_scaler = precision::LossScalerConfig{.initial_scale = 1024.0f};
    comm::launch(2, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.data = 2});
      train::Trainer<P> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
      for (int s = 0; s < 5; ++s) {
        const auto r = trainer.train_step();
        if (world.rank() == 0) losses[scaled].push_back(r.loss);
      }
    });
  }
  CHECK(losses[0] == losses[1]);
}

TEST_CASE("steps that overflow at the minimum loss scale end the run with a message after 10 in a row") {
  const auto config = test::small_model();
  auto tc = train_config(0);
  tc.ddp.grad_reduce_dtype = dp::GradReduceDType::Fp16;
  tc.loss_scaler = precision::LossScalerConfig{.initial_scale = 1e10f, .min_scale = 1e10f, .max_scale = 1e10f};
  int attempts = 0;
  CHECK_THROWS_WITH_AS(comm::launch(2,
                                    [&](comm::ThreadComm& world) {
                                      DeviceMesh mesh(world, ParallelLayout{.data = 2});
                                      train::Trainer<P> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
                                      for (int s = 0; s < 100; ++s) {
                                        const auto r = trainer.train_step();
                                        CHECK(r.skipped);
                                        CHECK(r.iteration == 1);  // the step it attempted
                                        if (world.rank() == 0) ++attempts;
                                      }
                                    }),
                       doctest::Contains("overflowed at the minimum loss scale 1e+10 (--min-loss-scale): the "
                                         "gradients are not finite"),
                       Error);
  CHECK(attempts == 9);  // the 10th throws
}

TEST_CASE("Fp16Mixed: activations past fp16's range make the loss infinite; the run ends naming the forward") {
  // init std 300: the q/k/v products reach ~1e6, past fp16's 65504, so the rounded activations
  // (precision/activation_precision.hpp) hold infinities and the loss is NaN at every scale.
  auto config = test::small_model();
  config.init_method_std = 300.0f;
  auto tc = train_config(0);
  tc.loss_scaler = precision::LossScalerConfig{.initial_scale = 1.0f, .min_scale = 1.0f};
  int skipped = 0;
  CHECK_THROWS_WITH_AS(comm::launch(2,
                                    [&](comm::ThreadComm& world) {
                                      DeviceMesh mesh(world, ParallelLayout{.data = 2});
                                      train::Trainer<Policy<backend::Host, comm::ThreadComm, precision::Fp16Mixed>> trainer(
                                          config, tc, mesh, test::shakespeare(config.seq_length));
                                      for (int s = 0; s < 100; ++s) {
                                        const auto r = trainer.train_step();
                                        CHECK(std::isnan(r.loss));
                                        if (world.rank() == 0) skipped += r.skipped;
                                      }
                                    }),
                       doctest::Contains("the loss itself is not finite, so the forward overflowed"), Error);
  CHECK(skipped == 9);
}

}  // namespace train_loss_scaling_test
