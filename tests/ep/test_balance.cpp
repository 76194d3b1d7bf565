// ep balance and capacity: the sequence-wise auxiliary loss against eqs 17-20 written out and
// finite differences, the auxiliary-loss-free bias update on a skewed router, capacity dropping.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "../backend/gradcheck.hpp"
#include "dsp/ep/balance.hpp"
#include "dsp/ep/capacity.hpp"
#include "dsp/ep/router.hpp"
#include "spaced_logits.hpp"

namespace ep_balance_test {

using dsp::ConfigError;
using dsp::ep::DropPolicy;
using dsp::ep::RouterConfig;
using dsp::ep::Routing;
using dsp::ep::ScoreFunction;
using dsp::test::kGradTol;
using dsp::test::max_grad_error;
using dsp::test::random_vector;

namespace {

// DeepSeek-V3 eqs 17-20 in fp64, one sequence at a time, averaged over the sequences.
double reference_aux(const Routing& r, std::int64_t seq_len, double alpha) {
  const std::int64_t E = r.num_experts, k = r.top_k, B = r.tokens / seq_len;
  double total = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < E; ++i) {
      double count = 0, p = 0;
      for (std::int64_t t = b * seq_len; t < (b + 1) * seq_len; ++t) {
        for (std::int64_t j = 0; j < k; ++j) count += r.experts[t * k + j] == i;
        double sum = 0;
        for (std::int64_t e = 0; e < E; ++e) sum += r.scores[t * E + e];
        p += r.scores[t * E + i] / sum;
      }
      const double f = double(E) / double(k * seq_len) * count;
      total += f * p / double(seq_len);
    }
  }
  return alpha * total / double(B);
}

}  // namespace

TEST_CASE("sequence aux loss equals eqs 17-20 written out, and its gradient finite differences") {
  const std::int64_t seq_len = 5, sequences = 3;
  const float alpha = 0.3f;
  for (const RouterConfig& c :
       {RouterConfig{.num_experts = 8, .top_k = 2, .score = ScoreFunction::Softmax},
        RouterConfig{.num_experts = 8, .top_k = 3, .score = ScoreFunction::Sigmoid, .num_groups = 4, .group_topk = 2}}) {
    CAPTURE(c.top_k);
    auto z = dsp::test::spaced_logits(seq_len * sequences, c.num_experts, 31);
    const auto bias = random_vector(c.num_experts, 32, -0.005f, 0.005f);  // small: keeps the selection apart
    const Routing base = dsp::ep::route(c, z, bias);
    // fp32 scores summed in fp64 against an fp64 sum of the same scores: ~1e-7 relative.
    CHECK(dsp::ep::sequence_aux_loss(base, seq_len, alpha) == doctest::Approx(reference_aux(base, seq_len, alpha)).epsilon(1e-6));
    // Gradient through P (the counts f are constant while the selection is); kGradTol = 1e-3
    // (tests/backend/gradcheck.hpp), measured worst 2.3e-6.
    std::vector<float> dz(z.size(), 0.25f);
    const float dloss = 1.7f;
    dsp::ep::sequence_aux_loss_backward(c, base, seq_len, alpha, dloss, dz);
    for (float& v : dz) v -= 0.25f;
    bool same_choice = true;
    const double err = max_grad_error(z, dz, [&] {
      const Routing r = dsp::ep::route(c, z, bias);
      same_choice = same_choice && r.experts == base.experts;
      return double(dloss) * dsp::ep::sequence_aux_loss(r, seq_len, alpha);
    });
    CHECK(same_choice);
    CHECK(err < kGradTol);
  }
}

