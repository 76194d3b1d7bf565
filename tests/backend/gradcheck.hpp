#pragma once
// Helpers for the host-op tests: seeded random data and central finite differences.
//
// Gradient checks use the scalar L = sum_i out[i] * R[i] (R fixed and random, accumulated in
// fp64), so that dL/dout = R is the upstream gradient fed to the backward op, and compare the
// analytic gradient of every input element with (L(x + h) - L(x - h)) / (2h).
//
// Tolerance: inputs and outputs are O(1) fp32. With step h = kFdStep = 1e-2,
//  - truncation error is |f'''| h^2 / 6 ~ 2e-5 |f'''| (zero for inputs an op is linear in);
//  - rounding: each fp32 output carries ~1e-7 relative error, which does not cancel between
//    L(x+h) and L(x-h); over N <= ~300 outputs that is ~sqrt(N) * 1e-7 ~ 2e-6 in L, i.e.
//    ~1e-4 in the quotient after dividing by 2h.
// kGradTol = 1e-3 on |numeric - analytic| / max(1, |analytic|) is ~10x those bounds (measured
// worst case over these tests: 1.4e-5), while a wrong formula (missing term, wrong sign, wrong
// head mapping) is off by O(0.1 .. 1).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace dsp::test {

inline constexpr float kFdStep = 1e-2f;
inline constexpr double kGradTol = 1e-3;

/// n values uniform in [lo, hi) from a fixed seed.
inline std::vector<float> random_vector(std::size_t n, unsigned seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

/// sum_i out[i] * r[i], accumulated in fp64.
inline double weighted_sum(const std::vector<float>& out, const std::vector<float>& r) {
  double s = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) s += static_cast<double>(out[i]) * r[i];
  return s;
}

/// Largest |numeric - analytic| / max(1, |analytic|) over every element of `input`, where
/// numeric is the central difference of loss() (which reads `input`) with step kFdStep. The
/// step actually taken, (x + h) - (x - h) after fp32 rounding, is the divisor. `input` is
/// restored afterwards.
inline double max_grad_error(std::vector<float>& input, const std::vector<float>& analytic,
                             const std::function<double()>& loss) {
  double worst = 0.0;
  for (std::size_t i = 0; i < input.size(); ++i) {
    const float x = input[i];
    const float xp = x + kFdStep, xm = x - kFdStep;
    input[i] = xp;
    const double lp = loss();
    input[i] = xm;
    const double lm = loss();
    input[i] = x;
    const double numeric = (lp - lm) / (static_cast<double>(xp) - xm);
    worst = std::max(worst, std::abs(numeric - analytic[i]) / std::max(1.0, std::abs(static_cast<double>(analytic[i]))));
  }
  return worst;
}

/// Largest |a[i] - b[i]| / max(1, |b[i]|); infinity when the sizes differ.
inline double max_rel_diff(const std::vector<float>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(1.0, std::abs(b[i])));
  return worst;
}

}  // namespace dsp::test
