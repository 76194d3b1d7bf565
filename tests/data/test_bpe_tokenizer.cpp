// BpeTokenizer against the ids of Hugging Face `tokenizers` (fixture written by
// tools/write_bpe_fixture.py: a 2000-token byte-level BPE trained on tinyshakespeare), and
// ByteTokenizer.
#include <doctest/doctest.h>
#include <zlib.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "../data_dir.hpp"
#include "dsp/data/bpe_tokenizer.hpp"
#include "dsp/data/byte_tokenizer.hpp"

namespace data_bpe_tokenizer_test {

using dsp::data::BpeTokenizer;
using dsp::data::ByteTokenizer;

std::string fixture_dir() { return dsp::test::data_dir() + "/../tests/data/fixtures/shakespeare_bpe"; }

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_all(path)); }

// corpus_ids.u16.gz: uint16 little-endian ids, gzip.
std::vector<std::int32_t> read_corpus_ids() {
  const auto path = fixture_dir() + "/corpus_ids.u16.gz";
  gzFile f = gzopen(path.c_str(), "rb");
  REQUIRE_MESSAGE(f != nullptr, path);
  std::vector<std::int32_t> ids;
  unsigned char buf[1 << 16];
  int n;
  std::vector<unsigned char> raw;
  while ((n = gzread(f, buf, sizeof buf)) > 0) raw.insert(raw.end(), buf, buf + n);
  gzclose(f);
  REQUIRE(raw.size() % 2 == 0);
  for (std::size_t i = 0; i < raw.size(); i += 2) ids.push_back(raw[i] | (raw[i + 1] << 8));
  return ids;
}

std::string corpus() { return read_all(dsp::test::data_dir() + "/tinyshakespeare.txt"); }

struct TempFile {
  std::filesystem::path path;
  explicit TempFile(const std::string& name, const std::string& text)
      : path(std::filesystem::temp_directory_path() / ("dsp_bpe_test_" + std::to_string(::getpid()) + "_" + name)) {
    std::ofstream(path, std::ios::binary) << text;
  }
  ~TempFile() { std::filesystem::remove(path); }
};

TEST_CASE("BpeTokenizer: the whole corpus encodes to the ids of `tokenizers` and decodes back") {
  const auto tok = BpeTokenizer::from_file(fixture_dir() + "/tokenizer.json");
  const auto meta = read_json(fixture_dir() + "/cases.json");
  CHECK(tok.vocab_size() == meta["vocab_size"].get<int>());
  CHECK(tok.token_id("<|endoftext|>") == 0);
  CHECK(tok.eod() == 0);
  const auto text = corpus();
  const auto expected = read_corpus_ids();
  REQUIRE(expected.size() == meta["corpus_tokens"].get<std::size_t>());
  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = tok.encode(text);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("encoded ", text.size(), " bytes into ", ids.size(), " tokens in ", s, " s");
  REQUIRE(ids.size() == expected.size());
  std::size_t first_diff = ids.size();
  for (std::size_t i = 0; i < ids.size() && first_diff == ids.size(); ++i)
    if (ids[i] != expected[i]) first_diff = i;
  CHECK_MESSAGE(first_diff == ids.size(), "first difference at token ", first_diff);
  CHECK(tok.decode(ids) == text);
}

TEST_CASE("BpeTokenizer: special cases (added tokens, spaces, digits, non-ASCII) equal `tokenizers`") {
  auto spec = read_json(fixture_dir() + "/tokenizer.json");
  const auto meta = read_json(fixture_dir() + "/cases.json");
  const auto plain = BpeTokenizer::from_json(spec, "fixture");
  spec["pre_tokenizer"]["add_prefix_space"] = true;
  const auto prefixed = BpeTokenizer::from_json(spec, "fixture+prefix");
  // Merges written as "a b" strings (the older form) give the same tokenizer.
  auto strings = read_json(fixture_dir() + "/tokenizer.json");
  for (auto& m : strings["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  const TempFile file("merges_as_strings.json", strings.dump());
  const auto from_strings = BpeTokenizer::from_file(file.path);
  for (const auto& c : meta["cases"]) {
    const auto text = c["text"].get<std::string>();
    CAPTURE(text);
    CHECK(plain.encode(text) == c["ids"].get<std::vector<std::int32_t>>());
    CHECK(from_strings.encode(text) == c["ids"].get<std::vector<std::int32_t>>());
    CHECK(prefixed.encode(text) == c["ids_prefix_space"].get<std::vector<std::int32_t>>());
    CHECK(plain.decode(plain.encode(text)) == text);
  }
  // Bytes that are not UTF-8 still round-trip.
  const std::string bad = "ab\xff\xfe c\xc3";
  CHECK(plain.decode(plain.encode(bad)) == bad);
  CHECK_THROWS_AS((void)plain.decode({plain.vocab_size()}), dsp::InputError);
  CHECK_THROWS_AS((void)plain.token_id("no such token"), dsp::InputError);
  CHECK(plain.find_token("Ġthe").has_value());
}

TEST_CASE("ByteTokenizer: one id per byte and the EOD 256, round trip") {
  const ByteTokenizer tok;
  CHECK(tok.vocab_size() == 257);
  CHECK(tok.eod() == 256);
  CHECK(tok.decode({'a', 256, 'b'}) == "ab");
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const auto ids = tok.encode(all);
  REQUIRE(ids.size() == 256);
  for (int b = 0; b < 256; ++b) CHECK(ids[static_cast<std::size_t>(b)] == b);
  CHECK(tok.decode(ids) == all);
  const auto text = corpus();
  CHECK(tok.decode(tok.encode(text)) == text);
  CHECK(tok.token_id("\n") == 10);
  CHECK_THROWS_AS((void)tok.token_id("ab"), dsp::InputError);
  CHECK_THROWS_AS((void)tok.decode({257}), dsp::InputError);
  CHECK_THROWS_AS((void)tok.decode({-1}), dsp::InputError);
}

void check_error_names(const std::filesystem::path& path, const std::string& what) {
  try {
    (void)BpeTokenizer::from_file(path);
    FAIL("no error for ", what);
  } catch (const dsp::InputError& e) {
    const std::string msg = e.what();
    CAPTURE(msg);
    CHECK(msg.find(path.string()) != std::string::npos);
    CHECK(msg.find(what) != std::string::npos);
  }
}

TEST_CASE("BpeTokenizer: bad files are refused naming the file") {
  check_error_names("/nonexistent/dsp/tokenizer.json", "cannot be opened");
  const TempFile broken("broken.json", "{\"model\": {\"type\": \"BPE\", ");
  check_error_names(broken.path, "not valid JSON");
  auto spec = read_json(fixture_dir() + "/tokenizer.json");
  spec["model"]["type"] = "WordPiece";
  const TempFile wordpiece("wordpiece.json", spec.dump());
  check_error_names(wordpiece.path, "model type 'WordPiece'");
  spec = read_json(fixture_dir() + "/tokenizer.json");
  spec["model"]["merges"].push_back({"zzzq", "qqqz"});
  const TempFile bad_merge("bad_merge.json", spec.dump());
  check_error_names(bad_merge.path, "missing from the vocab");
  spec = read_json(fixture_dir() + "/tokenizer.json");
  spec["model"]["vocab"] = 5;
  const TempFile bad_vocab("bad_vocab.json", spec.dump());
  check_error_names(bad_vocab.path, "vocab");
}

}  // namespace data_bpe_tokenizer_test
