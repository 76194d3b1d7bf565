#pragma once
// Test helper: ||a - b|| / ||b|| over all elements (fp64 sums), the norm-wise relative error
// the tolerance comments in the tests refer to.
#include <doctest/doctest.h>

#include <cmath>

#include "dsp/core/tensor.hpp"

namespace dsp::test {

inline double relative_error(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  double d = 0, n = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    n += double(b[i]) * b[i];
  }
  return std::sqrt(d / n);
}

}  // namespace dsp::test
