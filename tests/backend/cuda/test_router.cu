// CUDA MoE routing ops against the Host ops on the same inputs: top-k (with ties and group
// limiting), gate weights and their backward, the sequence-wise balance loss and its backward,
// expert counts, the bias step and capacity dropping.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <tuple>
#include <vector>

#include "../../relative_error.hpp"
#include "../gradcheck.hpp"
#include "device_vectors.hpp"
#include "dsp/backend/cuda/router.cuh"
#include "dsp/backend/host/router.hpp"

using dsp::backend::Cuda;
using dsp::backend::DeviceBuffer;
using dsp::backend::Host;
using dsp::test::on_device;
using dsp::test::on_host;
using dsp::test::random_vector;
using dsp::test::relative_error;

// Selections, counts and drops are exact (the same shared selection code on both sides, and
// sorts with the Host op's order). Weights and gradients are the same fp32/fp64 formulas in
// other summation orders: ~1e-7 relative; 1e-5 is the issue's fp32 bound.
constexpr double kTol = 1e-5;

namespace {
// Scores on a coarse grid (multiples of 1/8 in [0, 1)) so that ties are common.
std::vector<float> tied_scores(std::int64_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = float(gen() % 8) / 8.0f;
  return v;
}
}  // namespace

TEST_CASE("router_topk equals the Host selection: ties, bias, group limiting; NaN throws") {
  const Cuda b{};
  const std::int64_t tokens = 777, experts = 64, top_k = 6;
  const auto scores = tied_scores(tokens * experts, 1), bias = random_vector(experts, 2, -0.01f, 0.01f);
  auto d_scores = on_device(b, scores), d_bias = on_device(b, bias);
  for (auto [groups, group_topk, with_bias] : {std::tuple{1L, 1L, false}, {8L, 3L, true}, {64L, 10L, true}}) {
    CAPTURE(groups);
    std::vector<std::int32_t> chosen(tokens * top_k);
    router_topk(Host{}, scores.data(), with_bias ? bias.data() : nullptr, tokens, experts, groups, group_topk, top_k,
                chosen.data());
    DeviceBuffer<std::int32_t> d_chosen(b, chosen.size());
    router_topk(b, d_scores.data(), with_bias ? d_bias.data() : nullptr, tokens, experts, groups, group_topk, top_k,
                d_chosen.data());
    CHECK(on_host(d_chosen) == chosen);
  }
  auto bad = scores;
  bad[5 * experts + 9] = NAN;
  auto d_bad = on_device(b, bad);
  DeviceBuffer<std::int32_t> d_chosen(b, std::size_t(tokens * top_k));
  CHECK_THROWS_WITH_AS(router_topk(b, d_bad.data(), nullptr, tokens, experts, 1, 1, top_k, d_chosen.data()),
                       "router: NaN score for token 5 expert 9", dsp::Error);
}

TEST_CASE("gate weights, their backward (with dropped slots), the balance loss and its backward equal the Host") {
  const Cuda b{};
  const std::int64_t seq_len = 50, sequences = 3, tokens = seq_len * sequences, experts = 16, top_k = 4;
  const auto scores = random_vector(tokens * experts, 3, 0.01f, 1.0f), dweights = random_vector(tokens * top_k, 4);
  std::vector<std::int32_t> chosen(tokens * top_k);
  router_topk(Host{}, scores.data(), nullptr, tokens, experts, 1, 1, top_k, chosen.data());
  std::vector<std::uint8_t> kept(chosen.size());
  for (std::size_t i = 0; i < kept.size(); ++i) kept[i] = std::uint8_t(i % 5 != 0);
  auto d_scores = on_device(b, scores), d_dweights = on_device(b, dweights);
  auto d_chosen = on_device(b, chosen);
  auto d_kept = on_device(b, kept);
  for (bool normalize : {false, true}) {
    CAPTURE(normalize);
    std::vector<float> weights(chosen.size()), dscores(scores.size());
    router_gate_weights(Host{}, scores.data(), chosen.data(), tokens, experts, top_k, normalize, 2.5f, weights.data());
    router_gate_weights_backward(Host{}, scores.data(), chosen.data(), kept.data(), dweights.data(), tokens, experts,
                                 top_k, normalize, 2.5f, dscores.data());
    DeviceBuffer<float> d_weights(b, weights.size()), d_dscores(b, dscores.size());
    router_gate_weights(b, d_scores.data(), d_chosen.data(), tokens, experts, top_k, normalize, 2.5f,
                        d_weights.data());
    router_gate_weights_backward(b, d_scores.data(), d_chosen.data(), d_kept.data(), d_dweights.data(), tokens,
                                 experts, top_k, normalize, 2.5f, d_dscores.data());
    CHECK(relative_error(on_host(d_weights), weights) < kTol);
    const auto got = on_host(d_dscores);
    CHECK(relative_error(got, dscores) < kTol);
    for (std::size_t i = 0; i < got.size(); ++i)
      if (dscores[i] == 0.0f) CHECK(got[i] == 0.0f);  // unchosen experts exactly 0
  }
  const float loss = sequence_balance_loss(Host{}, scores.data(), chosen.data(), tokens, experts, top_k, seq_len, 0.3f);
  CHECK(sequence_balance_loss(b, d_scores.data(), d_chosen.data(), tokens, experts, top_k, seq_len, 0.3f) ==
        doctest::Approx(loss).epsilon(kTol));
  std::vector<float> dscores(scores.size());
  sequence_balance_loss_backward(Host{}, scores.data(), chosen.data(), tokens, experts, top_k, seq_len, 0.3f, 1.7f,
                                 dscores.data());
  DeviceBuffer<float> d_dscores(b, dscores.size());
  sequence_balance_loss_backward(b, d_scores.data(), d_chosen.data(), tokens, experts, top_k, seq_len, 0.3f, 1.7f,
                                 d_dscores.data());
  CHECK(relative_error(on_host(d_dscores), dscores) < kTol);
}

