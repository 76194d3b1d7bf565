#pragma once
// Test helper: ||a - b|| / ||b|| over all elements (fp64 sums), the norm-wise relative error
// the tolerance comments in the tests refer to.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <span>
#include <string>

#include "dsp/core/tensor.hpp"

namespace dsp::test {

inline double relative_error(std::span<const float> a, std::span<const float> b) {
  REQUIRE(a.size() == b.size());
  double d = 0, n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    n += double(b[i]) * b[i];
  }
  return std::sqrt(d / n);
}

/// The same over two tensors of one shape.
inline double relative_error(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  return relative_error(std::span<const float>(a.data(), std::size_t(a.numel())),
                        std::span<const float>(b.data(), std::size_t(b.numel())));
}

/// The same over named tensors (e.g. every gathered parameter of a model): one norm over all of
/// them. Both maps must hold the same names and shapes.
inline double relative_error(const std::map<std::string, Tensor>& a, const std::map<std::string, Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0, n = 0;
  for (const auto& [name, t] : b) {
    const Tensor& g = a.at(name);
    REQUIRE(g.shape() == t.shape());
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      d += (double(g[i]) - t[i]) * (double(g[i]) - t[i]);
      n += double(t[i]) * t[i];
    }
  }
  return std::sqrt(d / n);
}

}  // namespace dsp::test
