// Host RMSNorm and RoPE against naive references and finite differences.
#include <doctest/doctest.h>

#include <cmath>

#include "dsp/backend/host/rms_norm.hpp"
#include "dsp/backend/host/rope.hpp"
#include "gradcheck.hpp"

namespace backend_norm_rope_test {

using dsp::backend::Host;
using dsp::test::kGradTol;
using dsp::test::max_grad_error;
using dsp::test::max_rel_diff;
using dsp::test::random_vector;
using dsp::test::weighted_sum;

// A handful of fp32 roundings per element on O(1) values.
constexpr double kForwardTol = 1e-5;

TEST_CASE("rms_norm forward matches x / sqrt(mean(x^2) + eps) * w and its gradients match finite differences") {
  const std::int64_t tokens = 3, hidden = 8;
  const float eps = 1e-5f;
  auto x = random_vector(tokens * hidden, 21, -2.0f, 2.0f);
  auto w = random_vector(hidden, 22, 0.5f, 1.5f);
  const auto r = random_vector(tokens * hidden, 23);
  std::vector<float> y(tokens * hidden), rstd(tokens);
  rms_norm_forward(Host{}, x.data(), w.data(), eps, tokens, hidden, y.data(), rstd.data());
  std::vector<double> want(tokens * hidden);
  for (std::int64_t t = 0; t < tokens; ++t) {
    double ms = 0.0;
    for (std::int64_t j = 0; j < hidden; ++j) ms += double(x[t * hidden + j]) * x[t * hidden + j] / hidden;
    CHECK(rstd[t] == doctest::Approx(1.0 / std::sqrt(ms + eps)).epsilon(1e-6));
    for (std::int64_t j = 0; j < hidden; ++j) want[t * hidden + j] = x[t * hidden + j] / std::sqrt(ms + eps) * w[j];
  }
  CHECK(max_rel_diff(y, want) < kForwardTol);

  const auto loss = [&] {
    rms_norm_forward(Host{}, x.data(), w.data(), eps, tokens, hidden, y.data(), rstd.data());
    return weighted_sum(y, r);
  };
  loss();  // rstd of the unperturbed x
  const auto dw0 = random_vector(hidden, 24);
  auto dw = dw0;
  std::vector<float> dx(tokens * hidden, 99.0f);
  rms_norm_backward(Host{}, x.data(), w.data(), rstd.data(), r.data(), tokens, hidden, dx.data(), dw.data());
  for (std::int64_t j = 0; j < hidden; ++j) dw[j] -= dw0[j];  // dw accumulates
  CHECK(max_grad_error(x, dx, loss) < kGradTol);
  CHECK(max_grad_error(w, dw, loss) < kGradTol);
}

namespace {
struct RopeCase {
  std::int64_t tokens = 4, heads = 3, head_dim = 8;
  float theta = 10000.0f;
  std::vector<std::int32_t> positions = {0, 3, 17, 100};
  std::int64_t size() const { return tokens * heads * head_dim; }
};
}  // namespace

TEST_CASE("rope_forward rotates pairs (i, i + head_dim/2) by position * theta^(-2i/head_dim)") {
  const RopeCase c;
  const auto x = random_vector(c.size(), 31);
  std::vector<float> y(c.size());
  rope_forward(Host{}, x.data(), c.positions.data(), c.tokens, c.heads, c.head_dim, c.theta, y.data());
  const std::int64_t half = c.head_dim / 2;
  std::vector<double> want(c.size());
  for (std::int64_t t = 0; t < c.tokens; ++t)
    for (std::int64_t h = 0; h < c.heads; ++h)
      for (std::int64_t i = 0; i < half; ++i) {
        const double a = c.positions[t] * std::pow(double(c.theta), -2.0 * i / c.head_dim);
        const std::int64_t base = (t * c.heads + h) * c.head_dim;
        const double x1 = x[base + i], x2 = x[base + i + half];
        want[base + i] = x1 * std::cos(a) - x2 * std::sin(a);
        want[base + i + half] = x2 * std::cos(a) + x1 * std::sin(a);
      }
  CHECK(max_rel_diff(y, want) < kForwardTol);

  // Position 0 is exactly the identity; every head keeps its norm.
  for (std::int64_t j = 0; j < c.heads * c.head_dim; ++j) CHECK(y[j] == x[j]);
  for (std::int64_t th = 0; th < c.tokens * c.heads; ++th) {
    double nx = 0.0, ny = 0.0;
    for (std::int64_t j = 0; j < c.head_dim; ++j) {
      nx += double(x[th * c.head_dim + j]) * x[th * c.head_dim + j];
      ny += double(y[th * c.head_dim + j]) * y[th * c.head_dim + j];
    }
    CHECK(ny == doctest::Approx(nx).epsilon(1e-6));
  }

  // In place gives the same result; backward undoes forward.
  auto inplace = x;
  rope_forward(Host{}, inplace.data(), c.positions.data(), c.tokens, c.heads, c.head_dim, c.theta, inplace.data());
  CHECK(inplace == y);
  rope_backward(Host{}, inplace.data(), c.positions.data(), c.tokens, c.heads, c.head_dim, c.theta, inplace.data());
  CHECK(max_rel_diff(inplace, std::vector<double>(x.begin(), x.end())) < kForwardTol);
  CHECK_THROWS_AS(rope_forward(Host{}, x.data(), c.positions.data(), 1, 1, 7, c.theta, y.data()), dsp::Error);
}

TEST_CASE("rope_backward matches finite differences, and the forward rotation as backward does not") {
  const RopeCase c;
  auto x = random_vector(c.size(), 32);
  const auto r = random_vector(c.size(), 33);
  std::vector<float> y(c.size()), dx(c.size());
  const auto loss = [&] {
    rope_forward(Host{}, x.data(), c.positions.data(), c.tokens, c.heads, c.head_dim, c.theta, y.data());
    return weighted_sum(y, r);
  };
  rope_backward(Host{}, r.data(), c.positions.data(), c.tokens, c.heads, c.head_dim, c.theta, dx.data());
  CHECK(max_grad_error(x, dx, loss) < kGradTol);
  rope_forward(Host{}, r.data(), c.positions.data(), c.tokens, c.heads, c.head_dim, c.theta, dx.data());
  CHECK(max_grad_error(x, dx, loss) > 10 * kGradTol);
}

}  // namespace backend_norm_rope_test
