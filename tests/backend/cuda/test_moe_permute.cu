// CUDA MoE token movement (CUB radix sort by expert, row gathers and scatters) against the Host
// ops on the same inputs.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "../../relative_error.hpp"
#include "../gradcheck.hpp"
#include "device_vectors.hpp"
#include "dsp/backend/cuda/moe_permute.cuh"
#include "dsp/backend/host/moe_permute.hpp"

using dsp::backend::Cuda;
using dsp::backend::DeviceBuffer;
using dsp::backend::Host;
using dsp::test::on_device;
using dsp::test::on_host;
using dsp::test::random_vector;
using dsp::test::relative_error;

// Sorting, gathers and copies are exact. Scatters add a token's top_k rows atomically, in an
// order that varies: top_k = 3 fp32 additions, ~2e-7 relative; the weight gradient's fp64 dot
// is rounded once. 1e-5 is the issue's fp32 bound.
constexpr double kTol = 1e-5;

TEST_CASE("sort_by_expert equals the Host counting sort (stable, kept mask, counts); a bad expert throws") {
  const Cuda b{};
  const std::int64_t tokens = 5000, top_k = 3, experts = 37, assignments = tokens * top_k;
  std::mt19937 gen(7);
  std::vector<std::int32_t> chosen(assignments);
  std::vector<std::uint8_t> kept(assignments);
  for (auto& e : chosen) e = std::int32_t(gen() % experts);
  for (auto& k : kept) k = std::uint8_t(gen() % 4 != 0);
  auto d_chosen = on_device(b, chosen);
  auto d_kept = on_device(b, kept);
  for (bool with_mask : {true, false}) {
    CAPTURE(with_mask);
    std::vector<std::int64_t> order(assignments), counts(experts);
    const std::int64_t n = sort_by_expert(Host{}, chosen.data(), with_mask ? kept.data() : nullptr, assignments,
                                          experts, order.data(), counts.data());
    DeviceBuffer<std::int64_t> d_order(b, assignments), d_counts(b, experts);
    const std::int64_t got_n = sort_by_expert(b, d_chosen.data(), with_mask ? d_kept.data() : nullptr, assignments,
                                              experts, d_order.data(), d_counts.data());
    CHECK(got_n == n);
    CHECK(on_host(d_counts) == counts);
    auto got_order = on_host(d_order);
    got_order.resize(std::size_t(n));
    order.resize(std::size_t(n));
    CHECK(got_order == order);
  }
  chosen[123] = std::int32_t(experts);  // out of range (and kept: the mask is off)
  auto d_bad = on_device(b, chosen);
  DeviceBuffer<std::int64_t> d_order(b, assignments), d_counts(b, experts);
  CHECK_THROWS_WITH_AS(sort_by_expert(b, d_bad.data(), nullptr, assignments, experts, d_order.data(), d_counts.data()),
                       "sort_by_expert: expert 37 outside [0, 37)", dsp::Error);
}

TEST_CASE("permute, unpermute, combine (with backward) and regroup rows equal the Host ops") {
  const Cuda b{};
  const std::int64_t tokens = 200, top_k = 3, hidden = 130, n = tokens * top_k;
  std::vector<std::int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(3));
  const auto x = random_vector(tokens * hidden, 1), rows = random_vector(n * hidden, 2);
  const auto weights = random_vector(n, 3), dy = random_vector(tokens * hidden, 4), y0 = random_vector(tokens * hidden, 5);
  const auto dweights0 = random_vector(n, 6);
  auto d_order = on_device(b, order);
  auto d_x = on_device(b, x), d_rows = on_device(b, rows), d_weights = on_device(b, weights), d_dy = on_device(b, dy);

  std::vector<float> permuted(n * hidden);
  permute_rows(Host{}, x.data(), order.data(), n, top_k, hidden, permuted.data());
  DeviceBuffer<float> d_permuted(b, permuted.size());
  permute_rows(b, d_x.data(), d_order.data(), n, top_k, hidden, d_permuted.data());
  CHECK(on_host(d_permuted) == permuted);

  std::vector<float> dx = y0;
  unpermute_rows_add(Host{}, rows.data(), order.data(), n, top_k, hidden, dx.data());
  auto d_dx = on_device(b, y0);
  unpermute_rows_add(b, d_rows.data(), d_order.data(), n, top_k, hidden, d_dx.data());
  CHECK(relative_error(on_host(d_dx), dx) < kTol);

  std::vector<float> y = y0;
  combine_rows(Host{}, rows.data(), weights.data(), order.data(), n, top_k, hidden, y.data());
  auto d_y = on_device(b, y0);
  combine_rows(b, d_rows.data(), d_weights.data(), d_order.data(), n, top_k, hidden, d_y.data());
  CHECK(relative_error(on_host(d_y), y) < kTol);

  std::vector<float> drows(n * hidden), dweights = dweights0;
  combine_rows_backward(Host{}, rows.data(), weights.data(), order.data(), n, top_k, hidden, dy.data(), drows.data(),
                        dweights.data());
  DeviceBuffer<float> d_drows(b, drows.size());
  auto d_dweights = on_device(b, dweights0);
  combine_rows_backward(b, d_rows.data(), d_weights.data(), d_order.data(), n, top_k, hidden, d_dy.data(),
                        d_drows.data(), d_dweights.data());
  CHECK(relative_error(on_host(d_drows), drows) < kTol);
  CHECK(relative_error(on_host(d_dweights), dweights) < kTol);

  // 3 sources x 4 experts, with empty blocks; there and back again.
  const std::vector<std::int64_t> counts = {2, 0, 5, 1, 0, 3, 3, 0, 4, 1, 0, 2};
  const std::int64_t total = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
  const auto in = random_vector(total * hidden, 8);
  std::vector<float> regrouped(in.size());
  regroup_rows(Host{}, in.data(), counts.data(), 3, 4, hidden, true, regrouped.data());
  auto d_in = on_device(b, in);
  DeviceBuffer<float> d_regrouped(b, in.size()), d_back(b, in.size());
  regroup_rows(b, d_in.data(), counts.data(), 3, 4, hidden, true, d_regrouped.data());
  regroup_rows(b, d_regrouped.data(), counts.data(), 3, 4, hidden, false, d_back.data());
  CHECK(on_host(d_regrouped) == regrouped);
  CHECK(on_host(d_back) == in);
}
