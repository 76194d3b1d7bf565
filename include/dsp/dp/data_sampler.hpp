#pragma once
// DataSampler: which training samples each data-parallel rank reads in each micro-batch.
// A sample is a window of seq_length + 1 tokens (inputs and next-token targets); windows do
// not overlap. Each epoch is a fresh permutation of all windows, drawn from the counter RNG
// keyed by (seed, epoch), so it is the same for every layout. A global batch takes the next
// global_batch_size windows of the permutation; a global batch never straddles two epochs
// (the remainder is dropped), so within an epoch no window is read twice and every DP rank
// gets the same number of micro-batches: micro-batch m of DP rank r holds windows
// [(m * dp + r) * micro, (m * dp + r + 1) * micro) of the global batch. Without shuffling (a
// source whose samples are in training order already, as Megatron's GPT samples) the
// "permutation" is 0, 1, 2, ...: Megatron's MegatronPretrainingSampler.
#include <cstdint>
#include <numeric>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/core/error.hpp"
#include "dsp/core/rng.hpp"

namespace dsp::dp {

/// Megatron's batch rule: global batch = micro batch x data-parallel size x accumulation steps.
/// Throws ConfigError naming the three numbers when micro_batch x dp_size does not divide
/// global_batch (sizes below 1 are the caller's to check).
inline void check_global_batch(std::int64_t micro_batch, std::int64_t global_batch, std::int64_t dp_size) {
  DSP_CHECK_AS(ConfigError, micro_batch >= 1 && dp_size >= 1 && global_batch % (micro_batch * dp_size) == 0,
               "global batch size (", global_batch, ") is not divisible by micro batch size x data-parallel size = ",
               micro_batch, " x ", dp_size, " = ", micro_batch * dp_size);
}

class DataSampler {
 public:
  /// Position in the sample stream (saved in checkpoints for an exact resume).
  struct State {
    std::int64_t epoch = 0;
    std::int64_t offset = 0;  ///< windows consumed in this epoch
    NLOHMANN_DEFINE_TYPE_INTRUSIVE(State, epoch, offset)
  };

  /// num_windows: windows in the data set. Throws ConfigError, naming the numbers, when a batch
  /// size or dp_size is not positive, dp_rank is outside [0, dp_size), global_batch is not
  /// micro_batch x dp x k, or the data holds fewer windows than one global batch. shuffle false:
  /// every epoch reads the windows in order.
  DataSampler(std::int64_t num_windows, std::int64_t micro_batch, std::int64_t global_batch, int dp_size, int dp_rank,
              std::uint64_t seed, bool shuffle = true)
      : num_windows_(num_windows), micro_(micro_batch), global_(global_batch), dp_size_(dp_size), dp_rank_(dp_rank),
        seed_(seed), shuffle_(shuffle) {
    DSP_CHECK_AS(ConfigError, micro_batch >= 1, "micro batch size must be >= 1, got ", micro_batch);
    DSP_CHECK_AS(ConfigError, global_batch >= 1, "global batch size must be >= 1, got ", global_batch);
    DSP_CHECK_AS(ConfigError, dp_size >= 1 && dp_rank >= 0 && dp_rank < dp_size, "data-parallel rank ", dp_rank,
                 " of size ", dp_size, ": the size must be >= 1 and the rank in [0, size)");
    check_global_batch(micro_batch, global_batch, dp_size);
    accumulation_ = global_batch / (micro_batch * dp_size);
    DSP_CHECK_AS(ConfigError, num_windows >= global_batch, "the data holds ", num_windows,
                 " sequences, fewer than one global batch of ", global_batch);
    permute();
  }

  /// Gradient-accumulation steps (micro-batches per DP rank per optimizer step).
  std::int64_t accumulation_steps() const { return accumulation_; }

  /// Window indices of this rank's micro-batches for the next global batch, then advances.
  std::vector<std::vector<std::int64_t>> next_global_batch() {
    if (state_.offset + global_ > num_windows_) {
      ++state_.epoch;
      state_.offset = 0;
      permute();
    }
    std::vector<std::vector<std::int64_t>> micro_batches(static_cast<std::size_t>(accumulation_));
    for (std::int64_t m = 0; m < accumulation_; ++m)
      for (std::int64_t j = 0; j < micro_; ++j)
        micro_batches[static_cast<std::size_t>(m)].push_back(
            perm_[static_cast<std::size_t>(state_.offset + (m * dp_size_ + dp_rank_) * micro_ + j)]);
    state_.offset += global_;
    return micro_batches;
  }

  const State& state() const { return state_; }
  void set_state(const State& s) {
    state_ = s;
    permute();
  }

 private:
  // Fisher-Yates shuffle driven by CounterRng(seed, "data.epoch.<e>") (none without shuffle_).
  void permute() {
    perm_.resize(static_cast<std::size_t>(num_windows_));
    std::iota(perm_.begin(), perm_.end(), std::int64_t{0});
    if (!shuffle_) return;
    const CounterRng rng(seed_, "data.epoch." + std::to_string(state_.epoch));
    for (std::int64_t i = num_windows_ - 1; i > 0; --i) {
      const auto j = static_cast<std::int64_t>(rng.uniform(static_cast<std::uint64_t>(i)) * static_cast<double>(i + 1));
      std::swap(perm_[static_cast<std::size_t>(i)], perm_[static_cast<std::size_t>(j)]);
    }
  }

  std::int64_t num_windows_, micro_, global_;
  int dp_size_, dp_rank_;
  std::uint64_t seed_;
  bool shuffle_;
  std::int64_t accumulation_ = 1;
  State state_;
  std::vector<std::int64_t> perm_;
};

}  // namespace dsp::dp
