#pragma once
// GptDataset: Megatron's GPTDataset sample packing over an IndexedDataset. The sequences of a
// split (for GPT, Megatron's "documents" are the sequences of the .idx) are concatenated in a
// shuffled order, epoch after epoch, and sample j is the seq_length + 1 consecutive tokens
// starting at token j * seq_length of that stream: samples cross sequence boundaries, and the
// EOD token that preprocessing appends (--append-eod) marks where a document ended. The
// samples are then served in a shuffled order.
//
// Follows megatron-core's megatron/core/datasets/gpt_dataset.py (checked against 0.16.1)
// index for index:
//   _get_num_tokens_per_epoch, _get_num_epochs    epochs enough for num_samples
//   separate_final_epoch                          a last epoch needed for under 80% of its
//                                                 samples is shuffled apart from the others
//   _build_document_index                         the split's sequences tiled num_epochs times,
//                                                 shuffled together (not per epoch)
//   helpers.cpp build_sample_idx                  (document index position, offset) per sample
//   _build_shuffle_index                          a shuffle of the samples
//   _query_document_sample_shuffle_indices        the tokens of a sample, padded when short
// Randomness: numpy.random.RandomState(seed), reproduced exactly: RandomState seeds MT19937
// with init_genrand(seed) (std::mt19937(seed) does the same) and RandomState.shuffle is a
// Fisher-Yates shuffle drawing with numpy's legacy random_interval (masked rejection
// sampling); see detail::NumpyRandomState. So the same seed gives Megatron's samples, in
// Megatron's order. (Not dsp::CounterRng: matching Megatron bit for bit was the point.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/data/indexed_dataset.hpp"
#include "dsp/data/split.hpp"

namespace dsp::data {

namespace detail {

/// The draws of numpy.random.RandomState(seed) that Megatron's dataset code uses: shuffle of a
/// 1-D array (numpy/random/mtrand.pyx _shuffle_raw, distributions.c random_interval).
class NumpyRandomState {
 public:
  explicit NumpyRandomState(std::uint32_t seed) : mt_(seed) {}
  /// numpy's legacy random_interval: uniform in [0, max] by masked rejection.
  std::uint64_t random_interval(std::uint64_t max) {
    if (max == 0) return 0;
    std::uint64_t mask = max;
    for (int s = 1; s <= 32; s *= 2) mask |= mask >> s;
    std::uint64_t v;
    if (max <= 0xffffffffull) {
      do v = mt_() & mask; while (v > max);
    } else {
      do {
        const std::uint64_t hi = mt_();  // numpy's mt19937_next64: first draw is the high word
        v = ((hi << 32) | mt_()) & mask;
      } while (v > max);
    }
    return v;
  }
  /// RandomState.shuffle of a 1-D array: for i = n-1 ... 1, swap x[i] with x[random_interval(i)].
  template <class T>
  void shuffle(std::span<T> x) {
    for (std::size_t i = x.size(); i-- > 1;) std::swap(x[i], x[random_interval(i)]);
  }

