// --split: the ranges megatron-core's own code computed (tests/data/fixtures/
// megatron_expected.json) exactly, the normalised weights, and refused strings named.
#include <doctest/doctest.h>

#include <optional>
#include <string>

#include "dsp/data/split.hpp"
#include "fixture.hpp"

namespace data_split_test {

using dsp::data::parse_and_normalize_split;
using dsp::data::split_ranges;
using dsp::data::SplitRange;

TEST_CASE("split ranges equal megatron-core's for every fixture string") {
  for (const auto& c : data_test::expected()["split"]) {
    const auto text = c["split"].get<std::string>();
    const auto n = c["num_elements"].get<std::int64_t>();
    CAPTURE(text);
    CAPTURE(n);
    const auto got = split_ranges(text, n);
    for (int k = 0; k < 3; ++k) {
      CAPTURE(k);
      const auto& want = c["ranges"][static_cast<std::size_t>(k)];
      REQUIRE(got[k].has_value() == !want.is_null());
      if (got[k]) CHECK(*got[k] == SplitRange{want[0].get<std::int64_t>(), want[1].get<std::int64_t>()});
    }
  }
}

TEST_CASE("weights are normalised; comma, slash, spaces and one or two numbers are accepted") {
  const auto w = parse_and_normalize_split("969,30,1");
  CHECK(w[0] == 969.0 / 1000.0);
  CHECK(w[1] == 30.0 / 1000.0);
  CHECK(w[2] == 1.0 / 1000.0);
  CHECK(parse_and_normalize_split("969/30/1") == w);
  CHECK(parse_and_normalize_split(" 969 , 30 ,1 ") == w);
  CHECK(parse_and_normalize_split("0.5,.5") == std::array<double, 3>{0.5, 0.5, 0.0});
  CHECK(parse_and_normalize_split("7") == std::array<double, 3>{1.0, 0.0, 0.0});
  // the ranges tile [0, n) when no part is empty
  const auto r = split_ranges("969,30,1", 123457);
  CHECK(r[0]->begin == 0);
  CHECK(r[0]->end == r[1]->begin);
  CHECK(r[1]->end == r[2]->begin);
  CHECK(r[2]->end == 123457);
}

TEST_CASE("round_half_even rounds ties to even, as Python's round") {
  CHECK(dsp::data::round_half_even(0.5) == 0.0);
  CHECK(dsp::data::round_half_even(1.5) == 2.0);
  CHECK(dsp::data::round_half_even(2.5) == 2.0);
  CHECK(dsp::data::round_half_even(2.5000001) == 3.0);
  CHECK(dsp::data::round_half_even(7.49) == 7.0);
}

TEST_CASE("bad --split strings are refused naming the string") {
  for (const char* bad : {"1,2,3,4", "-1,2,1", "0,0,0", "", "a,b", "1,,2", "1.2.3", "1e3,1", "inf,1"}) {
    CAPTURE(bad);
    try {
      parse_and_normalize_split(bad);
      FAIL_CHECK("accepted");
    } catch (const dsp::ConfigError& e) {
      CHECK(std::string(e.what()).find("'" + std::string(bad) + "'") != std::string::npos);
    }
  }
  CHECK_THROWS_AS(split_ranges("1,1,1", -1), dsp::ConfigError);
}

}  // namespace data_split_test
