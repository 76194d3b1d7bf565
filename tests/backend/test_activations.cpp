// Host softmax, sigmoid and SwiGLU against closed forms and finite differences.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "dsp/backend/host/parallel_for.hpp"
#include "dsp/backend/host/sigmoid.hpp"
#include "dsp/backend/host/softmax.hpp"
#include "dsp/backend/host/swiglu.hpp"
#include "gradcheck.hpp"

namespace backend_activations_test {

using dsp::backend::Host;
using dsp::test::kGradTol;
using dsp::test::max_grad_error;
using dsp::test::max_rel_diff;
using dsp::test::random_vector;
using dsp::test::weighted_sum;

// One exp and a few roundings per element: ~1e-7 relative; 1e-6 leaves margin.
constexpr double kForwardTol = 1e-6;

TEST_CASE("softmax over the valid columns, padding exactly 0, gradients match finite differences") {
  const std::int64_t rows = 3, cols = 6, valid = 4;
  auto x = random_vector(rows * cols, 51, -3.0f, 3.0f);
  const auto r = random_vector(rows * cols, 52);
  std::vector<float> y(rows * cols, 99.0f);
  softmax_forward(Host{}, x.data(), rows, cols, valid, y.data());
  std::vector<double> want(rows * cols, 0.0);
  for (std::int64_t i = 0; i < rows; ++i) {
    double sum = 0.0;
    for (std::int64_t j = 0; j < valid; ++j) sum += std::exp(double(x[i * cols + j]));
    for (std::int64_t j = 0; j < valid; ++j) want[i * cols + j] = std::exp(double(x[i * cols + j])) / sum;
    for (std::int64_t j = valid; j < cols; ++j) CHECK(y[i * cols + j] == 0.0f);
  }
  CHECK(max_rel_diff(y, want) < kForwardTol);

  // Large logits do not overflow (max subtraction).
  std::vector<float> big = {1000.0f, 1000.0f, -1000.0f}, pbig(3);
  softmax_forward(Host{}, big.data(), 1, 3, 3, pbig.data());
  CHECK(pbig == std::vector<float>{0.5f, 0.5f, 0.0f});

  const auto loss = [&] {
    softmax_forward(Host{}, x.data(), rows, cols, valid, y.data());
    return weighted_sum(y, r);
  };
  loss();
  std::vector<float> dx(rows * cols, 99.0f);
  softmax_backward(Host{}, y.data(), r.data(), rows, cols, dx.data());
  CHECK(max_grad_error(x, dx, loss) < kGradTol);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = valid; j < cols; ++j) CHECK(dx[i * cols + j] == 0.0f);

  // In place, a row with nothing valid, and an invalid `valid`.
  auto inplace = x;
  softmax_forward(Host{}, inplace.data(), rows, cols, valid, inplace.data());
  CHECK(inplace == y);
  softmax_forward(Host{}, x.data(), rows, cols, 0, y.data());
  CHECK(std::all_of(y.begin(), y.end(), [](float p) { return p == 0.0f; }));
  CHECK_THROWS_AS(softmax_forward(Host{}, x.data(), rows, cols, cols + 1, y.data()), dsp::Error);
}

TEST_CASE("sigmoid forward, saturation and gradient") {
  auto x = random_vector(10, 53, -4.0f, 4.0f);
  x.push_back(100.0f);
  x.push_back(-100.0f);
  const auto r = random_vector(x.size(), 54);
  std::vector<float> y(x.size());
  sigmoid_forward(Host{}, std::int64_t(x.size()), x.data(), y.data());
  std::vector<double> want(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) want[i] = 1.0 / (1.0 + std::exp(-double(x[i])));
  CHECK(max_rel_diff(y, want) < kForwardTol);
  CHECK(y[10] == 1.0f);
  CHECK(y[11] == 0.0f);

  const auto loss = [&] {
    sigmoid_forward(Host{}, std::int64_t(x.size()), x.data(), y.data());
    return weighted_sum(y, r);
  };
  loss();
  std::vector<float> dx(x.size());
  sigmoid_backward(Host{}, std::int64_t(x.size()), y.data(), r.data(), dx.data());
  CHECK(max_grad_error(x, dx, loss) < kGradTol);
}

