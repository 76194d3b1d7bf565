// serve/consistency.hpp: logit comparison, byte tokens and the fixed prompts.
#include <doctest/doctest.h>

#include <cmath>
#include <set>

#include "dsp/serve/consistency.hpp"

using namespace dsp;

namespace serve_consistency_test {

TEST_CASE("consistency: max_abs_logit_diff") {
  const std::vector<Tensor> a{Tensor({1, 3}, {1.0f, 2.0f, 3.0f}), Tensor({2, 1}, {0.0f, -1.0f})};
  const std::vector<Tensor> b{Tensor({1, 3}, {1.0f, 2.5f, 3.0f}), Tensor({2, 1}, {0.0f, 0.25f})};
  CHECK(serve::max_abs_logit_diff(a, a) == 0.0);
  CHECK(serve::max_abs_logit_diff(a, b) == 1.25);
  CHECK(serve::max_abs_logit_diff({}, {}) == 0.0);
  const std::vector<Tensor> nan{Tensor({1, 3}, {1.0f, NAN, 3.0f}), Tensor({2, 1}, {0.0f, -1.0f})};
  CHECK(std::isnan(serve::max_abs_logit_diff(nan, a)));
  CHECK_THROWS_AS(serve::max_abs_logit_diff(a, {b[0]}), Error);
  CHECK_THROWS_AS(serve::max_abs_logit_diff(a, {b[0], Tensor({1, 2})}), Error);
}

TEST_CASE("consistency: byte tokens round-trip; ids outside a byte decode to '?'") {
  const std::string text = "First Citizen:\nBefore we proceed\xff";
  const auto ids = serve::encode_bytes(text);
  CHECK(ids.size() == text.size());
  CHECK(ids.front() == 'F');
  CHECK(ids.back() == 255);
  CHECK(serve::decode_bytes(ids) == text);
  CHECK(serve::decode_bytes({72, 256, 105, -1}) == "H?i?");
  CHECK(serve::encode_bytes("").empty());
}

TEST_CASE("consistency: at least 8 fixed ASCII prompts of different lengths, 1 to ~60 bytes") {
  const auto prompts = serve::default_prompts();
  CHECK(prompts.size() >= 8);
  std::set<std::size_t> lengths;
  for (const auto& p : prompts) {
    lengths.insert(p.size());
    for (auto id : serve::encode_bytes(p)) CHECK(id < 127);
  }
  CHECK(lengths.size() == prompts.size());
  CHECK(*lengths.begin() == 1);
  CHECK(*lengths.rbegin() >= 50);
  CHECK(*lengths.rbegin() <= 64);
  CHECK(serve::default_prompts() == prompts);
}

}  // namespace serve_consistency_test
