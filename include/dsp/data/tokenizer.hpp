#pragma once
// Tokenizer: the tokenizer a program was told to use, as Megatron's --tokenizer-type and
// --tokenizer-model name it: ByteTokenizer (bytes and EOD 256; the default, no model file) or
// HuggingFaceTokenizer (a byte-level BPE tokenizer.json, data/bpe_tokenizer.hpp).
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/data/bpe_tokenizer.hpp"
#include "dsp/data/byte_tokenizer.hpp"

namespace dsp::data {

class Tokenizer {
 public:
  /// The byte tokenizer.
  Tokenizer() = default;
  /// type "ByteTokenizer" (model must be empty) or "HuggingFaceTokenizer" (model: the path of a
  /// tokenizer.json). Throws ConfigError naming the flags for another type or a missing or
  /// superfluous model, InputError (from BpeTokenizer) for a bad file.
  Tokenizer(const std::string& type, const std::string& model) {
    if (type == "ByteTokenizer") {
      DSP_CHECK_AS(ConfigError, model.empty(), "--tokenizer-type ByteTokenizer takes no --tokenizer-model (got '",
                   model, "')");
    } else if (type == "HuggingFaceTokenizer") {
      DSP_CHECK_AS(ConfigError, !model.empty(),
                   "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH (a tokenizer.json)");
      impl_ = BpeTokenizer::from_file(model);
    } else {
      DSP_CHECK_AS(ConfigError, false, "--tokenizer-type '", type,
                   "' is not supported: ByteTokenizer or HuggingFaceTokenizer");
    }
  }

  std::vector<std::int32_t> encode(std::string_view text) const {
    return std::visit([&](const auto& t) { return t.encode(text); }, impl_);
  }
  std::string decode(const std::vector<std::int32_t>& ids) const {
    return std::visit([&](const auto& t) { return t.decode(ids); }, impl_);
  }
  /// Number of ids (the model's --vocab-size must be at least this).
  std::int32_t vocab_size() const {
    return std::visit([](const auto& t) { return static_cast<std::int32_t>(t.vocab_size()); }, impl_);
  }
  /// The end-of-document id. Throws InputError when the tokenizer has none.
  std::int32_t eod() const {
    return std::visit([](const auto& t) { return static_cast<std::int32_t>(t.eod()); }, impl_);
  }

 private:
  std::variant<ByteTokenizer, BpeTokenizer> impl_;
};

}  // namespace dsp::data
