// core: bf16 and fp16 rounding, the Philox counter RNG, Tensor, divide.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "dsp/core/divide.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/rng.hpp"
#include "dsp/core/tensor.hpp"

namespace core_core_test {

using dsp::bf16;
using dsp::fp16;

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

namespace {
// fp16 bit pattern -> value, computed independently of fp16::to_float (ldexp in double).
double fp16_reference(std::uint16_t h) {
  const int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  const double mag = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
  return (h & 0x8000) ? -mag : mag;
}
}  // namespace

TEST_CASE("fp16: every bit pattern converts to float exactly and back to itself") {
  int bad_value = 0, bad_round_trip = 0;
  for (std::uint32_t h = 0; h <= 0xffff; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    const float f = fp16::to_float(b);
    const bool nan = (b & 0x7c00) == 0x7c00 && (b & 0x03ff) != 0;
    const bool inf = (b & 0x7fff) == 0x7c00;
    if (nan) {
      bad_value += !std::isnan(f) || std::signbit(f) != bool(b & 0x8000);
      bad_round_trip += fp16::from_float(f) != (b | 0x0200);  // quietened, payload and sign kept
    } else {
      const double want = inf ? ((b & 0x8000) ? -HUGE_VAL : HUGE_VAL) : fp16_reference(b);
      bad_value += double(f) != want || std::signbit(f) != bool(b & 0x8000);  // -0 stays -0
      bad_round_trip += fp16::from_float(f) != b;
    }
  }
  CHECK(bad_value == 0);
  CHECK(bad_round_trip == 0);
}

TEST_CASE("fp16 rounds to nearest, ties to even, at every pair of neighbours") {
  // For each pair of adjacent non-negative fp16 values (a, b), including the largest finite
  // value and infinity (whose would-be value is 2^16), the midpoint (exact in fp32) goes to the
  // one with an even mantissa and its float neighbours go to the nearer one.
  int bad = 0;
  for (std::uint16_t a = 0; a < 0x7c00; ++a) {
    const auto b = static_cast<std::uint16_t>(a + 1);
    const float fa = fp16::to_float(a), fb = b == 0x7c00 ? 65536.0f : fp16::to_float(b);
    const float mid = (fa + fb) / 2;
    const std::uint16_t even = (a & 1) ? b : a;
    bad += fp16::from_float(mid) != even;
    bad += fp16::from_float(std::nextafter(mid, 0.0f)) != a;
    bad += fp16::from_float(std::nextafter(mid, HUGE_VALF)) != b;
    bad += fp16::from_float(-mid) != (even | 0x8000);
  }
  CHECK(bad == 0);
}

TEST_CASE("fp16 overflow, subnormals, NaN and infinities") {
  auto bits = [](float f) { return fp16::from_float(f); };
  CHECK(bits(1.0f) == 0x3c00);
  CHECK(bits(65504.0f) == 0x7bff);                                   // largest finite
  CHECK(bits(std::nextafter(65520.0f, 0.0f)) == 0x7bff);             // below the overflow threshold
  CHECK(bits(65520.0f) == 0x7c00);                                   // tie with 2^16: to even = infinity
  CHECK(bits(1e6f) == 0x7c00);
  CHECK(bits(-1e30f) == 0xfc00);
  CHECK(bits(HUGE_VALF) == 0x7c00);
  CHECK(bits(-HUGE_VALF) == 0xfc00);
  CHECK(bits(0x1.0p-14f) == 0x0400);                                 // smallest normal
  CHECK(bits(std::nextafter(0x1.0p-14f, 0.0f)) == 0x0400);           // rounds up into the normals
  CHECK(bits(0x1.0p-24f) == 0x0001);                                 // smallest subnormal
  CHECK(bits(0x1.0p-25f) == 0x0000);                                 // tie between 0 and 2^-24: even
  CHECK(bits(std::nextafter(0x1.0p-25f, 1.0f)) == 0x0001);
  CHECK(bits(3 * 0x1.0p-25f) == 0x0002);                             // tie between 1 and 2 units: even
  CHECK(bits(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(bits(-0.0f) == 0x8000);
  CHECK(std::isnan(static_cast<float>(fp16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isnan(static_cast<float>(fp16(std::bit_cast<float>(0x7f800001u)))));  // signalling NaN stays NaN
  CHECK(static_cast<float>(fp16(-2.5f)) == -2.5f);
  CHECK(dsp::to_accum(fp16(0.5f)) == 0.5f);
  CHECK(dsp::from_accum<fp16>(1.0f + 0x1.0p-11f).bits == 0x3c00);    // one rounding, to even
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
  CHECK_THROWS_WITH_AS(dsp::divide(10, 4, "hidden size", "tensor-model-parallel-size"),
                       "hidden size (10) is not divisible by tensor-model-parallel-size (4)", dsp::ConfigError);
  CHECK_THROWS_WITH_AS(dsp::divide(10, 0, "hidden size", "tensor-model-parallel-size"),
                       "tensor-model-parallel-size must be positive, got 0", dsp::ConfigError);
}

}  // namespace core_core_test