TEST_CASE("swiglu is silu(gate) * up over the [gate | up] halves, gradients match finite differences") {
  const std::int64_t tokens = 3, ffn = 5;
  auto gate_up = random_vector(tokens * 2 * ffn, 55, -3.0f, 3.0f);
  const auto r = random_vector(tokens * ffn, 56);
  std::vector<float> out(tokens * ffn);
  swiglu_forward(Host{}, gate_up.data(), tokens, ffn, out.data());
  std::vector<double> want(tokens * ffn);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t j = 0; j < ffn; ++j) {
      const double g = gate_up[t * 2 * ffn + j], u = gate_up[t * 2 * ffn + ffn + j];
      want[t * ffn + j] = g / (1.0 + std::exp(-g)) * u;
    }
  CHECK(max_rel_diff(out, want) < kForwardTol);

  const auto loss = [&] {
    swiglu_forward(Host{}, gate_up.data(), tokens, ffn, out.data());
    return weighted_sum(out, r);
  };
  std::vector<float> dgate_up(tokens * 2 * ffn, 99.0f);
  swiglu_backward(Host{}, gate_up.data(), r.data(), tokens, ffn, dgate_up.data());
  CHECK(max_grad_error(gate_up, dgate_up, loss) < kGradTol);
}

// Bitwise equality of floats (NaN included), for results that must not depend on the split.
bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

TEST_CASE("swiglu over many rows, shared among the rank's threads: every element as computed alone") {
  // 37 rows of 1000: blocks of 8 rows (parallel_rows_block_elements / 1000), the last of 5 rows.
  const std::int64_t tokens = 37, ffn = 1000;
  const auto gate_up = random_vector(tokens * 2 * ffn, 57, -8.0f, 8.0f);
  const auto d = random_vector(tokens * ffn, 58);
  std::vector<float> out(tokens * ffn, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> dgate_up(tokens * 2 * ffn, std::numeric_limits<float>::quiet_NaN());
  swiglu_forward(Host{}, gate_up.data(), tokens, ffn, out.data());
  swiglu_backward(Host{}, gate_up.data(), d.data(), tokens, ffn, dgate_up.data());
  std::int64_t differing = 0;
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t j = 0; j < ffn; ++j) {
      const float g = gate_up[t * 2 * ffn + j], u = gate_up[t * 2 * ffn + ffn + j];
      const auto grad = dsp::backend::detail::swiglu_grad(g, u, d[t * ffn + j]);
      differing += !same_bits(out[t * ffn + j], dsp::backend::detail::swiglu(g, u)) +
                   !same_bits(dgate_up[t * 2 * ffn + j], grad.gate) + !same_bits(dgate_up[t * 2 * ffn + ffn + j], grad.up);
    }
  CHECK(differing == 0);
}

TEST_CASE("parallel_for_rows covers every row once, in blocks of whole rows, on the rank's threads") {
  std::mutex m;
  std::condition_variable cv;
  std::vector<std::pair<std::int64_t, std::int64_t>> blocks;
  std::set<std::thread::id> threads;
  int inside = 0, most = 0;  // blocks running at once
  const bool shared = dsp::backend::host_threads(Host{}) > 1;
  dsp::backend::parallel_for_rows(Host{}, 37, 1000, [&](std::int64_t r0, std::int64_t r1) {
    std::unique_lock lock(m);
    blocks.emplace_back(r0, r1);
    threads.insert(std::this_thread::get_id());
    most = std::max(most, ++inside);
    cv.notify_all();
    // Where the rank has helpers, a block waits (up to 10 s) until a second thread has taken one.
    if (shared) cv.wait_for(lock, std::chrono::seconds(10), [&] { return threads.size() > 1; });
    --inside;
  });
  std::sort(blocks.begin(), blocks.end());
  const std::vector<std::pair<std::int64_t, std::int64_t>> want{{0, 8}, {8, 16}, {16, 24}, {24, 32}, {32, 37}};
  CHECK(blocks == want);
  CHECK(most <= dsp::backend::host_threads(Host{}));
  if (shared) CHECK(threads.size() > 1);

  blocks.clear();  // rows wider than a block: one row per block
  dsp::backend::parallel_for_rows(Host{}, 3, 100000, [&](std::int64_t r0, std::int64_t r1) {
    const std::lock_guard lock(m);
    blocks.emplace_back(r0, r1);
  });
  std::sort(blocks.begin(), blocks.end());
  CHECK(blocks == std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 1}, {1, 2}, {2, 3}});
}

}  // namespace backend_activations_test
