// Activation recomputation (model/recompute.hpp): selective (attention probabilities and SwiGLU
// activations recomputed in backward) and full (uniform groups of 1 and 2 layers, block) give
// bitwise the gradients, losses and parameters of no recomputation, for a dense and a
// DeepSeekMoE model (routed experts split over EP2), at TP1 and TP2 x PP2; and they keep less:
// the measured activation peak of a step falls from none to selective to full. Bitwise, because
// the recomputed forward is the same arithmetic on the same inputs (fixed threads: same GEMM
// shapes, same summation order).
#include <doctest/doctest.h>

#include <map>
#include <mutex>
#include <string>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/trainer.hpp"
#include "small_model.hpp"

using namespace dsp;
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

struct Run {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> grads, values;  // rank 0's local shards after the steps
  std::int64_t peak_activation_bytes = 0;                      // rank 0, largest over the steps
};

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
    train::Trainer<P> trainer(config, tc, mesh, test::shakespeare(config.seq_length));
    Run r;
    for (int s = 0; s < steps; ++s) {
      const auto step = trainer.train_step();
      r.losses.push_back(step.loss);
      r.peak_activation_bytes = std::max(r.peak_activation_bytes, step.peak_activation_bytes);
    }
    for (auto* p : trainer.parameters()) {
      r.grads[p->spec.name].assign(p->grad.values().begin(), p->grad.values().end());
      r.values[p->spec.name].assign(p->value.values().begin(), p->value.values().end());
    }
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

}  // namespace

TEST_CASE("activation recomputation: bitwise the gradients of no recomputation, and a lower activation peak") {
  using G = model::RecomputeGranularity;
  using M = model::RecomputeMethod;
  auto dense = test::small_model();
  dense.num_layers = 4;
  dense.seq_length = 64;
  struct Case {
    const char* name;
    model::ModelConfig config;
    ParallelLayout layout;
  };
  for (const Case& c : {Case{"dense TP1", dense, {}}, Case{"dense TP2 x PP2", dense, {.tensor = 2, .pipeline = 2}},
                        Case{"MoE EP2", moe_model(), {.data = 2, .expert = 2}},
                        Case{"MoE TP2 x EP2", moe_model(), {.tensor = 2, .data = 2, .expert = 2}}}) {
    CAPTURE(c.name);
    const Run none = run(c.config, {}, c.layout, 3);
    const Run selective = run(c.config, {G::Selective, M::Uniform, 1}, c.layout, 3);
    for (const model::RecomputeConfig& rc : {model::RecomputeConfig{G::Selective, M::Uniform, 1},
                                             model::RecomputeConfig{G::Full, M::Uniform, 1},
                                             model::RecomputeConfig{G::Full, M::Uniform, 2},
                                             model::RecomputeConfig{G::Full, M::Block, 1}}) {
      CAPTURE(static_cast<int>(rc.granularity));
      CAPTURE(static_cast<int>(rc.method));
      CAPTURE(rc.num_layers);
      const Run r = run(c.config, rc, c.layout, 3);
      CHECK(r.losses == none.losses);
      CHECK(r.grads == none.grads);  // the last step's reduced, clipped gradients
      CHECK(r.values == none.values);
      CHECK(r.peak_activation_bytes < none.peak_activation_bytes);
      if (rc.granularity == G::Full && rc.method == M::Uniform)
        CHECK(r.peak_activation_bytes < selective.peak_activation_bytes);
    }
  }
}

TEST_CASE("recompute flags: bad names and group sizes throw ConfigError naming them") {
  CHECK_THROWS_WITH_AS(model::RecomputeConfig::from_names("most", "uniform", 1),
                       "--recompute-granularity must be none, selective or full, got 'most'", ConfigError);
  CHECK_THROWS_WITH_AS(model::RecomputeConfig::from_names("full", "blocks", 1),
                       "--recompute-method must be uniform or block, got 'blocks'", ConfigError);
  CHECK_THROWS_WITH_AS(model::RecomputeConfig::from_names("full", "uniform", 0),
                       "--recompute-num-layers must be >= 1, got 0", ConfigError);
}
