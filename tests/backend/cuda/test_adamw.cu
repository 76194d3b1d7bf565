// CUDA AdamW against the Host update (the shared per-element formula) over several steps.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "../../relative_error.hpp"
#include "../gradcheck.hpp"
#include "device_vectors.hpp"
#include "dsp/backend/cuda/adamw.cuh"
#include "dsp/backend/host/adamw.hpp"

using dsp::backend::Cuda;
using dsp::backend::Host;
using dsp::test::on_device;
using dsp::test::on_host;
using dsp::test::random_vector;
using dsp::test::relative_error;

// The same fp32 formula with the same fp32 step constants; the device may fuse multiply-adds
// and its sqrtf is correctly rounded like the host's: ~1e-7 relative per step, 1e-5 after 3.
constexpr double kTol = 1e-5;

TEST_CASE("adamw_update equals the Host update over 3 steps, parameters and both moments") {
  const Cuda b{};
  const std::int64_t n = 100003;
  auto p = random_vector(n, 1), m = random_vector(n, 2, -0.1f, 0.1f), v = random_vector(n, 3, 0.0f, 0.01f);
  auto d_p = on_device(b, p), d_m = on_device(b, m), d_v = on_device(b, v);
  for (std::int64_t step = 1; step <= 3; ++step) {
    const auto g = random_vector(n, unsigned(10 + step));
    auto d_g = on_device(b, g);
    adamw_update(Host{}, n, p.data(), g.data(), m.data(), v.data(), 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step);
    adamw_update(b, n, d_p.data(), d_g.data(), d_m.data(), d_v.data(), 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step);
  }
  CHECK(relative_error(on_host(d_p), p) < kTol);
  CHECK(relative_error(on_host(d_m), m) < kTol);
  CHECK(relative_error(on_host(d_v), v) < kTol);
}
