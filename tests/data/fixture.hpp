#pragma once
// Shared pieces of the data tests: where tests/data/fixtures/ is, the expectations that
// tools/write_megatron_fixture.py wrote there with megatron-core, and a self-removing
// temporary directory.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "../data_dir.hpp"
#include "../temp_dir.hpp"

namespace data_test {

namespace fs = std::filesystem;

/// tests/data/fixtures/NAME (a prefix for indexed datasets).
inline std::string fixture(const std::string& name) { return dsp::test::data_dir() + "/../tests/data/fixtures/" + name; }

/// tests/data/fixtures/megatron_expected.json, parsed once.
inline const nlohmann::json& expected() {
  static const nlohmann::json j = [] {
    std::ifstream in(fixture("megatron_expected.json"));
    REQUIRE(in.good());
    return nlohmann::json::parse(std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
  }();
  return j;
}

using dsp::test::TempDir;

}  // namespace data_test
