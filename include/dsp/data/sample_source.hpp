#pragma once
// SampleSource: what the trainer reads its data through. A sample is seq_length + 1
// consecutive tokens: the first seq_length are the inputs, the last seq_length the
// next-token targets. Training samples are numbered 0 .. train_samples() - 1, validation
// samples 0 .. val_samples() - 1. Implementations: train::TokenDataset (a text file, one token
// per byte, cut into windows) and data::BlendedGptData (Megatron's indexed datasets, split and
// blended, samples packed across documents).
#include <cstdint>
#include <span>
#include <vector>

namespace dsp::data {

class SampleSource {
 public:
  virtual ~SampleSource() = default;
  /// Tokens per sample, not counting the extra target token.
  virtual std::int64_t seq_length() const = 0;
  /// Samples of the training split.
  virtual std::int64_t train_samples() const = 0;
  /// Samples of the validation split.
  virtual std::int64_t val_samples() const = 0;
  /// Whether the training samples are already in training order (Megatron's GPT samples are
  /// shuffled by the dataset): the sampler then reads them in order, 0, 1, 2, ..., instead of
  /// drawing a permutation per epoch.
  virtual bool in_training_order() const = 0;
  /// Replaces inputs and targets with the samples' ([samples.size() * seq_length] each, sample
  /// after sample) of the validation or training split. Throws InputError naming the file for a
  /// token the source cannot give (e.g. an id outside the vocabulary).
  virtual void batch(bool validation, std::span<const std::int64_t> samples, std::vector<std::int32_t>& inputs,
                     std::vector<std::int32_t>& targets) const = 0;
};

}  // namespace dsp::data
