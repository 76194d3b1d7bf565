// core: bf16 rounding, the Philox counter RNG, Tensor, divide.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <limits>

#include "dsp/core/divide.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/rng.hpp"
#include "dsp/core/tensor.hpp"

using dsp::bf16;

TEST_CASE("bf16 rounds to nearest, ties to even, and keeps NaN and infinities") {
  auto bits = [](float f) { return bf16(f).bits; };
  CHECK(bits(1.0f) == 0x3f80);
  // 1 + 2^-8 is exactly half-way between bf16 1.0 (even mantissa) and 1 + 2^-7: ties to even -> 1.0
  CHECK(bits(1.0f + 0x1.0p-8f) == 0x3f80);
  // 1 + 3 * 2^-8 is half-way between 1 + 2^-7 (odd) and 1 + 2^-6 (even): -> 1 + 2^-6
  CHECK(bits(1.0f + 3 * 0x1.0p-8f) == 0x3f82);
  // just above half-way rounds up
  CHECK(bits(std::nextafter(1.0f + 0x1.0p-8f, 2.0f)) == 0x3f81);
  // rounding up carries into the exponent: largest mantissa -> next power of two
  CHECK(bits(std::bit_cast<float>(0x3fffffffu)) == 0x4000);
  CHECK(bits(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(std::isnan(static_cast<float>(bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isnan(static_cast<float>(bf16(std::bit_cast<float>(0x7f800001u)))));  // signalling NaN stays NaN
  CHECK(static_cast<float>(bf16(-2.5f)) == -2.5f);
}

TEST_CASE("Philox4x32-10 matches the Random123 known-answer vectors") {
  using A4 = std::array<std::uint32_t, 4>;
  CHECK(dsp::philox4x32({0, 0, 0, 0}, {0, 0}) == A4{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8});
  CHECK(dsp::philox4x32({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}) ==
        A4{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd});
  CHECK(dsp::philox4x32({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}) ==
        A4{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1});
}

TEST_CASE("CounterRng is a pure function of (seed, stream, index) with sane moments") {
  const dsp::CounterRng a(1, "model.layers.0.mlp.down_proj.weight"), b(1, "model.layers.0.mlp.down_proj.weight");
  const dsp::CounterRng other(2, "model.layers.0.mlp.down_proj.weight");
  CHECK(a.normal(12345) == b.normal(12345));
  CHECK(a.normal(12345) != other.normal(12345));
  // mean and variance of 200k normals: standard errors 0.0022 and 0.0032; bounds at ~5 sigma
  double s = 0, s2 = 0, u = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = a.normal(i);
    s += x;
    s2 += x * x;
    u += a.uniform(i);
  }
  CHECK(std::abs(s / n) < 0.012);
  CHECK(std::abs(s2 / n - 1.0) < 0.016);
  CHECK(std::abs(u / n - 0.5) < 0.004);  // uniform mean, standard error 0.00065
}

TEST_CASE("Tensor shapes, reshape and divide name the numbers") {
  dsp::Tensor t({2, 3});
  CHECK(t.numel() == 6);
  t[5] = 4.0f;
  t.reshape({3, 2});
  CHECK(t.dim(0) == 3);
  CHECK(t[5] == 4.0f);
  CHECK_THROWS_AS(t.reshape({4, 2}), dsp::Error);
  CHECK_THROWS_WITH_AS(dsp::Tensor({2, 2}, {1.0f, 2.0f}), "Tensor: 2 values do not fill shape [2, 2]", dsp::Error);
  CHECK(dsp::divide(12, 4) == 3);
  CHECK_THROWS_WITH_AS(dsp::divide(10, 4, "hidden size"), "hidden size (10) is not divisible by 4", dsp::ConfigError);
}
