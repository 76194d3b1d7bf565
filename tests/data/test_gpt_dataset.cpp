// GptDataset: the document, sample and shuffle indices and the samples equal those of
// megatron-core's GPTDataset over the same fixture (tests/data/fixtures/megatron_expected.json)
// exactly; every sample equals a window cut from the naive concatenation of the sequences;
// every token of the split is served the expected number of times per epoch.
#include <doctest/doctest.h>

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "dsp/data/gpt_dataset.hpp"
#include "fixture.hpp"

namespace data_gpt_dataset_test {

using data_test::expected;
using data_test::fixture;
using data_test::TempDir;
using dsp::data::GptDataset;
using dsp::data::GptDatasetConfig;
using dsp::data::IndexedDataset;
using dsp::data::SplitRange;

template <class T>
std::vector<std::int64_t> as64(std::span<const T> s) {
  return {s.begin(), s.end()};
}

/// The naive reference: the sequences concatenated in the dataset's document order, and
/// unshuffled sample j cut as the sample_tokens() tokens from j * seq_length (padded at the end).
std::vector<std::int32_t> naive_window(const IndexedDataset& ds, const GptDataset& gpt, std::int64_t j) {
  std::vector<std::int32_t> stream;
  for (auto seq : gpt.document_index()) ds.read(seq, stream);
  const auto from = static_cast<std::size_t>(j * gpt.config().seq_length);
  std::vector<std::int32_t> w;
  for (std::size_t k = from; k < from + static_cast<std::size_t>(gpt.sample_tokens()); ++k)
    w.push_back(k < stream.size() ? stream[k] : gpt.config().pad_token);
  return w;
}

void check_against_naive(const IndexedDataset& ds, const GptDataset& gpt) {
  for (std::int64_t i = 0; i < gpt.size(); ++i) {
    CAPTURE(i);
    CHECK(gpt.get(i) == naive_window(ds, gpt, gpt.shuffle_index()[static_cast<std::size_t>(i)]));
  }
}

TEST_CASE("indices and samples equal megatron-core's GPTDataset for four configurations") {
  const IndexedDataset ds(fixture("megatron_shakespeare"));
  for (const auto& c : expected()["gpt"]) {
    GptDatasetConfig cfg;
    cfg.seq_length = c["seq_length"].get<std::int64_t>();
    if (!c["num_samples"].is_null()) cfg.num_samples = c["num_samples"].get<std::int64_t>();
    cfg.seed = c["seed"].get<std::uint32_t>();
    cfg.drop_last_partial_sequence = c["drop_last_partial_sequence"].get<bool>();
    cfg.pad_token = c["pad"].get<std::int32_t>();
    CAPTURE(cfg.seq_length);
    CAPTURE(cfg.seed);
    const GptDataset gpt(ds, SplitRange{c["begin"].get<std::int64_t>(), c["end"].get<std::int64_t>()}, cfg);
    CHECK(as64(gpt.document_index()) == c["document_index"].get<std::vector<std::int64_t>>());
    CHECK(as64(gpt.sample_index()) == c["sample_index"].get<std::vector<std::int64_t>>());
    CHECK(as64(gpt.shuffle_index()) == c["shuffle_index"].get<std::vector<std::int64_t>>());
    const auto samples = c["samples"].get<std::vector<std::vector<std::int32_t>>>();
    for (std::size_t i = 0; i < samples.size(); ++i) {
      CAPTURE(i);
      CHECK(gpt.get(static_cast<std::int64_t>(i)) == samples[i]);
    }
    // Megatron's __getitem__: tokens = text[:-1], labels = text[1:]
    const auto text = gpt.get(0);
    CHECK(std::vector<std::int32_t>(text.begin(), text.end() - 1) == c["getitem_tokens_0"].get<std::vector<std::int32_t>>());
    CHECK(std::vector<std::int32_t>(text.begin() + 1, text.end()) == c["getitem_labels_0"].get<std::vector<std::int32_t>>());
    if (cfg.num_samples) CHECK(gpt.size() >= *cfg.num_samples);
    check_against_naive(ds, gpt);
  }
}

/// A dataset of unique tokens (each id once): 60 documents of 1-3 sequences of 0-40 tokens.
std::string unique_token_dataset(const TempDir& dir) {
  const auto prefix = dir / "unique";
  dsp::data::IndexedDatasetBuilder b(prefix, dsp::data::TokenDType::int32);
  std::mt19937 rng(5);
  std::int64_t id = 1;
  for (int d = 0; d < 60; ++d) {
    const int n = 1 + static_cast<int>(rng() % 3);
    for (int s = 0; s < n; ++s) {
      std::vector<std::int64_t> seq(rng() % 41);
      for (auto& t : seq) t = id++;
      b.add_item(seq);
    }
    b.end_document();
  }
  b.finalize();
  return prefix;
}

TEST_CASE("every token of the split is served once per epoch, the tail of the last epoch excepted") {
  TempDir dir;
  const IndexedDataset ds(unique_token_dataset(dir));
  const auto split = *dsp::data::split_ranges("8,1,1", ds.sequence_count())[0];
  std::map<std::int32_t, int> in_split;  // token id -> 0
  for (auto i = split.begin; i < split.end; ++i)
    for (auto t : ds.sequence(i)) in_split[t] = 0;

  // (num_samples, seq_length): one epoch; three epochs shuffled together; a separate final epoch
  for (auto [num_samples, seq] : std::vector<std::pair<std::int64_t, std::int64_t>>{{-1, 17}, {0, 13}, {0, 8}}) {
    GptDatasetConfig cfg;
    cfg.seq_length = seq;
    cfg.seed = 11;
    const auto per_epoch = [&] {
      std::int64_t tokens = 0;
      for (auto i = split.begin; i < split.end; ++i) tokens += ds.sequence_length(i);
      return (tokens - 1) / seq;
    }();
    if (num_samples == 0) num_samples = seq == 13 ? 3 * per_epoch - 2 : 2 * per_epoch + per_epoch / 4;
    if (num_samples > 0) cfg.num_samples = num_samples;
    CAPTURE(seq);
    const GptDataset gpt(ds, split, cfg);
    const auto epochs = gpt.num_epochs();
    CHECK(epochs == (seq == 17 ? 1 : 3));
    // the document index holds every sequence of the split num_epochs times
    std::map<std::int32_t, int> seen_seq;
    for (auto s : gpt.document_index()) ++seen_seq[s];
    CHECK(static_cast<std::int64_t>(seen_seq.size()) == split.size());
    for (const auto& [s, n] : seen_seq) CHECK(n == epochs);
    // the inputs (first seq_length tokens) of all samples cover the stream once: each split
    // token epochs times, less the tail of the stream past the last sample (1 to seq tokens)
    auto count = in_split;
    for (std::int64_t i = 0; i < gpt.size(); ++i) {
      const auto w = gpt.get(i);
      REQUIRE(static_cast<std::int64_t>(w.size()) == seq + 1);
      for (std::int64_t k = 0; k < seq; ++k) {
        REQUIRE(count.count(w[static_cast<std::size_t>(k)]) == 1);  // only tokens of the split
        ++count[w[static_cast<std::size_t>(k)]];
      }
    }
    std::int64_t short_tokens = 0;
    for (const auto& [t, n] : count) {
      CHECK(n >= epochs - 1);
      CHECK(n <= epochs);
      short_tokens += epochs - n;
    }
    CHECK(short_tokens == epochs * gpt.tokens_per_epoch() - gpt.size() * seq);
    CHECK(short_tokens >= 1);  // (E T - 1) mod seq + 1: the extra token of the last sample is never an input
    CHECK(short_tokens <= seq);
    check_against_naive(ds, gpt);
  }
}

TEST_CASE("deterministic given the seed; another seed shuffles otherwise") {
  const IndexedDataset ds(fixture("megatron_shakespeare"));
  GptDatasetConfig cfg;
  cfg.seq_length = 20;
  cfg.seed = 42;
  const GptDataset a(ds, SplitRange{0, ds.sequence_count()}, cfg), b(ds, SplitRange{0, ds.sequence_count()}, cfg);
  CHECK(as64(a.shuffle_index()) == as64(b.shuffle_index()));
  for (std::int64_t i = 0; i < a.size(); ++i) CHECK(a.get(i) == b.get(i));
  cfg.seed = 43;
  const GptDataset c(ds, SplitRange{0, ds.sequence_count()}, cfg);
  CHECK(as64(a.shuffle_index()) != as64(c.shuffle_index()));
  CHECK(as64(a.document_index()) != as64(c.document_index()));
}

TEST_CASE("numpy RandomState's shuffle of arange(10) with seed 0") {
  // numpy.random.RandomState(0).shuffle(x := numpy.arange(10)) -> [2 8 4 9 1 6 7 3 0 5]
  std::vector<int> x{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  dsp::data::detail::NumpyRandomState(0).shuffle(std::span<int>(x));
  CHECK(x == std::vector<int>{2, 8, 4, 9, 1, 6, 7, 3, 0, 5});
}

TEST_CASE("bad configurations are refused") {
  const IndexedDataset ds(fixture("megatron_shakespeare"));
  GptDatasetConfig cfg;
  cfg.seq_length = 1;
  CHECK_THROWS_AS(GptDataset(ds, SplitRange{0, 10}, cfg), dsp::ConfigError);
  cfg.seq_length = 8;
  CHECK_THROWS_AS(GptDataset(ds, SplitRange{0, ds.sequence_count() + 1}, cfg), dsp::ConfigError);
  CHECK_THROWS_AS(GptDataset(ds, SplitRange{3, 2}, cfg), dsp::ConfigError);
  cfg.seq_length = 100000;  // more than the fixture's 2293 tokens
  CHECK_THROWS_AS(GptDataset(ds, SplitRange{0, ds.sequence_count()}, cfg), dsp::InputError);
  cfg.seq_length = 8;
  const GptDataset gpt(ds, SplitRange{0, 4}, cfg);
  CHECK_THROWS_AS(gpt.get(gpt.size()), dsp::ConfigError);
  CHECK_THROWS_AS(gpt.get(-1), dsp::ConfigError);
}

}  // namespace data_gpt_dataset_test
