#pragma once
// BlendedGptData: the training and validation samples of Megatron's --data-path and --split,
// built as megatron-core's BlendedMegatronDatasetBuilder builds them for GPTDataset:
//   - every PREFIX of the blend is one IndexedDataset (PREFIX.bin + PREFIX.idx, mmap), split
//     into train / valid / test sequence ranges by --split (data/split.hpp);
//   - one PREFIX: the split's GptDataset asked for exactly the samples wanted;
//   - a blend "W1 P1 W2 P2 ...": dataset k is asked for ceil(ceil(wanted * w_k) * 1.005)
//     samples (samples_per_dataset) and blend sample i comes from the dataset and sample that
//     build_blending_indices gives (data/blended_dataset.hpp);
//   - samples are packed across documents (their EOD tokens mark the ends; data/gpt_dataset.hpp)
//     and already shuffled, so the trainer reads them in order (in_training_order()).
// The sample counts wanted are the caller's (dsp-train: --train-iters x --global-batch-size
// training samples, --eval-iters x --global-batch-size validation samples, as Megatron asks).
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/data/blended_dataset.hpp"
#include "dsp/data/gpt_dataset.hpp"
#include "dsp/data/indexed_dataset.hpp"
#include "dsp/data/sample_source.hpp"
#include "dsp/data/split.hpp"

namespace dsp::data {

/// What BlendedGptData is built from (Megatron's flag in each comment).
struct GptDataConfig {
  std::vector<BlendEntry> blend;     ///< --data-path (parse_data_path)
  std::string split = "969,30,1";    ///< --split
  std::int64_t seq_length = 0;       ///< --seq-length
  std::uint32_t seed = 1234;         ///< --seed
  std::int64_t train_samples = 0;    ///< training samples wanted (>= 1)
  std::int64_t valid_samples = 0;    ///< validation samples wanted (>= 1)
  std::int64_t vocab_size = 0;       ///< token ids must be in [0, vocab_size) (--vocab-size)
};

class BlendedGptData final : public SampleSource {
 public:
  /// Opens every prefix and builds the train and validation samples. Throws ConfigError when
  /// the blend is empty, the weights or --split are malformed (naming them), the split gives the
  /// validation or training part no weight, or a count is below 1; InputError naming the files
  /// of a prefix that is missing or malformed, or whose part holds too few tokens for one sample.
  explicit BlendedGptData(const GptDataConfig& c) : config_(c) {
    DSP_CHECK_AS(ConfigError, !c.blend.empty(), "--data-path names no dataset");
    DSP_CHECK_AS(ConfigError, c.train_samples >= 1 && c.valid_samples >= 1, "training and validation need >= 1 ",
                 "sample each, got ", c.train_samples, " and ", c.valid_samples);
    DSP_CHECK_AS(ConfigError, c.vocab_size >= 1, "vocab_size must be >= 1, got ", c.vocab_size);
    const auto split = parse_and_normalize_split(c.split);
    std::vector<double> given;
    for (const auto& e : c.blend) given.push_back(e.weight);
    weights_ = normalize_weights(given);
    for (const auto& e : c.blend) indexed_.push_back(std::make_unique<IndexedDataset>(e.prefix));
    parts_[0] = build(Split::train, split, c.train_samples);
    parts_[1] = build(Split::valid, split, c.valid_samples);
  }

  std::int64_t seq_length() const override { return config_.seq_length; }
  std::int64_t train_samples() const override { return parts_[0].size; }
  std::int64_t val_samples() const override { return parts_[1].size; }
  /// Yes: GptDataset shuffles its samples (with --seed), as Megatron's does.
  bool in_training_order() const override { return true; }

  /// Inputs = the first seq_length tokens of each sample, targets = the last seq_length.
  /// Throws ConfigError for a sample out of range, InputError naming the prefix for a token
  /// outside [0, vocab_size).
  void batch(bool validation, std::span<const std::int64_t> samples, std::vector<std::int32_t>& inputs,
             std::vector<std::int32_t>& targets) const override {
    const auto seq = static_cast<std::size_t>(config_.seq_length);
    inputs.clear();
    targets.clear();
    std::vector<std::int32_t> text;
    for (const std::int64_t i : samples) {
      const auto [k, j] = locate(validation, i);
      text.clear();
      parts_[validation ? 1 : 0].datasets[static_cast<std::size_t>(k)]->get(j, text);
      for (const std::int32_t t : text)
        DSP_CHECK_AS(InputError, t >= 0 && t < config_.vocab_size, "dataset '", indexed_[static_cast<std::size_t>(k)]->prefix(),
                     "' holds token id ", t, ", outside the vocabulary [0, ", config_.vocab_size,
                     ") (--vocab-size; the tokenizer that wrote it has more ids?)");
      inputs.insert(inputs.end(), text.begin(), text.begin() + static_cast<std::ptrdiff_t>(seq));
      targets.insert(targets.end(), text.begin() + 1, text.begin() + 1 + static_cast<std::ptrdiff_t>(seq));
    }
  }

  /// Which dataset of the blend (index into config().blend) training or validation sample i
  /// comes from. Throws ConfigError when i is out of range.
  int dataset_of(bool validation, std::int64_t i) const { return locate(validation, i).first; }
  /// The per-dataset GptDataset of a split (k indexes config().blend).
  const GptDataset& dataset(bool validation, std::size_t k) const { return *parts_[validation ? 1 : 0].datasets.at(k); }
  const GptDataConfig& config() const { return config_; }

 private:
  struct Part {
    std::vector<std::unique_ptr<GptDataset>> datasets;  // one per prefix
    std::optional<BlendingIndices> blending;             // with several prefixes
    std::int64_t size = 0;
  };

  // Sample i of a split as (dataset k of the blend, sample j of its GptDataset). Throws
  // ConfigError when i is out of range.
  std::pair<int, std::int64_t> locate(bool validation, std::int64_t i) const {
    const Part& part = parts_[validation ? 1 : 0];
    DSP_CHECK_AS(ConfigError, i >= 0 && i < part.size, validation ? "validation" : "training", " sample ", i,
                 " out of range: ", part.size, " samples");
    return part.blending ? (*part.blending)[static_cast<std::size_t>(i)] : std::pair<int, std::int64_t>{0, i};
  }

  Part build(Split s, const std::array<double, 3>& split, std::int64_t wanted) const {
    const char* name = s == Split::train ? "training" : "validation";
    Part part;
    part.size = wanted;
    const bool blended = indexed_.size() > 1;
    const std::vector<std::int64_t> per_dataset =
        blended ? samples_per_dataset(weights_, wanted) : std::vector<std::int64_t>{wanted};
    for (std::size_t k = 0; k < indexed_.size(); ++k) {
      const IndexedDataset& ds = *indexed_[k];
      const auto range = split_ranges(split, ds.sequence_count())[static_cast<int>(s)];
      DSP_CHECK_AS(ConfigError, range.has_value(), "--split '", config_.split, "' gives the ", name,
                   " part no weight; dsp-train needs training and validation samples");
      GptDatasetConfig gc;
      gc.seq_length = config_.seq_length;
      gc.num_samples = per_dataset[k];
      gc.seed = config_.seed;
      part.datasets.push_back(std::make_unique<GptDataset>(ds, *range, gc));
    }
    if (blended) part.blending = build_blending_indices(weights_, wanted);
    return part;
  }

  GptDataConfig config_;
  std::vector<double> weights_;
  std::vector<std::unique_ptr<IndexedDataset>> indexed_;
  Part parts_[2];
};

}  // namespace dsp::data
