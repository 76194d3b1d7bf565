#pragma once
// Text of dsp's byte-level models (the demo's tokenizer): token id = byte value.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dsp::serve {

/// One token per byte: the byte's value in [0, 256).
inline std::vector<std::int32_t> encode_bytes(std::string_view text) {
  std::vector<std::int32_t> ids;
  ids.reserve(text.size());
  for (char c : text) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

/// Inverse of encode_bytes; ids outside [0, 256) (vocabulary padding, other tokenizers)
/// become '?'.
inline std::string decode_bytes(const std::vector<std::int32_t>& ids) {
  std::string text;
  text.reserve(ids.size());
  for (auto id : ids) text.push_back(id >= 0 && id < 256 ? static_cast<char>(static_cast<unsigned char>(id)) : '?');
  return text;
}

/// The bytes of token `id`: one byte for ids below 256, nothing for others (an EOD id, say).
inline std::string byte_token_text(std::int32_t id) {
  return id >= 0 && id < 256 ? std::string(1, static_cast<char>(static_cast<unsigned char>(id))) : std::string();
}

}  // namespace dsp::serve
