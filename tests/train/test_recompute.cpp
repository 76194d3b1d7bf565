// Activation recomputation (model/recompute.hpp): selective (attention probabilities and SwiGLU
// activations recomputed in backward) and full (uniform groups of 1 and 2 layers, block) give
// bitwise the gradients, losses, parameters and moments of no recomputation, for a dense and a
// DeepSeekMoE model (routed experts split over EP2), at TP1 and TP2 x PP2, in fp32 and with
// Bf16Mixed's 16-bit activations (the recomputed values are rounded where the forward rounded
// them); and they keep less: the measured activation peak of a step falls from none to
// selective to full (fp32), and Bf16Mixed's Activations peak is below fp32's with each
// granularity (its kept activations are half, tests/model/test_activation_precision.cpp; the
// peak also holds one layer's fp32 backward temporaries, the same in both; dense TP1 measured
// 0.69 of fp32's without recomputation, 0.76 selective, 0.96 full). Bitwise, because the
// recomputed forward is the same arithmetic on the same inputs (fixed threads: same GEMM
// shapes, same summation order).
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/trainer.hpp"
#include "small_model.hpp"

using namespace dsp;

namespace train_recompute_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

struct Run {
  std::vector<double> losses;
  // Rank 0's local shards after the steps: fp32 gradients (fp32 only: mixed precision keeps
  // none between steps), parameter values (mixed precision: the master weights) and moments.
  std::map<std::string, std::vector<float>> grads, values, moments;
  std::int64_t peak_activation_bytes = 0;  // rank 0, largest over the steps
  std::int64_t peak_activations = 0;       // rank 0, the Activations category's largest (memory[Activations].peak)
};

template <class Pol = P>
Run run(const model::ModelConfig& config, model::RecomputeConfig recompute, ParallelLayout layout, int steps) {
  train::TrainConfig tc;
  tc.micro_batch_size = 2;
  tc.global_batch_size = 4;
  tc.lr = 3e-3f;
  tc.recompute = recompute;
  tc.moe.aux_loss_coeff = 0.01f;
  Run out;
  std::mutex mu;
  comm::launch(layout.tensor * layout.pipeline * (layout.expert > 1 ? layout.expert : 1), [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, layout);
    train::Trainer<Pol> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
    Run r;
    for (int s = 0; s < steps; ++s) {
      const auto step = trainer.train_step();
      r.losses.push_back(step.loss);
      r.peak_activation_bytes = std::max(r.peak_activation_bytes, step.peak_activation_bytes);
      r.peak_activations = std::max(r.peak_activations, step.memory[memory::Category::Activations].peak);
    }
    auto& opt = trainer.optimizer();
    opt.gather_for_checkpoint();
    const auto params = opt.parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto* p = params[i];
      if (!p->grad.empty()) r.grads[p->spec.name].assign(p->grad.values().begin(), p->grad.values().end());
      r.values[p->spec.name].assign(p->value.values().begin(), p->value.values().end());
      auto& m = r.moments[p->spec.name];
      for (const Tensor* t : {&opt.exp_avg(i), &opt.exp_avg_sq(i)}) m.insert(m.end(), t->data(), t->data() + t->numel());
    }
    opt.partition_after_checkpoint(false);
    std::lock_guard lk(mu);
    if (world.rank() == 0) out = std::move(r);
  });
  return out;
}

model::ModelConfig moe_model() {
  auto c = test::small_model();
  c.num_layers = 4;
  c.seq_length = 64;  // the attention probabilities [b, h, s, s] weigh in the activations
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 32;
  c.num_shared_experts = 1;
  c.first_k_dense_replace = 1;
  return c;
}

struct Case {
  const char* name;
  model::ModelConfig config;
  ParallelLayout layout;
};

model::ModelConfig dense_model() {
  auto c = test::small_model();
  c.num_layers = 4;
  c.seq_length = 64;
  return c;
}

// Every recomputation setting against none, with precision policy Pol.
template <class Pol>
void check_recomputation(const Case& c) {
  using G = model::RecomputeGranularity;
  using M = model::RecomputeMethod;
  CAPTURE(c.name);
  const Run none = run<Pol>(c.config, {}, c.layout, 3);
  CHECK(none.grads.empty() == train::Trainer<Pol>::Optimizer::mixed);
  CHECK_FALSE(none.moments.empty());
  const Run selective = run<Pol>(c.config, {G::Selective, M::Uniform, 1}, c.layout, 3);
  for (const model::RecomputeConfig& rc : {model::RecomputeConfig{G::Selective, M::Uniform, 1},
                                           model::RecomputeConfig{G::Full, M::Uniform, 1},
                                           model::RecomputeConfig{G::Full, M::Uniform, 2},
                                           model::RecomputeConfig{G::Full, M::Block, 1}}) {
    CAPTURE(static_cast<int>(rc.granularity));
    CAPTURE(static_cast<int>(rc.method));
    CAPTURE(rc.num_layers);
    const Run r = run<Pol>(c.config, rc, c.layout, 3);
    CHECK(r.losses == none.losses);
    CHECK(r.grads == none.grads);  // the last step's reduced, clipped gradients
    CHECK(r.values == none.values);
    CHECK(r.moments == none.moments);  // every step's gradients went into them
    CHECK(r.peak_activation_bytes < none.peak_activation_bytes);
    // In mixed precision a recomputed group is fp32 again during its backward, more here than
    // selective's 16-bit stash: only fp32 orders full below selective on this small model.
    if (rc.granularity == G::Full && rc.method == M::Uniform && !train::Trainer<Pol>::Optimizer::mixed)
      CHECK(r.peak_activation_bytes < selective.peak_activation_bytes);
  }
}

}  // namespace

