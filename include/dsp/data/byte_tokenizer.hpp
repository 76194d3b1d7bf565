#pragma once
// ByteTokenizer: one token per byte (id = byte value, 0 .. 255) and an end-of-document token
// EOD = 256, so 257 ids: what training on raw text uses, and what dsp-preprocess-data
// --tokenizer-type ByteTokenizer writes (--append-eod appends 256). Megatron's NullTokenizer
// places its EOD the same way, right after the vocabulary (eod = vocab size without it).
// Same interface as BpeTokenizer (encode, decode, vocab_size, token_id, eod).
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dsp/core/error.hpp"

namespace dsp::data {

class ByteTokenizer {
 public:
  /// Number of ids: 256 bytes and the EOD.
  static constexpr std::int32_t vocab_size() { return 257; }
  /// The end-of-document id: 256.
  static constexpr std::int32_t eod() { return 256; }

  /// One id per byte of `text` (any bytes; no UTF-8 check).
  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> ids(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }

  /// The bytes of `ids`; the EOD gives no byte. Throws InputError for an id outside [0, 257).
  std::string decode(const std::vector<std::int32_t>& ids) const {
    std::string out;
    out.reserve(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      DSP_CHECK_AS(InputError, ids[i] >= 0 && ids[i] < vocab_size(), "byte tokenizer: id ", ids[i], " at position ",
                   i, " is outside [0, ", vocab_size(), ")");
      if (ids[i] != eod()) out += static_cast<char>(ids[i]);
    }
    return out;
  }

  /// The id of a one-byte token. Throws InputError for any other length.
  std::int32_t token_id(std::string_view token) const {
    DSP_CHECK_AS(InputError, token.size() == 1, "byte tokenizer: token '", token,
                 "' is not a single byte (its vocabulary has only the 256 bytes and the EOD)");
    return static_cast<unsigned char>(token[0]);
  }
};

}  // namespace dsp::data
