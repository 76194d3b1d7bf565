// BlendedGptData, what dsp-train reads Megatron datasets through: one prefix serves
// megatron-core's GPTDataset samples (tests/data/fixtures/megatron_expected.json) as inputs
// and shifted targets; a 0.3/0.7 blend of two datasets whose tokens say where they come from
// draws them in those proportions; bad input is refused naming the flag or file.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dsp/data/blended_gpt_data.hpp"
#include "fixture.hpp"

namespace data_blended_gpt_data_test {

using data_test::expected;
using data_test::fixture;
using data_test::TempDir;
using dsp::data::BlendedGptData;
using dsp::data::GptDataConfig;

TEST_CASE("BlendedGptData: one prefix gives megatron-core's GPTDataset samples, inputs and shifted targets") {
  // case 0 of the fixture: seq_length 32, seed 1234, the train part of --split 8,1,1, one epoch
  const auto& c = expected()["gpt"][0];
  REQUIRE(c["seq_length"] == 32);
  REQUIRE(c["num_samples"].is_null());
  const auto samples = c["samples"].get<std::vector<std::vector<std::int32_t>>>();
  const auto one_epoch = static_cast<std::int64_t>(c["shuffle_index"].size());
  REQUIRE(static_cast<std::int64_t>(samples.size()) == one_epoch);
  GptDataConfig config{.blend = {{1.0, fixture("megatron_shakespeare")}}, .split = "8,1,1", .seq_length = 32,
                       .seed = 1234, .train_samples = one_epoch, .valid_samples = 1, .vocab_size = 257};
  const BlendedGptData data(config);
  CHECK(data.train_samples() == one_epoch);
  CHECK(data.in_training_order());
  std::vector<std::int32_t> inputs, targets;
  for (std::int64_t i = 0; i < one_epoch; ++i) {
    CAPTURE(i);
    const std::vector<std::int64_t> one{i};
    data.batch(false, one, inputs, targets);
    const auto& s = samples[static_cast<std::size_t>(i)];
    CHECK(inputs == std::vector<std::int32_t>(s.begin(), s.begin() + 32));
    CHECK(targets == std::vector<std::int32_t>(s.begin() + 1, s.end()));
  }
  // several samples side by side
  const std::vector<std::int64_t> three{2, 0, 1};
  data.batch(false, three, inputs, targets);
  REQUIRE(inputs.size() == 96);
  CHECK(std::vector<std::int32_t>(inputs.begin() + 32, inputs.begin() + 64) ==
        std::vector<std::int32_t>(samples[0].begin(), samples[0].begin() + 32));
}

// A dataset of `docs` documents of 50 tokens, every token `token`, each document ended by EOD 9.
void write_constant(const std::string& prefix, std::int32_t token, int docs) {
  dsp::data::IndexedDatasetBuilder b(prefix, dsp::data::TokenDType::uint16);
  for (int d = 0; d < docs; ++d) {
    std::vector<std::int32_t> doc(50, token);
    doc.push_back(9);
    b.add_item(doc);
    b.end_document();
  }
  b.finalize();
}

TEST_CASE("BlendedGptData: --data-path 0.3 A 0.7 B draws A and B in those proportions (1% over 10,000 samples)") {
  const TempDir dir;
  write_constant((dir / "a").string(), 1, 40);
  write_constant((dir / "b").string(), 2, 60);
  GptDataConfig config{.blend = dsp::data::parse_data_path({"0.3", (dir / "a").string(), "0.7", (dir / "b").string()}),
                       .split = "969,30,1", .seq_length = 16, .seed = 7, .train_samples = 10000,
                       .valid_samples = 8, .vocab_size = 10};
  const BlendedGptData data(config);
  REQUIRE(data.train_samples() == 10000);
  std::int64_t from_a = 0;
  std::vector<std::int32_t> inputs, targets;
  for (std::int64_t i = 0; i < 10000; ++i) {
    const std::vector<std::int64_t> one{i};
    data.batch(false, one, inputs, targets);
    bool a = false, b = false;  // which dataset the tokens say (EOD 9 is in both)
    for (auto t : inputs) {
      a = a || t == 1;
      b = b || t == 2;
    }
    REQUIRE(a != b);
    CHECK(data.dataset_of(false, i) == (a ? 0 : 1));
    from_a += a;
  }
  MESSAGE("samples from A: ", from_a, " of 10000");
  CHECK(std::abs(static_cast<double>(from_a) / 10000.0 - 0.3) <= 0.01);
  // the validation part blends too (its own samples, from the datasets' validation ranges)
  CHECK(data.val_samples() == 8);
  // each dataset is asked for ceil(ceil(10000 w) * 1.005) samples, as megatron-core asks
  CHECK(data.dataset(false, 0).size() >= 3015);
  CHECK(data.dataset(false, 1).size() >= 7035);
}

TEST_CASE("BlendedGptData: bad input is refused naming the flag or the file") {
  const TempDir dir;
  write_constant((dir / "a").string(), 1, 40);
  const std::string a = (dir / "a").string();
  GptDataConfig ok{.blend = {{1.0, a}}, .split = "969,30,1", .seq_length = 16, .seed = 1, .train_samples = 10,
                   .valid_samples = 2, .vocab_size = 10};
  CHECK_NOTHROW(BlendedGptData{ok});
  auto missing = ok;
  missing.blend = {{1.0, (dir / "nope").string()}};
  CHECK_THROWS_WITH_AS(BlendedGptData{missing}, doctest::Contains("nope"), dsp::InputError);
  auto no_valid = ok;
  no_valid.split = "100,0,0";
  CHECK_THROWS_WITH_AS(BlendedGptData{no_valid}, doctest::Contains("--split '100,0,0' gives the validation part"),
                       dsp::ConfigError);
  auto bad_split = ok;
  bad_split.split = "a,b";
  CHECK_THROWS_AS(BlendedGptData{bad_split}, dsp::ConfigError);
  auto small_vocab = ok;
  small_vocab.vocab_size = 5;  // the EOD 9 is outside
  const BlendedGptData data(small_vocab);
  std::vector<std::int32_t> inputs, targets;
  std::vector<std::int64_t> all(10);
  for (std::int64_t i = 0; i < 10; ++i) all[static_cast<std::size_t>(i)] = i;
  CHECK_THROWS_WITH_AS(data.batch(false, all, inputs, targets), doctest::Contains("holds token id 9"),
                       dsp::InputError);
  CHECK_THROWS_AS(data.batch(false, std::vector<std::int64_t>{10}, inputs, targets), dsp::ConfigError);
}

}  // namespace data_blended_gpt_data_test