TEST_CASE("activation recomputation: bitwise the gradients of no recomputation, and a lower activation peak") {
  for (const Case& c : {Case{"dense TP1", dense_model(), {}},
                        Case{"dense TP2 x PP2", dense_model(), {.tensor = 2, .pipeline = 2}},
                        Case{"MoE EP2", moe_model(), {.data = 2, .expert = 2}},
                        Case{"MoE TP2 x EP2", moe_model(), {.tensor = 2, .data = 2, .expert = 2}}})
    check_recomputation<P>(c);
}

TEST_CASE("Bf16Mixed: recomputation is bitwise too, and 16-bit activations lower the activation peak") {
  using B = Policy<backend::Host, comm::ThreadComm, precision::Bf16Mixed>;
  for (const Case& c : {Case{"dense TP1", dense_model(), {}},
                        Case{"dense TP2 x PP2", dense_model(), {.tensor = 2, .pipeline = 2}},
                        Case{"MoE EP2", moe_model(), {.data = 2, .expert = 2}}}) {
    check_recomputation<B>(c);
    CAPTURE(c.name);
    using G = model::RecomputeGranularity;
    for (const model::RecomputeConfig& rc : {model::RecomputeConfig{}, model::RecomputeConfig{G::Selective},
                                             model::RecomputeConfig{G::Full, model::RecomputeMethod::Uniform, 1}}) {
      CAPTURE(static_cast<int>(rc.granularity));
      const Run fp32 = run<P>(c.config, rc, c.layout, 2), bf16 = run<B>(c.config, rc, c.layout, 2);
      // The Activations category only: peak_activation_bytes also holds, in mixed precision, the
      // fp32 gradients a backward allocates (fp32 training allocates them before the step).
      CAPTURE(fp32.peak_activations);
      CAPTURE(bf16.peak_activations);
      CHECK(bf16.peak_activations < fp32.peak_activations);  // full: the group inputs stay 16-bit
      for (std::size_t s = 0; s < fp32.losses.size(); ++s)  // the same model, 16-bit rounding apart
        CHECK(std::abs(bf16.losses[s] - fp32.losses[s]) < 0.05);
    }
  }
}

// --use-flash-attn (model/config.hpp) computes the same attention in another order (per query
// tile, backward's probabilities recomputed as exp(s - lse)): the losses and parameters agree
// with the materialising attention to fp32 rounding, not bitwise. Measured over 3 steps: losses within 2e-9 relative
// (bound 1e-7), parameters within 1.1e-5 (|a - b| / max(1, |b|); bound 1e-4: Adam's normalised
// update turns a rounding difference in a near-zero gradient into a visible fraction of a
// 3e-3 step, still 1/30 of one step). The activation peak is lower: no [b, heads/t, s, s]
// probabilities. Every recomputation of a flash model is bitwise its run without (selective
// then recomputes only the SwiGLU activations), in fp32 and with Bf16Mixed.
TEST_CASE("flash attention: the losses and parameters of the materialising attention, at a lower activation peak") {
  for (const Case& c : {Case{"dense TP1", dense_model(), {}},
                        Case{"dense TP2 x PP2", dense_model(), {.tensor = 2, .pipeline = 2}},
                        Case{"MoE EP2", moe_model(), {.data = 2, .expert = 2}}}) {
    CAPTURE(c.name);
    auto flash_config = c.config;
    flash_config.use_flash_attn = true;
    const Run eager = run(c.config, {}, c.layout, 3), flash = run(flash_config, {}, c.layout, 3);
    REQUIRE(flash.losses.size() == eager.losses.size());
    for (std::size_t s = 0; s < eager.losses.size(); ++s)
      CHECK(std::abs(flash.losses[s] - eager.losses[s]) <= 1e-7 * std::abs(eager.losses[s]));
    double worst = 0.0;
    for (const auto& [name, want] : eager.values) {
      const auto& got = flash.values.at(name);
      REQUIRE(got.size() == want.size());
      for (std::size_t i = 0; i < got.size(); ++i)
        worst = std::max(worst, std::abs(double(got[i]) - want[i]) / std::max(1.0, std::abs(double(want[i]))));
    }
    CAPTURE(worst);
    CHECK(worst > 0.0);  // not the materialising path by accident
    CHECK(worst < 1e-4);
    CHECK(flash.peak_activation_bytes < eager.peak_activation_bytes);
  }
  // Every recomputation is bitwise with flash too, in fp32 and with 16-bit activations.
  auto flash_dense = dense_model();
  flash_dense.use_flash_attn = true;
  check_recomputation<P>(Case{"dense TP2 x PP2, flash", flash_dense, {.tensor = 2, .pipeline = 2}});
  check_recomputation<Policy<backend::Host, comm::ThreadComm, precision::Bf16Mixed>>(
      Case{"dense TP1, flash", flash_dense, {}});
}

TEST_CASE("recompute flags: bad names and group sizes throw ConfigError naming them") {
  CHECK_THROWS_WITH_AS(model::RecomputeConfig::from_names("most", "uniform", 1),
                       "--recompute-granularity must be none, selective or full, got 'most'", ConfigError);
  CHECK_THROWS_WITH_AS(model::RecomputeConfig::from_names("full", "blocks", 1),
                       "--recompute-method must be uniform or block, got 'blocks'", ConfigError);
  CHECK_THROWS_WITH_AS(model::RecomputeConfig::from_names("full", "uniform", 0),
                       "--recompute-num-layers must be >= 1, got 0", ConfigError);
}

}  // namespace train_recompute_test
