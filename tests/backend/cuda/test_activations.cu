// CUDA softmax, sigmoid and SwiGLU against the Host ops on the same inputs, forward and backward.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <vector>

#include "../../relative_error.hpp"
#include "../gradcheck.hpp"
#include "device_vectors.hpp"
#include "dsp/backend/cuda/sigmoid.cuh"
#include "dsp/backend/cuda/softmax.cuh"
#include "dsp/backend/cuda/swiglu.cuh"
#include "dsp/backend/host/sigmoid.hpp"
#include "dsp/backend/host/softmax.hpp"
#include "dsp/backend/host/swiglu.hpp"

using dsp::backend::Cuda;
using dsp::backend::DeviceBuffer;
using dsp::backend::Host;
using dsp::test::on_device;
using dsp::test::on_host;
using dsp::test::random_vector;
using dsp::test::relative_error;

// Both sides evaluate the same formulas in fp32 with fp64 row sums; they differ only in the
// device's expf (at most 2 ulp, CUDA C Programming Guide, "Mathematical Functions"), in fused
// multiply-adds and in the order of the fp64 sums: about 1e-7 relative per element. 1e-5 is
// the issue's fp32 bound.
constexpr double kTol = 1e-5;

TEST_CASE("swiglu forward and backward equal the Host op, with more elements than one grid covers") {
  for (std::int64_t tokens : {1, 7, 9000}) {
    const std::int64_t ffn = 2000;  // 9000 x 2000 = 18e6 elements > 65535 blocks x 256 threads
    CAPTURE(tokens);
    const auto gate_up = random_vector(tokens * 2 * ffn, 1, -6.0f, 6.0f);
    const auto dout = random_vector(tokens * ffn, 2);
    std::vector<float> out(tokens * ffn), dgate_up(tokens * 2 * ffn);
    swiglu_forward(Host{}, gate_up.data(), tokens, ffn, out.data());
    swiglu_backward(Host{}, gate_up.data(), dout.data(), tokens, ffn, dgate_up.data());

    const Cuda b{};
    auto d_gate_up = on_device(b, gate_up), d_dout = on_device(b, dout);
    DeviceBuffer<float> d_out(b, out.size()), d_dgate_up(b, dgate_up.size());
    swiglu_forward(b, d_gate_up.data(), tokens, ffn, d_out.data());
    swiglu_backward(b, d_gate_up.data(), d_dout.data(), tokens, ffn, d_dgate_up.data());
    CHECK(relative_error(on_host(d_out), out) < kTol);
    CHECK(relative_error(on_host(d_dgate_up), dgate_up) < kTol);
  }
}

TEST_CASE("softmax forward (valid columns, padding exactly 0) and backward equal the Host op") {
  const Cuda b{};
  // cols 3000 > 256 threads: each thread loops; valid 0 gives an all-zero row.
  for (auto [rows, cols, valid] : {std::array<std::int64_t, 3>{5, 7, 7}, {4, 3000, 2999}, {3, 10, 0}}) {
    CAPTURE(cols);
    CAPTURE(valid);
    const auto x = random_vector(rows * cols, 3, -20.0f, 20.0f), dy = random_vector(rows * cols, 4);
    std::vector<float> y(x.size()), dx(x.size());
    softmax_forward(Host{}, x.data(), rows, cols, valid, y.data());
    softmax_backward(Host{}, y.data(), dy.data(), rows, cols, dx.data());
    auto d_x = on_device(b, x), d_dy = on_device(b, dy);
    DeviceBuffer<float> d_y(b, y.size());
    softmax_forward(b, d_x.data(), rows, cols, valid, d_y.data());
    softmax_backward(b, d_y.data(), d_dy.data(), rows, cols, d_dy.data());  // dx == dy in place
    const auto got_y = on_host(d_y), got_dx = on_host(d_dy);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = valid; j < cols; ++j) CHECK(got_y[r * cols + j] == 0.0f);
    if (valid == 0) {
      for (float v : got_dx) CHECK(v == 0.0f);
      continue;
    }
    CHECK(relative_error(got_y, y) < kTol);
    CHECK(relative_error(got_dx, dx) < kTol);
  }
  // In place forward (y == x).
  auto x = random_vector(2 * 50, 5);
  std::vector<float> y(x.size());
  softmax_forward(Host{}, x.data(), 2, 50, 50, y.data());
  auto d = on_device(b, x);
  softmax_forward(b, d.data(), 2, 50, 50, d.data());
  CHECK(relative_error(on_host(d), y) < kTol);
  CHECK_THROWS_AS(softmax_forward(b, d.data(), 2, 50, 51, d.data()), dsp::Error);
}

TEST_CASE("sigmoid forward and backward equal the Host op; in place; saturation without NaN") {
  const Cuda b{};
  auto x = random_vector(100000, 6, -30.0f, 30.0f);
  x[0] = 200.0f;
  x[1] = -200.0f;
  const auto dy = random_vector(x.size(), 7);
  std::vector<float> y(x.size()), dx(x.size());
  sigmoid_forward(Host{}, std::int64_t(x.size()), x.data(), y.data());
  sigmoid_backward(Host{}, std::int64_t(x.size()), y.data(), dy.data(), dx.data());
  auto d_x = on_device(b, x), d_dy = on_device(b, dy);
  sigmoid_forward(b, std::int64_t(x.size()), d_x.data(), d_x.data());                // y == x
  sigmoid_backward(b, std::int64_t(x.size()), d_x.data(), d_dy.data(), d_dy.data());  // dx == dy
  const auto got_y = on_host(d_x);
  CHECK(got_y[0] == 1.0f);
  CHECK(got_y[1] == 0.0f);
  CHECK(relative_error(got_y, y) < kTol);
  CHECK(relative_error(on_host(d_dy), dx) < kTol);
}
