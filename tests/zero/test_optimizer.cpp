// AdamW's first step against its closed form, the warmup + cosine schedule at its landmarks,
// and gradient-norm clipping that counts replicated and split elements once at any TP size.
#include <doctest/doctest.h>

#include <cmath>
#include <mutex>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/zero/lr_schedule.hpp"
#include "dsp/zero/zero_optimizer.hpp"

using namespace dsp;

namespace zero_optimizer_test {

TEST_CASE("AdamW first step: bias-corrected m/sqrt(v) = sign(g), plus decoupled weight decay") {
  // step 1: m_hat = g, v_hat = g^2, so p -= lr * (g / (|g| + eps) + wd * p)
  comm::launch(1, [](comm::ThreadComm& world) {
    dsp::Parameter p(ShardedTensor::replicated("w", {2, 2}), {dsp::Init::Ones}, 0, 1, 0);
    p.grad.values() = {0.5f, -2.0f, 1e-3f, 0.0f};
    dp::GradBuckets<comm::ThreadComm, backend::Host> buckets(world, {&p}, {});
    zero::ZeroOptimizer<backend::Host, comm::ThreadComm> opt(
        {&p}, {&buckets}, {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f}, 1, 0);
    opt.step(0.01f);
    const float lr = 0.01f, wd = 0.1f;
    const std::vector<float> g{0.5f, -2.0f, 1e-3f, 0.0f};
    for (int i = 0; i < 4; ++i)
      CHECK(p.value[i] == doctest::Approx(1.0f - lr * (g[i] / (std::abs(g[i]) + 1e-8f) + wd * 1.0f)).epsilon(1e-6));
    CHECK(opt.steps() == 1);
  });
}

TEST_CASE("warmup is linear, then cosine from max_lr to min_lr, then flat") {
  const zero::WarmupCosine s{.max_lr = 1.0f, .min_lr = 0.1f, .warmup_iters = 4, .decay_iters = 14};
  CHECK(s(0) == doctest::Approx(0.25));
  CHECK(s(3) == doctest::Approx(1.0));
  CHECK(s(4) == doctest::Approx(1.0));                  // start of the decay
  CHECK(s(9) == doctest::Approx(0.55));                 // half-way: (max + min) / 2
  CHECK(s(14) == doctest::Approx(0.1));
  CHECK(s(100) == doctest::Approx(0.1));
}

TEST_CASE("the global gradient norm counts every element once at TP 1, 2 and 4") {
  // A replicated [3] norm weight (grad 1 everywhere), a column-split [4, 2] (grad = row + 1)
  // and a QKV with 4 heads / 2 KV heads of dim 1 (replicated K/V at TP 4; grad 2 everywhere).
  // Global sum of squares: 3 * 1 + 2 * (1 + 4 + 9 + 16) + (8 rows x 2 columns) * 4 = 127.
  std::mutex mu;
  for (int tp : {1, 2, 4})
    comm::launch(tp, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
      const int r = mesh.tp_rank();
      dsp::Parameter norm(ShardedTensor::replicated("norm", {3}), {dsp::Init::Ones}, 0, tp, r);
      dsp::Parameter col(ShardedTensor::split("col", {4, 2}, 0), {}, 0, tp, r);
      dsp::Parameter qkv(ShardedTensor::qkv("qkv", 2, 4, 2, 1, {"q", "k", "v"}), {}, 0, tp, r);
      norm.grad.fill(1.0f);
      const auto rows = col.spec.index_map(tp, r);
      for (std::size_t i = 0; i < rows.size(); ++i) col.grad[2 * i] = col.grad[2 * i + 1] = float(rows[i] + 1);
      qkv.grad.fill(2.0f);
      dp::GradBuckets<comm::ThreadComm, backend::Host> buckets(mesh.data_group(), {&norm, &col, &qkv}, {});
      zero::ZeroOptimizer<backend::Host, comm::ThreadComm> opt({&norm, &col, &qkv}, {&buckets}, {}, tp, r);
      const float n = opt.clip_grad_norm(0.0f, mesh.tensor_group());
      std::lock_guard lk(mu);
      CHECK(n == doctest::Approx(std::sqrt(127.0)).epsilon(1e-6));
    });
}

}  // namespace zero_optimizer_test