 private:
  std::mt19937 mt_;
};

}  // namespace detail

/// What GPTDatasetConfig holds for the sample index (names as Megatron's).
struct GptDatasetConfig {
  std::int64_t seq_length = 0;              ///< tokens per sample, not counting the extra one
  std::optional<std::int64_t> num_samples;  ///< samples wanted; none: exactly one epoch's worth
  std::uint32_t seed = 1234;                ///< --seed (Megatron's random_seed default 1234)
  bool add_extra_token = true;              ///< samples of seq_length + 1 tokens (inputs and shifted labels)
  bool drop_last_partial_sequence = true;   ///< false: keep a last short sample, padded with pad_token
  /// Fills a short last sample (drop_last_partial_sequence false). Megatron pads with the
  /// tokenizer's pad id, or -1 (its _PAD_TOKEN_ID) when there is none or it collides with EOD;
  /// its __getitem__ then zeroes the loss mask where the label is the pad and maps pad inputs
  /// and labels to 0. That is the caller's job here: get() returns the padded text.
  std::int32_t pad_token = -1;
};

/// Samples of seq_length (+ 1) tokens packed from the sequences [range.begin, range.end) of an
/// IndexedDataset. The dataset is referenced, not copied: it must outlive this. Deterministic
/// given the config; sample i is the same on every rank and every run.
class GptDataset {
 public:
  /// Builds the document, sample and shuffle indices. Throws ConfigError when seq_length < 2
  /// (Megatron's build_sample_idx needs more than one) or the range is outside the dataset,
  /// and InputError naming the dataset when the range holds fewer than 2 tokens, or not enough
  /// for one sample.
  GptDataset(const IndexedDataset& dataset, SplitRange range, GptDatasetConfig config)
      : dataset_(&dataset), config_(config) {
    DSP_CHECK_AS(ConfigError, config.seq_length > 1, "GPT samples need seq_length > 1, not ", config.seq_length);
    DSP_CHECK_AS(ConfigError, config.seq_length <= std::numeric_limits<std::int32_t>::max() - 1,
                 "seq_length ", config.seq_length, " is over int32");
    DSP_CHECK_AS(ConfigError, 0 <= range.begin && range.begin <= range.end && range.end <= dataset.sequence_count(),
                 "sequence range [", range.begin, ", ", range.end, ") is outside '", dataset.prefix(), "' (",
                 dataset.sequence_count(), " sequences)");
    DSP_CHECK_AS(ConfigError, !config.num_samples || *config.num_samples >= 0, "num_samples ", *config.num_samples,
                 " is negative");
    const std::int64_t extra = config.add_extra_token ? 1 : 0;
    const std::int64_t seq = config.seq_length;
    for (std::int64_t i = range.begin; i < range.end; ++i) tokens_per_epoch_ += dataset.sequence_length(i);
    DSP_CHECK_AS(InputError, tokens_per_epoch_ > 1 && tokens_per_epoch_ - extra >= seq, "sequences [", range.begin,
                 ", ", range.end, ") of '", dataset.prefix(), "' hold ", tokens_per_epoch_,
                 " tokens: too few for one sample of ", seq + extra);

    // _get_num_epochs
    num_epochs_ = 1;
    if (config.num_samples) {
      const std::int64_t wanted = *config.num_samples * seq + extra;
      for (std::int64_t have = tokens_per_epoch_; have < wanted; have += tokens_per_epoch_) ++num_epochs_;
    }
    bool separate_final_epoch = false;
    std::int64_t samples_sans_final_epoch = 0;
    if (num_epochs_ > 1) {
      samples_sans_final_epoch = ((num_epochs_ - 1) * tokens_per_epoch_ - extra) / seq;
      const std::int64_t from_final = *config.num_samples - samples_sans_final_epoch;
      const std::int64_t per_epoch = (tokens_per_epoch_ - extra) / seq;
      separate_final_epoch = from_final < static_cast<std::int64_t>(0.80 * static_cast<double>(per_epoch));
    }

    detail::NumpyRandomState rng(config.seed);
    // _build_document_index
    const auto build_document_index = [&](std::int64_t epochs) {
      std::vector<std::int32_t> idx;
      idx.reserve(static_cast<std::size_t>(epochs * (range.end - range.begin)));
      for (std::int64_t e = 0; e < epochs; ++e)
        for (std::int64_t i = range.begin; i < range.end; ++i) idx.push_back(static_cast<std::int32_t>(i));
      rng.shuffle(std::span<std::int32_t>(idx));
      return idx;
    };
    if (!separate_final_epoch) {
      document_index_ = build_document_index(num_epochs_);
    } else {
      document_index_ = build_document_index(num_epochs_ - 1);
      const auto last = build_document_index(1);
      document_index_.insert(document_index_.end(), last.begin(), last.end());
    }

    build_sample_index();

    // _build_shuffle_index
    const auto total = static_cast<std::int64_t>(sample_index_.size() / 2) - 1;
    const std::int64_t first = separate_final_epoch ? samples_sans_final_epoch : total;
    shuffle_index_.resize(static_cast<std::size_t>(total));
    for (std::int64_t k = 0; k < total; ++k) shuffle_index_[static_cast<std::size_t>(k)] = k;
    rng.shuffle(std::span<std::int64_t>(shuffle_index_.data(), static_cast<std::size_t>(first)));
    if (first < total)
      rng.shuffle(std::span<std::int64_t>(shuffle_index_.data() + first, static_cast<std::size_t>(total - first)));
  }

  /// Number of samples (Megatron's len(GPTDataset): at least num_samples when given).
  std::int64_t size() const { return static_cast<std::int64_t>(shuffle_index_.size()); }
  /// Tokens per sample: seq_length + 1 with the extra token.
  std::int64_t sample_tokens() const { return config_.seq_length + (config_.add_extra_token ? 1 : 0); }

