// CUDA RMSNorm, RoPE and interleaved RoPE (MLA) against the Host ops on the same inputs,
// forward and backward.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "../../relative_error.hpp"
#include "../gradcheck.hpp"
#include "device_vectors.hpp"
#include "dsp/backend/cuda/rms_norm.cuh"
#include "dsp/backend/cuda/rope.cuh"
#include "dsp/backend/cuda/rope_interleaved.cuh"
#include "dsp/backend/host/rms_norm.hpp"
#include "dsp/backend/host/rope.hpp"
#include "dsp/backend/host/rope_interleaved.hpp"

using dsp::backend::Cuda;
using dsp::backend::DeviceBuffer;
using dsp::backend::Host;
using dsp::test::on_device;
using dsp::test::on_host;
using dsp::test::random_vector;
using dsp::test::relative_error;

// The same formulas in fp32 with fp64 row sums on both sides; the differences are fused
// multiply-adds and the order of the fp64 sums (~1e-7 relative per element), and for dw the
// fused multiply-adds over the token sum (< tokens x 6e-8 = 4e-6 at 64 tokens, in the worst
// case). 1e-5 is the issue's fp32 bound.
constexpr double kTol = 1e-5;

TEST_CASE("rms_norm forward and backward equal the Host op; dw accumulates; in place") {
  const Cuda b{};
  for (std::int64_t hidden : {16, 1000, 4096}) {  // fewer and more columns than threads
    const std::int64_t tokens = 64;
    CAPTURE(hidden);
    const auto x = random_vector(tokens * hidden, 1, -2.0f, 2.0f), w = random_vector(hidden, 2, 0.5f, 1.5f);
    const auto dy = random_vector(tokens * hidden, 3), dw0 = random_vector(hidden, 4);
    std::vector<float> y(x.size()), rstd(tokens), dx(x.size()), dw = dw0;
    rms_norm_forward(Host{}, x.data(), w.data(), 1e-6f, tokens, hidden, y.data(), rstd.data());
    rms_norm_backward(Host{}, x.data(), w.data(), rstd.data(), dy.data(), tokens, hidden, dx.data(), dw.data());

    auto d_x = on_device(b, x), d_w = on_device(b, w), d_dy = on_device(b, dy), d_dw = on_device(b, dw0);
    DeviceBuffer<float> d_y(b, y.size()), d_rstd(b, rstd.size());
    rms_norm_forward(b, d_x.data(), d_w.data(), 1e-6f, tokens, hidden, d_y.data(), d_rstd.data());
    // dx == dy in place: dw must still see the original dy.
    rms_norm_backward(b, d_x.data(), d_w.data(), d_rstd.data(), d_dy.data(), tokens, hidden, d_dy.data(),
                      d_dw.data());
    CHECK(relative_error(on_host(d_y), y) < kTol);
    CHECK(relative_error(on_host(d_rstd), rstd) < kTol);
    CHECK(relative_error(on_host(d_dy), dx) < kTol);
    CHECK(relative_error(on_host(d_dw), dw) < kTol);
    // In place forward (y == x).
    rms_norm_forward(b, d_x.data(), d_w.data(), 1e-6f, tokens, hidden, d_x.data(), d_rstd.data());
    CHECK(relative_error(on_host(d_x), y) < kTol);
  }
}

TEST_CASE("rope forward and backward equal the Host op at large positions; in place; odd head_dim throws") {
  const Cuda b{};
  const std::int64_t tokens = 33, heads = 3, head_dim = 64;
  std::vector<std::int32_t> positions(tokens);
  for (std::int64_t t = 0; t < tokens; ++t) positions[t] = std::int32_t(t * 997 % 32768);  // angles up to ~3e4 rad
  const auto x = random_vector(tokens * heads * head_dim, 5);
  std::vector<float> y(x.size()), dx(x.size());
  rope_forward(Host{}, x.data(), positions.data(), tokens, heads, head_dim, 10000.0f, y.data());
  rope_backward(Host{}, y.data(), positions.data(), tokens, heads, head_dim, 10000.0f, dx.data());
  auto d_x = on_device(b, x);
  auto d_pos = on_device(b, positions);
  DeviceBuffer<float> d_y(b, y.size());
  rope_forward(b, d_x.data(), d_pos.data(), tokens, heads, head_dim, 10000.0f, d_y.data());
  CHECK(relative_error(on_host(d_y), y) < kTol);
  rope_backward(b, d_y.data(), d_pos.data(), tokens, heads, head_dim, 10000.0f, d_y.data());  // in place
  CHECK(relative_error(on_host(d_y), dx) < kTol);
  CHECK(relative_error(on_host(d_y), x) < kTol);  // the backward undoes the forward (a rotation)
  CHECK_THROWS_AS(rope_forward(b, d_x.data(), d_pos.data(), tokens, heads, 63, 10000.0f, d_y.data()), dsp::Error);
}

TEST_CASE("interleaved rope (MLA's rope slice of each head, YaRN factor) equals the Host op forward and backward") {
  const Cuda b{};
  const std::int64_t tokens = 33, heads = 3, nope = 8, rope = 16, width = heads * (nope + rope);
  std::vector<std::int32_t> positions(tokens);
  for (std::int64_t t = 0; t < tokens; ++t) positions[t] = std::int32_t(t * 997 % 32768);
  std::vector<double> inv_freq(rope / 2);
  for (std::int64_t i = 0; i < rope / 2; ++i) inv_freq[i] = std::pow(10000.0, -2.0 * double(i) / double(rope)) / 3.0;
  const double factor = 1.07;
  const auto x = random_vector(tokens * width, 9);
  std::vector<float> y = x;
  const auto slices = [&](float* data) {
    return dsp::backend::RotarySlices{data + nope, tokens, heads, rope, width, nope + rope};
  };
  rope_interleaved_forward(Host{}, slices(y.data()), positions.data(), inv_freq.data(), factor);
  auto d_x = on_device(b, x);
  auto d_pos = on_device(b, positions);
  auto d_freq = on_device(b, inv_freq);
  rope_interleaved_forward(b, slices(d_x.data()), d_pos.data(), d_freq.data(), factor);
  const auto got = on_host(d_x);
  CHECK(relative_error(got, y) < kTol);
  for (std::int64_t t = 0; t < tokens; ++t)  // the no-RoPE part of each head is untouched
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < nope; ++i) CHECK(got[t * width + h * (nope + rope) + i] == x[t * width + h * (nope + rope) + i]);
  std::vector<float> back = y;
  rope_interleaved_backward(Host{}, slices(back.data()), positions.data(), inv_freq.data(), factor);
  rope_interleaved_backward(b, slices(d_x.data()), d_pos.data(), d_freq.data(), factor);
  CHECK(relative_error(on_host(d_x), back) < kTol);
  CHECK_THROWS_AS(rope_interleaved_forward(b, {d_x.data(), tokens, heads, 15, width, nope + rope}, d_pos.data(),
                                           d_freq.data(), factor),
                  dsp::Error);
}
