// Blending: build_blending_indices equals megatron-core's helpers.build_blending_indices
// (tests/data/fixtures/megatron_expected.json) index for index, equals a naive rewrite of the
// greedy rule, and keeps every dataset's share within 1% over 10,000 samples.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "dsp/data/blended_dataset.hpp"
#include "fixture.hpp"

namespace data_blended_dataset_test {

using dsp::data::build_blending_indices;
using dsp::data::normalize_weights;

/// The greedy rule written plainly: the dataset furthest below its target weight * max(i, 1).
std::vector<int> naive_blend(const std::vector<double>& w, int size) {
  std::vector<int> which;
  std::vector<double> count(w.size(), 0.0);
  for (int i = 0; i < size; ++i) {
    int best = 0;
    for (int k = 1; k < static_cast<int>(w.size()); ++k)
      if (w[k] * std::max(i, 1) - count[k] > w[best] * std::max(i, 1) - count[best]) best = k;
    which.push_back(best);
    count[best] += 1;
  }
  return which;
}

TEST_CASE("blending indices equal megatron-core's helpers.build_blending_indices") {
  for (const auto& c : data_test::expected()["blend"]) {
    const auto w = c["weights"].get<std::vector<double>>();
    const auto size = c["size"].get<std::int64_t>();
    CAPTURE(w.size());
    const auto b = build_blending_indices(w, size);
    CHECK(b.dataset_index == c["dataset_index"].get<std::vector<std::int16_t>>());
    CHECK(b.dataset_sample_index == c["dataset_sample_index"].get<std::vector<std::int64_t>>());
  }
}

TEST_CASE("0.3 / 0.7 over 10,000 samples: shares within 1%, exact against the naive rule") {
  const auto w = normalize_weights(std::vector<double>{3, 7});
  CHECK(w == std::vector<double>{0.3, 0.7});
  const int n = 10000;
  const auto b = build_blending_indices(w, n);
  const auto naive = naive_blend(w, n);
  std::vector<std::int64_t> count(2, 0);
  for (int i = 0; i < n; ++i) {
    CHECK(b.dataset_index[i] == naive[i]);
    CHECK(b.dataset_sample_index[i] == count[b.dataset_index[i]]);  // each dataset's samples in order
    ++count[b.dataset_index[i]];
    // after every prefix each dataset is within 1 sample of its target (the greedy rule's bound)
    for (int k = 0; k < 2; ++k) CHECK(std::abs(static_cast<double>(count[k]) - w[k] * (i + 1)) <= 1.0);
  }
  CHECK(std::abs(count[0] / double(n) - 0.3) < 0.01);
  CHECK(std::abs(count[1] / double(n) - 0.7) < 0.01);
  // five uneven datasets, a zero weight among them
  const auto w5 = normalize_weights(std::vector<double>{0.1, 2, 0, 0.35, 1});
  const auto b5 = build_blending_indices(w5, 5000);
  const auto naive5 = naive_blend(w5, 5000);
  std::vector<int> got5(b5.dataset_index.begin(), b5.dataset_index.end());
  CHECK(got5 == naive5);
  for (int k = 0; k < 5; ++k) {
    const auto c = std::count(got5.begin(), got5.end(), k);
    CHECK(std::abs(c / 5000.0 - w5[k]) < 0.01);
  }
}

TEST_CASE("--data-path words, weights and sample margins") {
  using dsp::data::BlendEntry;
  using dsp::data::parse_data_path;
  CHECK(parse_data_path({"data/a_text_document"}) == std::vector<BlendEntry>{{1.0, "data/a_text_document"}});
  CHECK(parse_data_path({"0.3", "A", "0.7", "B"}) == std::vector<BlendEntry>{{0.3, "A"}, {0.7, "B"}});
  for (const auto& bad : std::vector<std::vector<std::string>>{{}, {"0.3", "A", "B"}, {"x", "A", "0.7", "B"},
                                                               {"-1", "A", "2", "B"}}) {
    CAPTURE(bad.size());
    CHECK_THROWS_AS(parse_data_path(bad), dsp::ConfigError);
  }
  try {
    parse_data_path({"0.3", "A", "zero", "B"});
  } catch (const dsp::ConfigError& e) {
    CHECK(std::string(e.what()).find("'0.3 A zero B'") != std::string::npos);
  }
  CHECK_THROWS_AS(normalize_weights(std::vector<double>{0, 0}), dsp::ConfigError);
  CHECK_THROWS_AS(normalize_weights(std::vector<double>{1, -1}), dsp::ConfigError);
  CHECK_THROWS_AS(normalize_weights(std::vector<double>{}), dsp::ConfigError);
  // Megatron's margin: ceil(ceil(1000 * 0.3) * 1.005) = 302, ceil(ceil(1000 * 0.7) * 1.005) = 704
  CHECK(dsp::data::samples_per_dataset(std::vector<double>{0.3, 0.7}, 1000) == std::vector<std::int64_t>{302, 704});
}

}  // namespace data_blended_dataset_test
