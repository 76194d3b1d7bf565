#pragma once
// TokenDataset: a text file read as bytes, one token per byte (vocabulary 256), split into
// training and validation parts (the last `validation_fraction` of the bytes is held out),
// each cut into non-overlapping windows of seq_length + 1 tokens (the samples).
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/data/sample_source.hpp"

namespace dsp::train {

class TokenDataset final : public data::SampleSource {
 public:
  /// Reads `path`. Throws InputError naming the file when it is a directory, missing,
  /// unreadable or too short to hold one sequence in each split.
  static TokenDataset from_file(const std::filesystem::path& path, std::int64_t seq_length,
                                double validation_fraction = 0.1) {
    std::error_code ec;
    DSP_CHECK_AS(InputError, !std::filesystem::is_directory(path, ec), "data path '", path.string(),
                 "' is a directory: --data-path takes a text file");
    std::ifstream in(path, std::ios::binary);
    DSP_CHECK_AS(InputError, in.good(), "data file '", path.string(), "' cannot be opened (missing?)");
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto n = static_cast<std::int64_t>(bytes.size());
    const auto n_val = static_cast<std::int64_t>(static_cast<double>(n) * validation_fraction);
    DSP_CHECK_AS(InputError, n - n_val > seq_length + 1 && n_val > seq_length + 1, "data file '", path.string(),
                 "' has ", n, " bytes: too short for sequences of ", seq_length, " tokens");
    TokenDataset d;
    d.seq_length_ = seq_length;
    for (std::int64_t i = 0; i < n; ++i)
      (i < n - n_val ? d.train_ : d.val_).push_back(static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]));
    return d;
  }

  /// Non-overlapping windows of seq_length + 1 tokens in a split.
  std::int64_t train_samples() const override { return windows(train_); }
  std::int64_t val_samples() const override { return windows(val_); }
  /// No: the sampler draws a permutation of the windows per epoch.
  bool in_training_order() const override { return false; }

  /// Inputs and targets ([windows.size() * seq] each) of the given windows of a split.
  void batch(bool validation, std::span<const std::int64_t> windows, std::vector<std::int32_t>& inputs,
             std::vector<std::int32_t>& targets) const override {
    const auto& src = validation ? val_ : train_;
    inputs.clear();
    targets.clear();
    for (auto w : windows) {
      const auto begin = src.begin() + w * seq_length_;
      inputs.insert(inputs.end(), begin, begin + seq_length_);
      targets.insert(targets.end(), begin + 1, begin + seq_length_ + 1);
    }
  }

  std::int64_t seq_length() const override { return seq_length_; }
  std::int64_t train_tokens() const { return static_cast<std::int64_t>(train_.size()); }
  std::int64_t val_tokens() const { return static_cast<std::int64_t>(val_.size()); }

 private:
  std::int64_t windows(const std::vector<std::int32_t>& s) const {
    return (static_cast<std::int64_t>(s.size()) - 1) / seq_length_;
  }
  std::int64_t seq_length_ = 0;
  std::vector<std::int32_t> train_, val_;
};

}  // namespace dsp::train
