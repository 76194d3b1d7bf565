// ep routers: softmax / sigmoid top-k, correction bias, group-limited selection, gate weights
// and their backward, against a plain reference written here and central finite differences.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "../backend/gradcheck.hpp"
#include "dsp/ep/capacity.hpp"
#include "dsp/ep/router.hpp"
#include "spaced_logits.hpp"

namespace ep_router_test {

using dsp::ConfigError;
using dsp::ep::RouterConfig;
using dsp::ep::Routing;
using dsp::ep::ScoreFunction;
using dsp::test::kGradTol;
using dsp::test::max_grad_error;
using dsp::test::max_rel_diff;
using dsp::test::random_vector;
using dsp::test::spaced_logits;

namespace {

// fp32 router (one exp, a sum, a division and a scale per weight, ~6e-8 relative each) against
// the fp64 reference below, as max_rel_diff: measured worst case 1.1e-7; 1e-6 leaves margin.
constexpr double kRouteTol = 1e-6;

struct Reference {
  std::vector<std::int32_t> experts;
  std::vector<double> weights, scores;
};

// The router written plainly in fp64: sort every expert of a token, take the best k.
Reference reference_route(const RouterConfig& c, const std::vector<float>& logits, const std::vector<float>& bias) {
  const std::int64_t E = c.num_experts, T = static_cast<std::int64_t>(logits.size()) / E, per = E / c.num_groups;
  Reference ref;
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<double> s(E), biased(E);
    double mx = -INFINITY, sum = 0;
    for (std::int64_t e = 0; e < E; ++e) mx = std::max(mx, double(logits[t * E + e]));
    for (std::int64_t e = 0; e < E; ++e) sum += std::exp(double(logits[t * E + e]) - mx);
    for (std::int64_t e = 0; e < E; ++e) {
      const double z = logits[t * E + e];
      s[e] = c.score == ScoreFunction::Softmax ? std::exp(z - mx) / sum : 1.0 / (1.0 + std::exp(-z));
      biased[e] = s[e] + (bias.empty() ? 0.0 : bias[e]);
      ref.scores.push_back(s[e]);
    }
    std::vector<bool> allowed(E, true);
    std::vector<std::int32_t> groups(c.num_groups);
    std::iota(groups.begin(), groups.end(), 0);
    std::vector<double> group_score(c.num_groups);
    for (std::int64_t g = 0; g < c.num_groups; ++g) {
      std::vector<double> v(biased.begin() + g * per, biased.begin() + (g + 1) * per);
      std::sort(v.rbegin(), v.rend());
      group_score[g] = v[0] + (v.size() > 1 ? v[1] : 0.0);
    }
    std::stable_sort(groups.begin(), groups.end(), [&](int a, int b) { return group_score[a] > group_score[b]; });
    for (std::int64_t i = c.group_topk; i < c.num_groups; ++i)
      for (std::int64_t e = 0; e < per; ++e) allowed[groups[i] * per + e] = false;
    std::vector<std::int32_t> cand;
    for (std::int32_t e = 0; e < E; ++e)
      if (allowed[e]) cand.push_back(e);
    std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return biased[a] > biased[b]; });
    double wsum = 0;
    for (std::int64_t j = 0; j < c.top_k; ++j) wsum += s[cand[j]];
    const bool norm = c.top_k > 1 && (c.norm_topk_prob || c.score == ScoreFunction::Sigmoid);
    for (std::int64_t j = 0; j < c.top_k; ++j) {
      ref.experts.push_back(cand[j]);
      ref.weights.push_back(c.routed_scaling_factor * s[cand[j]] / (norm ? wsum : 1.0));
    }
  }
  return ref;
}

std::vector<RouterConfig> configs() {
  using enum ScoreFunction;
  return {
      {.num_experts = 16, .top_k = 2, .score = Softmax},
      {.num_experts = 16, .top_k = 3, .score = Softmax, .norm_topk_prob = true},
      {.num_experts = 16, .top_k = 4, .score = Softmax, .num_groups = 4, .group_topk = 2, .routed_scaling_factor = 2.5f},
      {.num_experts = 16, .top_k = 4, .score = Sigmoid, .routed_scaling_factor = 2.5f},
      {.num_experts = 16, .top_k = 4, .score = Sigmoid, .num_groups = 8, .group_topk = 3, .routed_scaling_factor = 2.5f},
      {.num_experts = 12, .top_k = 1, .score = Sigmoid, .num_groups = 3, .group_topk = 1},
      {.num_experts = 8, .top_k = 2, .score = Sigmoid, .num_groups = 8, .group_topk = 2},  // one expert per group
  };
}

}  // namespace