TEST_CASE("aux loss is alpha when perfectly balanced and grows with imbalance") {
  // 4 tokens, 4 experts, top-1, each token strongly prefers a different expert.
  const RouterConfig c{.num_experts = 4, .top_k = 1, .score = ScoreFunction::Softmax};
  std::vector<float> z(16, 0.0f);
  for (int t = 0; t < 4; ++t) z[t * 4 + t] = 20.0f;  // P_i ~ 1/4, f_i = 1
  CHECK(dsp::ep::sequence_aux_loss(dsp::ep::route(c, z), 4, 0.01f) == doctest::Approx(0.01).epsilon(1e-6));
  std::fill(z.begin(), z.end(), 0.0f);
  for (int t = 0; t < 4; ++t) z[t * 4] = 20.0f;  // every token to expert 0: f_0 = 4, P_0 ~ 1
  CHECK(dsp::ep::sequence_aux_loss(dsp::ep::route(c, z), 4, 0.01f) == doctest::Approx(0.04).epsilon(1e-6));
}

TEST_CASE("expert capacity: ceil(factor * tokens * k / E), never above the tokens, dropless at factor <= 0") {
  CHECK(dsp::ep::expert_capacity(1.0f, 10, 2, 4) == 5);
  CHECK(dsp::ep::expert_capacity(1.25f, 10, 2, 4) == 7);  // ceil(6.25)
  CHECK(dsp::ep::expert_capacity(100.0f, 10, 2, 4) == 10);
  CHECK(dsp::ep::expert_capacity(0.0f, 10, 2, 4) == 10);
  CHECK(dsp::ep::expert_capacity(-1.0f, 10, 2, 4) == 10);
  CHECK(dsp::ep::expert_capacity(1.0f, 0, 2, 4) == 0);
  CHECK_THROWS_AS(dsp::ep::expert_capacity(NAN, 10, 2, 4), ConfigError);
  CHECK_THROWS_AS(dsp::ep::expert_capacity(1.0f, 10, 2, 0), ConfigError);
}

TEST_CASE("capacity drops: counted, none past capacity, probability keeps the heaviest, position the earliest") {
  const RouterConfig c{.num_experts = 8, .top_k = 2, .score = ScoreFunction::Softmax, .norm_topk_prob = true};
  const std::int64_t T = 64, seq_len = 16;
  auto z = random_vector(T * c.num_experts, 41, -1.0f, 1.0f);
  for (std::int64_t t = 0; t < T; ++t) z[t * 8] += 1.0f;  // expert 0 is popular
  const Routing routed = dsp::ep::route(c, z);
  const auto load = dsp::ep::expert_load(routed);
  const float aux = dsp::ep::sequence_aux_loss(routed, seq_len, 0.01f);
  for (float factor : {0.5f, 1.0f, 2.0f, 0.0f}) {
    for (DropPolicy policy : {DropPolicy::Probability, DropPolicy::Position}) {
      CAPTURE(factor);
      const std::int64_t cap = dsp::ep::expert_capacity(factor, T, c.top_k, c.num_experts);
      Routing r = routed;
      const auto d = dsp::ep::apply_capacity(r, cap, policy);
      CHECK(r.experts == routed.experts);
      // The aux loss reads the selection before dropping: the capacity factor does not change it.
      CHECK(dsp::ep::sequence_aux_loss(r, seq_len, 0.01f) == aux);
      std::int64_t total = 0;
      for (std::int32_t e = 0; e < c.num_experts; ++e) {
        std::vector<float> kept_w, dropped_w;
        std::vector<std::int64_t> kept_t, dropped_t;
        for (std::int64_t i = 0; i < T * c.top_k; ++i) {
          if (r.experts[i] != e) continue;
          (r.kept[i] ? kept_w : dropped_w).push_back(routed.weights[i]);
          (r.kept[i] ? kept_t : dropped_t).push_back(i / c.top_k);
          if (!r.kept[i]) CHECK(r.weights[i] == 0.0f);
          if (r.kept[i]) CHECK(r.weights[i] == routed.weights[i]);
        }
        CHECK(std::ssize(kept_w) == std::min(load[e], cap));
        CHECK(d.dropped_per_expert[e] == std::max<std::int64_t>(0, load[e] - cap));
        CHECK(std::ssize(dropped_w) == d.dropped_per_expert[e]);
        total += d.dropped_per_expert[e];
        if (dropped_w.empty()) continue;
        if (policy == DropPolicy::Probability)
          CHECK(*std::min_element(kept_w.begin(), kept_w.end()) >= *std::max_element(dropped_w.begin(), dropped_w.end()));
        else
          CHECK(*std::max_element(kept_t.begin(), kept_t.end()) < *std::min_element(dropped_t.begin(), dropped_t.end()));
      }
      CHECK(d.dropped == total);
      CHECK(std::count(r.kept.begin(), r.kept.end(), 0) == total);
      if (factor == 0.5f) CHECK(total > 0);
      if (factor == 0.0f) CHECK(total == 0);
      // Applying the same capacity again drops nothing more.
      CHECK(dsp::ep::apply_capacity(r, cap, policy).dropped == 0);
    }
  }
  Routing r = routed;
  CHECK_THROWS_AS(dsp::ep::apply_capacity(r, -1, DropPolicy::Position), dsp::Error);
}

