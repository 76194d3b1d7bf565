// CUDA fp32 <-> bf16 / fp16 conversions, and rounding in place (round_to), against the Host
// ops: bitwise, over special values and random ones; round_to is the conversion there and back.
// Both apply the same formulas of core/dtype.hpp to integer bits (the fp16 subnormal path adds
// 0.5f to a normal number, the same IEEE addition on both), so any difference is a defect, and
// the tolerance is zero.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../gradcheck.hpp"
#include "device_vectors.hpp"
#include "dsp/backend/cuda/convert.cuh"
#include "dsp/backend/host/convert.hpp"

using dsp::bf16;
using dsp::fp16;
using dsp::backend::Cuda;
using dsp::backend::DeviceBuffer;
using dsp::backend::Host;
using dsp::test::on_device;
using dsp::test::on_host;

namespace {

// Special values (zeros, infinities, NaN, bf16 and fp16 rounding ties, fp16's overflow edge and
// subnormals, float subnormals) followed by random values of every magnitude.
std::vector<float> inputs() {
  std::vector<float> v{0.0f, -0.0f, 1.0f, -1.0f, std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                       1.0f + 0x1.0p-8f,   // bf16 tie: rounds to even (1)
                       1.0f + 0x3.0p-8f,   // bf16 tie: rounds to even (up)
                       1.0f + 0x1.0p-11f,  // fp16 tie
                       65504.0f, 65519.0f, 65520.0f,  // fp16: largest, still rounds down, infinity
                       0x1.0p-14f, 0x1.0p-24f, 0x1.8p-25f, 0x1.0p-25f,  // fp16 normal edge and subnormals
                       std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max()};
  const auto random = dsp::test::random_vector(5000, 7, -1.0f, 1.0f);
  for (std::size_t i = 0; i < random.size(); ++i)
    v.push_back(random[i] * std::ldexp(1.0f, static_cast<int>(i % 60) - 30));
  return v;
}

template <class T>
std::vector<std::uint16_t> bits(const std::vector<T>& v) {
  std::vector<std::uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = v[i].bits;
  return out;
}
std::vector<std::uint32_t> bits(const std::vector<float>& v) {
  std::vector<std::uint32_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
  return out;
}

template <class T>
void check_type() {
  const auto x = inputs();
  const auto n = static_cast<std::int64_t>(x.size());
  std::vector<T> narrow(x.size());
  std::vector<float> wide(x.size());
  convert(Host{}, n, x.data(), narrow.data());
  convert(Host{}, n, narrow.data(), wide.data());

  const Cuda b{};
  auto d_x = on_device(b, x);
  DeviceBuffer<T> d_narrow(b, x.size());
  DeviceBuffer<float> d_wide(b, x.size());
  convert(b, n, d_x.data(), d_narrow.data());
  convert(b, n, d_narrow.data(), d_wide.data());
  CHECK(bits(on_host(d_narrow)) == bits(narrow));
  CHECK(bits(on_host(d_wide)) == bits(wide));

  std::vector<float> rounded = x;
  round_to(Host{}, n, rounded.data(), T{});
  CHECK(bits(rounded) == bits(wide));
  auto d_rounded = on_device(b, x);
  round_to(b, n, d_rounded.data(), T{});
  CHECK(bits(on_host(d_rounded)) == bits(wide));
}

}  // namespace

TEST_CASE("fp32 -> bf16 -> fp32 and round_to bf16 on the GPU give the Host ops' bits") { check_type<bf16>(); }

TEST_CASE("fp32 -> fp16 -> fp32 and round_to fp16 on the GPU give the Host ops' bits") { check_type<fp16>(); }
