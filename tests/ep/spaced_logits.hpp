#pragma once
// Test helper for router gradient checks: logits whose experts are well apart.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "../backend/gradcheck.hpp"

namespace dsp::test {

/// [tokens, experts] logits with gaps >= 0.15 between any two experts of a token (a shuffled
/// grid of step 0.25 plus noise of +-0.05), so a finite-difference step of 1e-2 cannot change
/// which experts are chosen (the selection is piecewise constant, not differentiable).
inline std::vector<float> spaced_logits(std::int64_t tokens, std::int64_t experts, unsigned seed) {
  const auto noise = random_vector(static_cast<std::size_t>(tokens * experts), seed, -0.05f, 0.05f);
  std::vector<float> z(noise.size());
  std::mt19937 gen(seed);
  std::vector<int> perm(static_cast<std::size_t>(experts));
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), gen);
    for (std::int64_t e = 0; e < experts; ++e)
      z[t * experts + e] = 0.25f * (perm[e] - experts / 2.0f) + noise[t * experts + e];
  }
  return z;
}

}  // namespace dsp::test