  /// Appends the sample_tokens() tokens of sample i to `out` (Megatron's text: inputs are the
  /// first seq_length, labels the last seq_length). Throws ConfigError when i is out of range.
  void get(std::int64_t i, std::vector<std::int32_t>& out) const {
    DSP_CHECK_AS(ConfigError, i >= 0 && i < size(), "GPT sample ", i, " out of range: ", size(), " samples");
    const std::int64_t extra = config_.add_extra_token ? 1 : 0;
    const auto s = static_cast<std::size_t>(shuffle_index_[static_cast<std::size_t>(i)]);
    const std::int64_t beg = sample_index_[2 * s], beg_off = sample_index_[2 * s + 1];
    const std::int64_t end = sample_index_[2 * s + 2], end_off = sample_index_[2 * s + 3];
    const auto start = out.size();
    if (beg == end) {
      dataset_->read(document_index_[static_cast<std::size_t>(beg)], out, beg_off, end_off - beg_off + extra);
    } else {
      for (std::int64_t k = beg; k <= end; ++k) {
        const std::int64_t off = k > beg ? 0 : beg_off;
        const std::int64_t len = k < end ? -1 : end_off + extra;
        dataset_->read(document_index_[static_cast<std::size_t>(k)], out, off, len);
      }
    }
    out.resize(start + static_cast<std::size_t>(sample_tokens()), config_.pad_token);  // only ever grows
  }
  /// Sample i as a new vector of sample_tokens() tokens (see the other get).
  std::vector<std::int32_t> get(std::int64_t i) const {
    std::vector<std::int32_t> out;
    get(i, out);
    return out;
  }

  /// The split's sequences in stream order, every one num_epochs() times.
  std::span<const std::int32_t> document_index() const { return document_index_; }
  /// Flattened [size() + 1][2]: (position in document_index, token offset) where each sample starts.
  std::span<const std::int64_t> sample_index() const { return sample_index_; }
  /// Sample order: get(i) is unshuffled sample shuffle_index()[i].
  std::span<const std::int64_t> shuffle_index() const { return shuffle_index_; }
  /// Epochs of the split's tokens that the samples need.
  std::int64_t num_epochs() const { return num_epochs_; }
  /// Tokens in the split's sequences.
  std::int64_t tokens_per_epoch() const { return tokens_per_epoch_; }
  const GptDatasetConfig& config() const { return config_; }

 private:
  // helpers.cpp build_sample_idx, statement for statement (including the int32 lengths).
  void build_sample_index() {
    const std::int32_t seq = static_cast<std::int32_t>(config_.seq_length);
    const std::int32_t extra = config_.add_extra_token ? 1 : 0;
    const std::int64_t stream = num_epochs_ * tokens_per_epoch_ - extra;
    const std::int64_t num_samples =
        config_.drop_last_partial_sequence
            ? stream / seq
            : static_cast<std::int64_t>(std::ceil(static_cast<float>(stream) / static_cast<float>(seq)));  // float, as Megatron
    sample_index_.assign(static_cast<std::size_t>(2 * (num_samples + 1)), 0);
    std::int64_t n = 0, doc = 0, doc_offset = 0;
    sample_index_[0] = doc;
    sample_index_[1] = doc_offset;
    ++n;
    const auto docs = static_cast<std::int64_t>(document_index_.size());
    const auto length = [&](std::int64_t k) {
      return std::int64_t{dataset_->sequence_length(document_index_[static_cast<std::size_t>(k)])};
    };
    while (n <= num_samples) {
      std::int64_t remaining = seq + extra;
      while (remaining != 0) {
        const std::int64_t doc_length = length(doc) - doc_offset;
        remaining -= doc_length;
        if (remaining <= 0) {
          doc_offset += remaining + doc_length - extra;
          remaining = 0;
        } else {
          if (doc == docs - 1) {  // the stream ran out: the last, partial sample ends here
            doc_offset = length(doc) - extra;
            break;
          }
          ++doc;
          doc_offset = 0;
        }
      }
      sample_index_[static_cast<std::size_t>(2 * n)] = doc;
      sample_index_[static_cast<std::size_t>(2 * n + 1)] = doc_offset;
      ++n;
    }
  }

  const IndexedDataset* dataset_;
  GptDatasetConfig config_;
  std::int64_t tokens_per_epoch_ = 0, num_epochs_ = 1;
  std::vector<std::int32_t> document_index_;
  std::vector<std::int64_t> sample_index_, shuffle_index_;
};

}  // namespace dsp::data
