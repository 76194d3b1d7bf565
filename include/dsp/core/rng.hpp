#pragma once
// Counter-based random numbers: Philox4x32-10 (Salmon et al., "Parallel random numbers:
// as easy as 1, 2, 3", SC'11). A value depends only on (key, counter), so a parameter's
// element is a pure function of (seed, parameter name, global element index) and every
// parallel layout builds the same global model.
#include <array>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string_view>

namespace dsp {

/// Philox4x32 with 10 rounds: 128-bit counter, 64-bit key -> four 32-bit random words.
inline std::array<std::uint32_t, 4> philox4x32(std::array<std::uint32_t, 4> ctr,
                                               std::array<std::uint32_t, 2> key) {
  constexpr std::uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = std::uint64_t{M0} * ctr[0];
    const std::uint64_t p1 = std::uint64_t{M1} * ctr[2];
    ctr = {static_cast<std::uint32_t>(p1 >> 32) ^ ctr[1] ^ key[0], static_cast<std::uint32_t>(p1),
           static_cast<std::uint32_t>(p0 >> 32) ^ ctr[3] ^ key[1], static_cast<std::uint32_t>(p0)};
    key = {key[0] + W0, key[1] + W1};
  }
  return ctr;
}

/// 64-bit FNV-1a hash of a string (used to turn a parameter name into a stream id).
constexpr std::uint64_t fnv1a64(std::string_view s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return h;
}

/// A stream of counter-based random numbers identified by (seed, stream id). `uniform(i)` and
/// `normal(i)` are pure functions of i: no state, any order, any thread.
class CounterRng {
 public:
  CounterRng(std::uint64_t seed, std::uint64_t stream) : seed_(seed), stream_(stream) {}
  CounterRng(std::uint64_t seed, std::string_view name) : CounterRng(seed, fnv1a64(name)) {}

  /// Four raw 32-bit words for counter i.
  std::array<std::uint32_t, 4> bits(std::uint64_t i) const {
    return philox4x32({static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(i >> 32),
                       static_cast<std::uint32_t>(stream_), static_cast<std::uint32_t>(stream_ >> 32)},
                      {static_cast<std::uint32_t>(seed_), static_cast<std::uint32_t>(seed_ >> 32)});
  }
  /// Uniform in [0, 1) with 53 random bits, for element i.
  double uniform(std::uint64_t i) const {
    const auto w = bits(i);
    const std::uint64_t u = (std::uint64_t{w[0]} << 21) ^ (w[1] >> 11);
    return static_cast<double>(u & ((1ull << 53) - 1)) * 0x1.0p-53;
  }
  /// Standard normal for element i (Box-Muller on two 32-bit words).
  double normal(std::uint64_t i) const {
    const auto w = bits(i);
    const double u1 = (static_cast<double>(w[0]) + 1.0) * 0x1.0p-32;  // (0, 1]
    const double u2 = static_cast<double>(w[1]) * 0x1.0p-32;          // [0, 1)
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  std::uint64_t seed_, stream_;
};

}  // namespace dsp
