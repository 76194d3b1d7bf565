// Backward of every layer against central finite differences, through the whole model:
// for each parameter tensor, the directional derivative of the mean loss along a random
// global direction v (drawn per (name, global index), so every TP rank perturbs its shard of
// the same global v) equals <grad, v> counted once per global element. Exercises
// VocabParallelEmbedding, RMSNorm, the fused QKV ColumnParallelLinear, RoPE, GQA attention,
// RowParallelLinear, SwiGLU MLP, the output layer (tied and untied) and the vocab-parallel
// cross-entropy, at TP1, TP2 (K/V heads split) and TP4 (K/V heads replicated).
//
// Tolerance: eps = 1e-3 along v ~ N(0, 1) per element. Truncation is O(eps^2 |L'''|) and the
// loss (fp32 per token, summed in double) carries rounding noise of order 1e-7 x L ~ 4e-7,
// i.e. ~2e-4 on the difference quotient; directional derivatives here are 0.05 to 5. So
// 5e-3 relative + 2e-4 absolute; measured worst case 1.8e-3 relative (9e-5 absolute) on a
// norm weight. With eps = 1e-2 curvature alone gives 10-20 % errors, so eps matters. A wrong
// factor, sign or missing term in any backward is an O(1) error.
#include <algorithm>
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>
#include <optional>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/model/causal_lm.hpp"
#include "dsp/policy.hpp"

using namespace dsp;

namespace model_model_gradients_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

model::ModelConfig config(bool tied) {
  // vocab 37 is not a multiple of 2 or 4: padded vocabulary rows are in play; std 0.3 gives
  // non-trivial attention and larger gradients
  return {.vocab_size = 37, .hidden_size = 16, .num_layers = 2, .num_attention_heads = 4, .num_query_groups = 2,
          .ffn_hidden_size = 24, .seq_length = 8, .tie_word_embeddings = tied, .init_method_std = 0.3f};
}

// Mean loss over a fixed batch of 2 sequences.
double loss(model::CausalLM<P>& m, bool backward) {
  const auto c = m.config();
  std::vector<std::int32_t> ids(16), targets(16);
  for (int i = 0; i < 16; ++i) {
    ids[i] = (7 * i + 3) % c.vocab_size;
    targets[i] = (5 * i + 1) % c.vocab_size;
  }
  targets[5] = -1;  // an ignored position
  const auto ctx = model::ForwardContext::for_training(2, 8);
  model::CausalLM<P>::Activations act;
  const auto l = m.forward(ctx, ids, targets, act);
  if (backward) {  // as the last micro-batch of a step: replicated K/V gradients summed, readiness reported
    std::vector<dsp::Parameter*> reported;
    const model::CausalLM<P>::GradReadyFn ready = [&](dsp::Parameter& p) { reported.push_back(&p); };
    m.backward(act, std::vector<float>(l.size(), 1.0f / 15.0f), &ready);
    CHECK(reported == m.grad_ready_order());  // each parameter once, in the documented order
  }
  return std::accumulate(l.begin(), l.end(), 0.0) / 15.0;
}

void check_gradients(int tp, bool tied) {
  comm::launch(tp, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
    model::CausalLM<P> m(config(tied), mesh, 42);
    auto& tpg = mesh.tensor_group();
    m.zero_grad();
    loss(m, true);
    auto all = m.parameters(), ordered = m.grad_ready_order();
    std::sort(all.begin(), all.end());
    std::sort(ordered.begin(), ordered.end());
    CHECK(all == ordered);  // grad_ready_order() is a permutation of parameters()
    for (auto* p : m.parameters()) {
      CAPTURE(p->spec.name);
      CAPTURE(tp);
      CAPTURE(tied);
      // the same global direction on every layout (padding rows of v are zero)
      const dsp::Parameter v(p->spec, {dsp::Init::Normal, 1.0f}, 7, tp, tpg.rank());
      const auto own = ownership_weights(p->spec, tp, tpg.rank());
      std::vector<double> dot{0.0};
      for (std::int64_t i = 0; i < v.value.numel(); ++i) dot[0] += double(own[i]) * p->grad[i] * v.value[i];
      tpg.all_reduce(std::span(dot));
      const float eps = 1e-3f;
      const Tensor saved = p->value;
      for (std::int64_t i = 0; i < v.value.numel(); ++i) p->value[i] = saved[i] + eps * v.value[i];
      const double up = loss(m, false);
      for (std::int64_t i = 0; i < v.value.numel(); ++i) p->value[i] = saved[i] - eps * v.value[i];
      const double down = loss(m, false);
      p->value = saved;
      const double fd = (up - down) / (2.0 * eps);
      CHECK(std::abs(fd - dot[0]) <= 5e-3 * std::abs(dot[0]) + 2e-4);
    }
  });
}

}  // namespace

