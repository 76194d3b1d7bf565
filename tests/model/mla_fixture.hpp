#pragma once
// Test helper: the MLA fixture tests/fixtures/mla/mla.json (written by tools/write_mla_fixture.py
// with transformers 5.25) and its arrays as tensors.
#include <doctest/doctest.h>

#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/core/tensor.hpp"
#include "../data_dir.hpp"

namespace dsp::test {

inline const nlohmann::json& mla_fixture() {
  static const nlohmann::json j = [] {
    std::ifstream in(data_dir() + "/../tests/fixtures/mla/mla.json");
    REQUIRE(in.good());
    return nlohmann::json::parse(in);
  }();
  return j;
}

/// A flat fp32 array of the fixture as a tensor of `shape`.
inline Tensor fixture_tensor(const nlohmann::json& values, Shape shape) {
  const auto v = values.get<std::vector<float>>();
  Tensor t(std::move(shape));
  REQUIRE(static_cast<std::int64_t>(v.size()) == t.numel());
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = v[static_cast<std::size_t>(i)];
  return t;
}

}  // namespace dsp::test