TEST_CASE("routing equals a plain sort-every-expert reference: softmax, sigmoid, bias, groups, scaling") {
  for (const auto& c : configs()) {
    CAPTURE(c.num_experts);
    CAPTURE(c.top_k);
    CAPTURE(c.num_groups);
    const std::int64_t T = 40;
    const auto logits = random_vector(T * c.num_experts, 7, -3.0f, 3.0f);
    for (bool with_bias : {false, true}) {
      const auto bias = with_bias ? random_vector(c.num_experts, 8, -0.3f, 0.3f) : std::vector<float>{};
      const Routing r = dsp::ep::route(c, logits, bias);
      const Reference ref = reference_route(c, logits, bias);
      CHECK(r.tokens == T);
      CHECK(r.experts == ref.experts);
      CHECK(max_rel_diff(r.weights, ref.weights) < kRouteTol);
      CHECK(max_rel_diff(r.scores, ref.scores) < kRouteTol);
      CHECK(std::all_of(r.kept.begin(), r.kept.end(), [](auto k) { return k == 1; }));
      const auto load = dsp::ep::expert_load(r);
      CHECK(std::accumulate(load.begin(), load.end(), std::int64_t{0}) == T * c.top_k);
      for (std::int64_t e = 0; e < c.num_experts; ++e)
        CHECK(load[e] == std::count(ref.experts.begin(), ref.experts.end(), e));
    }
  }
}

TEST_CASE("ties go to the lower expert and the lower group") {
  const std::vector<float> z(8, 0.5f);
  const Routing a = dsp::ep::route({.num_experts = 8, .top_k = 3, .score = ScoreFunction::Sigmoid}, z);
  CHECK(a.experts == std::vector<std::int32_t>{0, 1, 2});
  const Routing b = dsp::ep::route(
      {.num_experts = 8, .top_k = 3, .score = ScoreFunction::Softmax, .num_groups = 4, .group_topk = 2}, z);
  CHECK(b.experts == std::vector<std::int32_t>{0, 1, 2});
  for (float w : b.weights) CHECK(w == doctest::Approx(1.0 / 8).epsilon(1e-6));
}

TEST_CASE("group-limited routing with every biased score negative selects only from the kept groups") {
  // 8 experts in 4 groups of 2, keep 2 groups. Sigmoid scores {.95, .002 | .5, .5 | .5, .02 |
  // .73, .62}: groups 3 (1.35) and 1 (1.0) have the largest top-2 sums, although the single best
  // expert (0) is in group 0. A mask with 0 instead of -inf would pick masked experts, whose 0
  // beats every biased score (all < -9). Experts 2 and 3 tie: 2 wins.
  const RouterConfig c{.num_experts = 8, .top_k = 3, .score = ScoreFunction::Sigmoid, .num_groups = 4,
                       .group_topk = 2, .routed_scaling_factor = 2.5f};
  const std::vector<float> z = {3.0f, -6.0f, 0.0f, 0.0f, 0.0f, -4.0f, 1.0f, 0.5f};
  const std::vector<float> bias(8, -10.0f);
  const Routing r = dsp::ep::route(c, z, bias);
  CHECK(r.experts == std::vector<std::int32_t>{6, 7, 2});
  for (auto e : r.experts) CHECK((e / 2 == 1 || e / 2 == 3));
  // Weights from the unbiased sigmoid scores, normalised over the three, times 2.5.
  const auto sig = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  const double sum = sig(1.0) + sig(0.5) + sig(0.0);
  CHECK(max_rel_diff(r.weights, {2.5 * sig(1.0) / sum, 2.5 * sig(0.5) / sum, 2.5 * sig(0.0) / sum}) < kRouteTol);
}

TEST_CASE("the bias flips the choice but the gate weights stay the unbiased scores, normalised") {
  const RouterConfig c{.num_experts = 4, .top_k = 2, .score = ScoreFunction::Sigmoid};
  const std::vector<float> z = {2.0f, 1.0f, 0.0f, -1.0f};
  const auto sig = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  const Routing plain = dsp::ep::route(c, z);
  CHECK(plain.experts == std::vector<std::int32_t>{0, 1});
  CHECK(max_rel_diff(plain.weights, {sig(2) / (sig(2) + sig(1)), sig(1) / (sig(2) + sig(1))}) < kRouteTol);
  // +1 on expert 3: biased 0.27 + 1 beats 0.88 and 0.73; its weight is still sigmoid(-1).
  const Routing biased = dsp::ep::route(c, z, std::vector<float>{0, 0, 0, 1.0f});
  CHECK(biased.experts == std::vector<std::int32_t>{3, 0});
  CHECK(max_rel_diff(biased.weights, {sig(-1) / (sig(-1) + sig(2)), sig(2) / (sig(-1) + sig(2))}) < kRouteTol);
  CHECK(biased.scores == plain.scores);
}