TEST_CASE("expert counts, the bias step and capacity dropping (by weight and by order) equal the Host") {
  const Cuda b{};
  const std::int64_t tokens = 400, experts = 12, top_k = 3, slots = tokens * top_k;
  std::mt19937 gen(5);
  std::vector<std::int32_t> chosen(slots);
  for (auto& e : chosen) e = std::int32_t(gen() % experts);
  auto d_chosen = on_device(b, chosen);
  std::vector<std::int64_t> counts(experts);
  expert_counts(Host{}, chosen.data(), slots, experts, counts.data());
  DeviceBuffer<std::int64_t> d_counts(b, experts);
  expert_counts(b, d_chosen.data(), slots, experts, d_counts.data());
  CHECK(on_host(d_counts) == counts);
  auto bad = chosen;
  bad[17] = -3;
  auto d_bad = on_device(b, bad);
  CHECK_THROWS_WITH_AS(expert_counts(b, d_bad.data(), slots, experts, d_counts.data()),
                       "expert index -3 outside [0, 12)", dsp::Error);

  auto bias = random_vector(experts, 6);
  auto d_bias = on_device(b, bias);
  expert_bias_update(Host{}, bias.data(), counts.data(), experts, 1e-3f);
  expert_bias_update(b, d_bias.data(), on_device(b, counts).data(), experts, 1e-3f);
  CHECK(on_host(d_bias) == bias);

  // Weights on a coarse grid (ties to the earlier slot matter); a fifth of the slots dropped
  // already; capacity below the mean load (100 per expert) so that most experts drop some.
  std::vector<float> weights(slots);
  for (auto& w : weights) w = float(gen() % 16) / 16.0f;
  std::vector<std::uint8_t> kept(slots);
  for (auto& k : kept) k = std::uint8_t(gen() % 5 != 0);
  for (bool by_weight : {true, false}) {
    CAPTURE(by_weight);
    auto w = weights;
    auto k = kept;
    std::vector<std::int64_t> dropped(experts);
    const std::int64_t total =
        capacity_drop(Host{}, chosen.data(), tokens, top_k, experts, 70, by_weight, w.data(), k.data(), dropped.data());
    auto d_w = on_device(b, weights);
    auto d_k = on_device(b, kept);
    DeviceBuffer<std::int64_t> d_dropped(b, experts);
    CHECK(capacity_drop(b, d_chosen.data(), tokens, top_k, experts, 70, by_weight, d_w.data(), d_k.data(),
                        d_dropped.data()) == total);
    CHECK(total > 0);
    CHECK(on_host(d_k) == k);
    CHECK(on_host(d_w) == w);
    CHECK(on_host(d_dropped) == dropped);
  }
  // A kept slot naming an expert out of range is refused as by the Host op, nothing changed.
  auto bad_chosen = chosen;
  bad_chosen[40] = std::int32_t(experts);
  std::vector<std::uint8_t> all_kept(slots, 1);
  auto d_bad_chosen = on_device(b, bad_chosen);
  auto d_all_kept = on_device(b, all_kept);
  auto d_w = on_device(b, weights);
  DeviceBuffer<std::int64_t> d_dropped(b, experts);
  CHECK_THROWS_WITH_AS(capacity_drop(b, d_bad_chosen.data(), tokens, top_k, experts, 70, true, d_w.data(),
                                     d_all_kept.data(), d_dropped.data()),
                       "capacity_drop: expert 12 outside [0, 12)", dsp::Error);
  CHECK(on_host(d_all_kept) == all_kept);
  CHECK(on_host(d_w) == weights);
}
