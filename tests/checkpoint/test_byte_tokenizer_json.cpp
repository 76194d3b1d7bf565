// The byte-level tokenizer files merge writes beside a byte model: read back with the project's
// own BpeTokenizer, every byte string gives ids = its bytes and decodes back to it.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/checkpoint/byte_tokenizer_json.hpp"
#include "dsp/checkpoint/merge.hpp"
#include "dsp/checkpoint/save.hpp"
#include "dsp/data/bpe_tokenizer.hpp"
#include "fixture.hpp"

using namespace checkpoint_test;
using namespace dsp::checkpoint;

namespace checkpoint_byte_tokenizer_json_test {

namespace {

std::vector<std::int32_t> bytes_of(const std::string& s) {
  std::vector<std::int32_t> ids;
  for (const char c : s) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

// Byte strings that exercise GPT-2's split: every byte alone, all 256 in order and reversed,
// text with contractions, runs of white space, digits, punctuation, valid and invalid UTF-8,
// and 200 random strings of up to 64 bytes (fixed seed).
std::vector<std::string> probe_strings() {
  std::vector<std::string> out;
  std::string all, reversed;
  for (int b = 0; b < 256; ++b) {
    out.emplace_back(1, static_cast<char>(b));
    all += static_cast<char>(b);
    reversed += static_cast<char>(255 - b);
  }
  out.push_back(all);
  out.push_back(reversed);
  out.push_back("ROMEO:\nBut soft, what light through yonder window breaks?\n\n");
  out.push_back("I've been 'told he's there, 'RE you sure?  \t\n   3.33 ......!!! \xC3\xA9t\xC3\xA9 \xE2\x96\x81 \xF0\x9F\xA6\x99");
  out.push_back("  leading spaces, trailing spaces   ");
  out.push_back(std::string("\x00\x01\xFF\xFE\x80\xC3", 6));  // NUL, invalid UTF-8, a cut sequence
  out.push_back("<|endoftext" "|");  // an unfinished EOD is bytes
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> byte(0, 255), length(0, 64);
  for (int i = 0; i < 200; ++i) {
    std::string s(static_cast<std::size_t>(length(rng)), '\0');
    for (char& c : s) c = static_cast<char>(byte(rng));
    out.push_back(s);
  }
  return out;
}

}  // namespace

TEST_CASE("byte_tokenizer_json: every byte string round-trips through BpeTokenizer as ids = bytes") {
  for (const std::int64_t vocab : {256, 257}) {
    CAPTURE(vocab);
    const auto tok = dsp::data::BpeTokenizer::from_json(byte_tokenizer_json(vocab), "byte tokenizer");
    CHECK(tok.vocab_size() == vocab);
    for (const std::string& s : probe_strings()) {
      const auto ids = tok.encode(s);
      CHECK(ids == bytes_of(s));
      CHECK(tok.decode(ids) == s);
    }
  }
}

TEST_CASE("byte_tokenizer_json: the vocab is GPT-2's byte alphabet at the bytes' ids, no merges") {
  const nlohmann::json j = byte_tokenizer_json(256);
  const auto& vocab = j["model"]["vocab"];
  CHECK(vocab.size() == 256);
  CHECK(vocab["A"] == 65);           // printable bytes are themselves
  CHECK(vocab["\xC4\xA0"] == 32);    // ' ' is U+0120 (GPT-2's "Ġ")
  CHECK(vocab["\xC4\x8A"] == 10);    // '\n' is U+010A ("Ċ")
  CHECK(vocab["\xC4\x80"] == 0);     // NUL is U+0100
  CHECK(vocab["\xC3\xBF"] == 255);   // 0xFF is U+00FF
  CHECK(j["model"]["merges"].empty());
  CHECK(j["added_tokens"].empty());
  CHECK(j["pre_tokenizer"]["type"] == "ByteLevel");
  CHECK(j["pre_tokenizer"]["add_prefix_space"] == false);
  CHECK(j["decoder"]["type"] == "ByteLevel");
  CHECK(j["post_processor"].is_null());
  CHECK(j["normalizer"].is_null());
}

TEST_CASE("byte_tokenizer_json: 257 ids add the end-of-document token <|endoftext|> at 256") {
  const auto tok = dsp::data::BpeTokenizer::from_json(byte_tokenizer_json(257), "byte tokenizer");
  CHECK(tok.eod() == 256);
  CHECK(tok.encode("ab<|endoftext|>c") == std::vector<std::int32_t>{97, 98, 256, 99});
  CHECK(tok.decode({104, 105, 256}) == "hi<|endoftext|>");
  const nlohmann::json config = byte_tokenizer_config_json(257, 128);
  CHECK(config["eos_token"] == "<|endoftext|>");
  CHECK(config["added_tokens_decoder"]["256"]["special"] == true);
  CHECK(byte_tokenizer_config_json(256, 128)["eos_token"].is_null());
  CHECK(config["tokenizer_class"] == "PreTrainedTokenizerFast");
  CHECK(config["add_bos_token"] == false);
  CHECK(config["add_eos_token"] == false);
  CHECK(config["model_max_length"] == 128);
}

TEST_CASE("byte_tokenizer_json: other vocabulary sizes are refused") {
  CHECK(!is_byte_level_vocab(255));
  CHECK(!is_byte_level_vocab(50257));
  CHECK_THROWS_AS(byte_tokenizer_json(258), dsp::ConfigError);
  CHECK_THROWS_AS(byte_tokenizer_config_json(65, 128), dsp::ConfigError);
}

TEST_CASE("merge writes the byte-level tokenizer beside a byte model, and none beside another") {
  TempDir tmp;
  const auto specs = fake_specs();
  const auto globals = fake_globals(specs);
  auto meta = fake_meta(2);
  save_all(tmp / "other", states_of(make_tp_states(specs, globals, 2)), meta);  // vocab_size 65
  meta.model_config["vocab_size"] = 257;
  meta.model_config["max_position_embeddings"] = 128;
  save_all(tmp / "bytes", states_of(make_tp_states(specs, globals, 2)), meta);

  merge(tmp / "other", tmp / "hf_other");
  CHECK(!fs::exists(tmp / "hf_other" / "tokenizer.json"));
  CHECK(!fs::exists(tmp / "hf_other" / "tokenizer_config.json"));

  merge(tmp / "bytes", tmp / "hf_bytes");
  CHECK(nlohmann::json::parse(read_text(tmp / "hf_bytes" / "tokenizer.json")) == byte_tokenizer_json(257));
  CHECK(nlohmann::json::parse(read_text(tmp / "hf_bytes" / "tokenizer_config.json")) ==
        byte_tokenizer_config_json(257, 128));
  const auto tok = dsp::data::BpeTokenizer::from_file(tmp / "hf_bytes" / "tokenizer.json");
  const std::string text = "First Citizen:\nBefore we proceed any further, hear me speak.";
  CHECK(tok.encode(text) == bytes_of(text));
  CHECK(std::distance(fs::directory_iterator(tmp / "hf_bytes"), fs::directory_iterator()) == 4);
}

}  // namespace checkpoint_byte_tokenizer_json_test