TEST_CASE("route_backward matches central finite differences of sum_j c_j w_j") {
  // Tolerance: kGradTol = 1e-3 (derived in tests/backend/gradcheck.hpp; measured worst here
  // 5.9e-6). The spaced logits hold the selection fixed (checked), so the loss is smooth.
  for (const auto& c : configs()) {
    CAPTURE(c.num_experts);
    CAPTURE(c.top_k);
    CAPTURE(c.num_groups);
    const std::int64_t T = 6;
    auto z = spaced_logits(T, c.num_experts, 21);
    const auto bias = random_vector(c.num_experts, 22, -0.005f, 0.005f);  // small: keeps the selection apart
    const auto coef = random_vector(T * c.top_k, 23);
    for (bool drop : {false, true}) {
      CAPTURE(drop);
      // With drop, each expert keeps its first token only (Position): dropped slots have weight
      // constant 0 but their score still enters the normalising sum of the kept ones.
      const auto run = [&] {
        Routing r = dsp::ep::route(c, z, bias);
        if (drop) dsp::ep::apply_capacity(r, 1, dsp::ep::DropPolicy::Position);
        return r;
      };
      const Routing base = run();
      if (drop) CHECK(std::count(base.kept.begin(), base.kept.end(), 0) > 0);
      std::vector<float> dz(z.size(), 0.5f);  // route_backward accumulates
      dsp::ep::route_backward(c, base, coef, dz);
      for (float& v : dz) v -= 0.5f;
      bool same_choice = true;
      const double err = max_grad_error(z, dz, [&] {
        const Routing r = run();
        same_choice = same_choice && r.experts == base.experts && r.kept == base.kept;
        return dsp::test::weighted_sum(r.weights, coef);
      });
      CHECK(same_choice);
      CHECK(err < kGradTol);
    }
  }
}

TEST_CASE("bad router configs and inputs throw, naming the numbers") {
  using doctest::Contains;
  CHECK_THROWS_WITH_AS((RouterConfig{.num_experts = 4, .top_k = 5}.validate()), Contains("top_k (5)"), ConfigError);
  CHECK_THROWS_WITH_AS((RouterConfig{.num_experts = 0}.validate()), Contains("got 0"), ConfigError);
  CHECK_THROWS_WITH_AS((RouterConfig{.num_experts = 10, .num_groups = 4}.validate()),
                       Contains("num_groups (4) must be >= 1 and divide num_experts (10)"), ConfigError);
  CHECK_THROWS_WITH_AS((RouterConfig{.num_experts = 8, .num_groups = 4, .group_topk = 5}.validate()),
                       Contains("group_topk (5)"), ConfigError);
  CHECK_THROWS_WITH_AS((RouterConfig{.num_experts = 16, .top_k = 5, .num_groups = 8, .group_topk = 2}.validate()),
                       Contains("top_k (5) exceeds"), ConfigError);
  CHECK_THROWS_AS((RouterConfig{.routed_scaling_factor = 0.0f}.validate()), ConfigError);
  CHECK_THROWS_AS((RouterConfig{.routed_scaling_factor = NAN}.validate()), ConfigError);
  CHECK_NOTHROW((RouterConfig{.num_experts = 16, .top_k = 4, .num_groups = 8, .group_topk = 2}.validate()));

  const RouterConfig c{.num_experts = 4, .top_k = 2};
  CHECK_THROWS_AS((dsp::ep::route(RouterConfig{.num_experts = 4, .top_k = 5}, std::vector<float>(8))), ConfigError);
  CHECK_THROWS_WITH_AS(dsp::ep::route(c, std::vector<float>(10)),
                       Contains("10 logits are not a multiple of num_experts (4)"), dsp::Error);
  CHECK_THROWS_WITH_AS(dsp::ep::route(c, std::vector<float>(8), std::vector<float>(3)), Contains("bias has 3"),
                       dsp::Error);
  CHECK_THROWS_WITH_AS(dsp::ep::route(c, std::vector<float>{NAN, 0, 0, 0}), Contains("NaN score"), dsp::Error);
  const Routing r = dsp::ep::route(c, std::vector<float>(8));
  std::vector<float> dz(8);
  CHECK_THROWS_AS(dsp::ep::route_backward(c, r, std::vector<float>(3), dz), dsp::Error);
  CHECK_THROWS_AS((dsp::ep::route_backward(RouterConfig{.num_experts = 8, .top_k = 2}, r, std::vector<float>(4), dz)),
                  dsp::Error);
  // No tokens is a normal case.
  const Routing empty = dsp::ep::route(c, std::vector<float>{});
  CHECK(empty.tokens == 0);
  CHECK(dsp::ep::expert_load(empty) == std::vector<std::int64_t>(4, 0));
}

TEST_CASE("capacity_drop refuses a kept slot whose expert is out of range, before changing anything") {
  std::vector<std::int32_t> chosen = {0, 1, 2, 5};  // 5 is not one of the 3 experts
  std::vector<float> weights = {0.1f, 0.2f, 0.3f, 0.4f};
  std::vector<std::uint8_t> kept = {1, 1, 1, 1};
  std::vector<std::int64_t> dropped(3, 7);
  CHECK_THROWS_WITH_AS(dsp::backend::capacity_drop(dsp::backend::Host{}, chosen.data(), 2, 2, 3, 1, true,
                                                   weights.data(), kept.data(), dropped.data()),
                       "capacity_drop: expert 5 outside [0, 3)", dsp::Error);
  CHECK(kept == std::vector<std::uint8_t>{1, 1, 1, 1});
  kept[3] = 0;  // a dropped slot's expert is not looked at
  CHECK(dsp::backend::capacity_drop(dsp::backend::Host{}, chosen.data(), 2, 2, 3, 1, true, weights.data(),
                                    kept.data(), dropped.data()) == 0);
}

}  // namespace ep_router_test