TEST_CASE("model gradients match central finite differences, TP1/TP2/TP4, tied and untied") {
  for (bool tied : {false, true})
    for (int tp : {1, 2, 4}) check_gradients(tp, tied);
}

TEST_CASE("a model built in InferenceMode has no gradient buffers, the same values and logits, and refuses backward") {
  comm::launch(2, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = 2});
    const model::ModelConfig c = config(false);
    const auto before = memory::snapshot();
    model::CausalLM<P> trained(c, mesh, 42);
    const auto with_grads = memory::snapshot();
    std::optional<model::CausalLM<P>> served;
    {
      const InferenceMode inference;
      {
        const InferenceMode nested(false);  // turned off within: gradients again
        model::CausalLM<P> inner(c, mesh, 42);
        CHECK_FALSE(inner.inference());
        for (auto* p : inner.parameters()) CHECK(p->grad.numel() == p->value.numel());
      }
      CHECK(inference_mode());  // the enclosing scope's state is back
      served.emplace(c, mesh, 42);
    }
    CHECK_FALSE(inference_mode());
    const auto after = memory::snapshot();
    CHECK(served->inference());
    CHECK_FALSE(trained.inference());
    // Gradient bytes: the trained model's every weight again; the served model's none.
    const auto grads = [](const memory::Snapshot& s) { return s[memory::Category::Gradients].live; };
    std::int64_t weights = 0;
    for (auto* p : trained.parameters()) weights += p->value.numel() * static_cast<std::int64_t>(sizeof(float));
    CHECK(grads(with_grads) - grads(before) == weights);
    CHECK(grads(after) == grads(with_grads));
    const auto mine = served->parameters(), theirs = trained.parameters();
    REQUIRE(mine.size() == theirs.size());
    for (std::size_t i = 0; i < mine.size(); ++i) {
      CAPTURE(mine[i]->spec.name);
      CHECK(mine[i]->grad.numel() == 0);
      CHECK(std::equal(mine[i]->value.values().begin(), mine[i]->value.values().end(), theirs[i]->value.values().begin(),
                       theirs[i]->value.values().end()));
    }
    const std::vector<std::int32_t> ids{3, 14, 15, 9, 2, 6, 5, 35};
    const auto ctx = model::ForwardContext::for_training(1, 8);
    model::ForwardContext serving = ctx;
    serving.training = false;
    const Tensor a = served->logits(serving, ids), b = trained.logits(serving, ids);
    CHECK(std::equal(a.values().begin(), a.values().end(), b.values().begin(), b.values().end()));
    model::CausalLM<P>::Activations act;
    const auto l = served->forward(ctx, ids, ids, act);
    CHECK_THROWS_WITH_AS(served->backward(act, std::vector<float>(l.size(), 1.0f)), doctest::Contains("InferenceMode"),
                         Error);
  });
}

TEST_CASE("InferenceMode belongs to the thread that opens it: a rank thread launched inside it builds gradients") {
  const InferenceMode inference;
  comm::launch(1, [&](comm::ThreadComm& world) {
    CHECK_FALSE(inference_mode());
    DeviceMesh mesh(world, ParallelLayout{});
    model::CausalLM<P> m(config(true), mesh, 42);
    CHECK_FALSE(m.inference());
    for (auto* p : m.parameters()) CHECK(p->grad.numel() == p->value.numel());
  });
  CHECK(inference_mode());
}

}  // namespace model_model_gradients_test
