#pragma once
// The byte-level tokenizer of dsp's byte models as Hugging Face files, written beside a
// merged checkpoint (merge.hpp) so that Hugging Face `tokenizers`/transformers and llama.cpp's
// converter read the model's own tokenizer: id b is byte b (0 .. 255), and id 256 is the
// end-of-document token "<|endoftext|>" when the vocabulary has 257 ids (data::ByteTokenizer).
//   tokenizer.json         model "BPE" over GPT-2's byte alphabet (bytes_to_unicode: each byte
//                          one code point, data::detail::byte_to_code_point), vocab = the 256
//                          bytes at their own ids, no merges (so every byte stays its own token
//                          whatever the split), ByteLevel pre-tokenizer (GPT-2's split, no
//                          prefix space) and decoder, no normalizer, no post-processor (no
//                          BOS/EOS added); the EOD, when there is one, an added special token
//   tokenizer_config.json  tokenizer_class PreTrainedTokenizerFast (transformers would otherwise
//                          take LlamaTokenizerFast from config.json, which adds a BOS "<s>"),
//                          add_bos_token / add_eos_token false, no clean-up of spaces in decode,
//                          model_max_length the sequence length
// A model of another vocabulary size has no such tokenizer (is_byte_level_vocab).
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "dsp/core/error.hpp"
#include "dsp/data/bpe_tokenizer.hpp"

namespace dsp::checkpoint {

/// Name of the byte-level tokenizer file written beside a merged byte-level model.
inline constexpr std::string_view merged_tokenizer_file = "tokenizer.json";
/// Name of its transformers settings file.
inline constexpr std::string_view merged_tokenizer_config_file = "tokenizer_config.json";
/// The end-of-document token of a 257-id byte model (id 256), as GPT-2 and BpeTokenizer::eod name it.
inline constexpr std::string_view byte_eod_token = "<|endoftext|>";

/// Whether a model of `vocab_size` ids is byte-level: 256 (the bytes) or 257 (bytes and the
/// EOD 256, data::ByteTokenizer).
inline bool is_byte_level_vocab(std::int64_t vocab_size) { return vocab_size == 256 || vocab_size == 257; }

namespace detail {

// UTF-8 of one code point (< 0x800 suffices for GPT-2's byte alphabet, U+0021 .. U+0143).
inline std::string utf8_of(char32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

inline void check_byte_level_vocab(std::int64_t vocab_size) {
  DSP_CHECK_AS(ConfigError, is_byte_level_vocab(vocab_size), "a byte-level tokenizer needs a vocabulary of 256 ids ",
               "(bytes) or 257 (bytes and the end-of-document token 256), got ", vocab_size);
}

}  // namespace detail

/// tokenizer.json of the byte-level tokenizer of a `vocab_size`-id model (see the header
/// comment): each byte b maps to id b and back, in `tokenizers` and in llama.cpp's GPT-2 BPE.
/// Throws ConfigError unless is_byte_level_vocab(vocab_size).
inline nlohmann::json byte_tokenizer_json(std::int64_t vocab_size) {
  detail::check_byte_level_vocab(vocab_size);
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b)
    vocab[detail::utf8_of(data::detail::byte_to_code_point()[static_cast<std::size_t>(b)])] = b;
  nlohmann::json added = nlohmann::json::array();
  if (vocab_size == 257)
    added.push_back({{"id", 256},
                     {"content", byte_eod_token},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  const nlohmann::json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", nullptr},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", vocab},
            {"merges", nlohmann::json::array()}}}};
}

/// tokenizer_config.json beside byte_tokenizer_json(vocab_size) (see the header comment);
/// `model_max_length`: the model's sequence length. The EOD, when there is one, is the eos and
/// bos token (as GPT-2's <|endoftext|>), but add_bos_token / add_eos_token are false: nothing is
/// added to a prompt. Throws ConfigError unless is_byte_level_vocab(vocab_size).
inline nlohmann::json byte_tokenizer_config_json(std::int64_t vocab_size, std::int64_t model_max_length) {
  detail::check_byte_level_vocab(vocab_size);
  const nlohmann::json eod = vocab_size == 257 ? nlohmann::json(byte_eod_token) : nlohmann::json(nullptr);
  nlohmann::json j = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                      {"model_max_length", model_max_length},
                      {"add_bos_token", false},
                      {"add_eos_token", false},
                      {"clean_up_tokenization_spaces", false},
                      {"bos_token", eod},
                      {"eos_token", eod},
                      {"unk_token", nullptr},
                      {"pad_token", nullptr}};
  if (vocab_size == 257)
    j["added_tokens_decoder"] = {{"256",
                                  {{"content", byte_eod_token},
                                   {"single_word", false},
                                   {"lstrip", false},
                                   {"rstrip", false},
                                   {"normalized", false},
                                   {"special", true}}}};
  return j;
}

}  // namespace dsp::checkpoint