TEST_CASE("bias update: +gamma below the mean load, -gamma above, 0 at it") {
  std::vector<float> bias = {0.0f, 0.5f, -0.5f, 1.0f};
  const std::vector<std::int64_t> load = {4, 2, 3, 3};  // mean 3
  dsp::ep::update_expert_bias(bias, load, 0.125f);
  CHECK(bias == std::vector<float>{-0.125f, 0.625f, -0.5f, 1.0f});
  CHECK_THROWS_AS(dsp::ep::update_expert_bias(bias, load, -1.0f), ConfigError);
  CHECK_THROWS_AS(dsp::ep::update_expert_bias(bias, std::vector<std::int64_t>(3), 0.1f), dsp::Error);
}

TEST_CASE("a skewed sigmoid router: 50 steps of route + bias update lower max/mean load") {
  // 16 experts in 4 groups (keep 2), top-4, 256 tokens a step; experts 0-3 get +1.5 on their
  // logits, experts 4-7 +0.75, plus fresh N(0, 1) noise every step. gamma = 0.02.
  // Measured: max/mean load 2.52 at step 0, 1.27 averaged over steps 40-49.
  const RouterConfig c{.num_experts = 16, .top_k = 4, .score = ScoreFunction::Sigmoid, .num_groups = 4,
                       .group_topk = 2, .routed_scaling_factor = 2.5f};
  const std::int64_t T = 256;
  std::mt19937 gen(5);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<float> bias(16, 0.0f), z(T * 16);
  const auto max_over_mean = [&](const std::vector<std::int64_t>& load) {
    return double(*std::max_element(load.begin(), load.end())) / (double(T * c.top_k) / 16);
  };
  double first = 0, last = 0;
  for (int step = 0; step < 50; ++step) {
    for (std::int64_t t = 0; t < T; ++t)
      for (int e = 0; e < 16; ++e) z[t * 16 + e] = (e < 4 ? 1.5f : e < 8 ? 0.75f : 0.0f) + noise(gen);
    const auto load = dsp::ep::expert_load(dsp::ep::route(c, z, bias));
    if (step == 0) first = max_over_mean(load);
    if (step >= 40) last += max_over_mean(load) / 10;
    dsp::ep::update_expert_bias(bias, load, 0.02f);
  }
  MESSAGE("max/mean load: step 0 ", first, ", steps 40-49 ", last);
  CHECK(first > 2.0);
  CHECK(last < 1.5);
}

TEST_CASE("sequence aux loss rejects a token count that is not whole sequences") {
  const RouterConfig c{.num_experts = 4, .top_k = 2};
  const Routing r = dsp::ep::route(c, std::vector<float>(4 * 6));
  CHECK_THROWS_WITH_AS(dsp::ep::sequence_aux_loss(r, 4, 0.1f), doctest::Contains("6 tokens"), dsp::Error);
  CHECK_THROWS_AS(dsp::ep::sequence_aux_loss(r, 0, 0.1f), dsp::Error);
  std::vector<float> dz(24);
  CHECK_THROWS_AS(dsp::ep::sequence_aux_loss_backward(c, r, 4, 0.1f, 1.0f, dz), dsp::Error);
  CHECK(dsp::ep::sequence_aux_loss(dsp::ep::route(c, std::vector<float>{}), 4, 0.1f) == 0.0f);
}

}  // namespace ep_balance_test
