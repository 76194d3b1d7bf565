#pragma once
// Megatron's dataset blending (--data-path 0.3 A 0.7 B): the weights are normalised and every
// sample of the blend is given to one dataset by Megatron's greedy rule, so that after any
// prefix of samples each dataset's count is within about one sample of weight * samples.
// Follows megatron-core (checked against 0.16.1):
//   helpers.cpp build_blending_indices    the greedy rule (below), ties to the lowest index
//   utils.py normalize                    w / sum(w)
//   utils.py get_blend_from_list          "PREFIX" alone or "W1 P1 W2 P2 ..." pairs
//   blended_megatron_dataset_builder.py _get_size_per_split_per_dataset
//                                         ceil(ceil(target * w) * (1 + 0.005)) samples asked
//                                         of each dataset, a margin so none runs short
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dsp/core/error.hpp"

namespace dsp::data {

/// One dataset of a blend: its weight (as given, not normalised) and its path prefix.
struct BlendEntry {
  double weight = 1.0;
  std::string prefix;
  bool operator==(const BlendEntry&) const = default;
};

/// Parses the words of --data-path: one PREFIX (weight 1) or pairs "WEIGHT PREFIX ...".
/// Throws ConfigError naming the words when there are none, an odd number of several, or a
/// weight is not a finite non-negative number. (Megatron also reads several prefixes without
/// weights as a size-proportional blend; that form is refused here.)
inline std::vector<BlendEntry> parse_data_path(const std::vector<std::string>& words) {
  std::string all;
  for (const auto& w : words) all += (all.empty() ? "" : " ") + w;
  DSP_CHECK_AS(ConfigError, !words.empty(), "--data-path is empty: give PREFIX or WEIGHT PREFIX pairs");
  if (words.size() == 1) return {BlendEntry{1.0, words[0]}};
  DSP_CHECK_AS(ConfigError, words.size() % 2 == 0, "--data-path '", all, "' has ", words.size(),
               " words: several datasets are given as WEIGHT PREFIX pairs");
  std::vector<BlendEntry> out;
  for (std::size_t k = 0; k < words.size(); k += 2) {
    const std::string& w = words[k];
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(w.c_str(), &end);
    DSP_CHECK_AS(ConfigError, !w.empty() && end == w.c_str() + w.size() && errno == 0 && std::isfinite(v) && v >= 0,
                 "--data-path '", all, "': weight '", w, "' (before '", words[k + 1],
                 "') is not a non-negative number");
    out.push_back({v, words[k + 1]});
  }
  return out;
}

/// Weights divided by their sum. Throws ConfigError when there are none, one is negative or
/// not finite, or all are 0.
inline std::vector<double> normalize_weights(std::span<const double> weights) {
  DSP_CHECK_AS(ConfigError, !weights.empty(), "a blend needs at least one weight");
  double sum = 0;
  for (std::size_t k = 0; k < weights.size(); ++k) {
    DSP_CHECK_AS(ConfigError, std::isfinite(weights[k]) && weights[k] >= 0, "blend weight ", k, " (", weights[k],
                 ") is not a finite non-negative number");
    sum += weights[k];  // numpy.sum is pairwise beyond 8 terms: equal for the few of a blend
  }
  DSP_CHECK_AS(ConfigError, sum > 0, "blend weights are all 0");
  std::vector<double> out(weights.begin(), weights.end());
  for (auto& w : out) w /= sum;
  return out;
}

/// Which dataset serves each sample of a blend, and which of that dataset's samples.
struct BlendingIndices {
  std::vector<std::int16_t> dataset_index;         ///< [size]: the dataset of blend sample i
  std::vector<std::int64_t> dataset_sample_index;  ///< [size]: its sample within that dataset
  /// Blend sample i as (dataset, sample in it); no range check.
  std::pair<int, std::int64_t> operator[](std::size_t i) const { return {dataset_index[i], dataset_sample_index[i]}; }
  std::size_t size() const { return dataset_index.size(); }
};

/// Megatron's build_blending_indices: for blend sample i, the dataset k with the largest
/// weight[k] * max(i, 1) - count[k] (the lowest k among equals) gets it, as its sample
/// count[k], and count[k] grows by 1. (Megatron's target is weight * max(i, 1), not
/// weight * (i + 1); the two differ by one sample's worth and this one is Megatron's.)
/// `weights` should be normalised (normalize_weights); size >= 0. Throws ConfigError when
/// there are no weights, more than 32767 (the int16 index), or size is negative.
inline BlendingIndices build_blending_indices(std::span<const double> weights, std::int64_t size) {
  DSP_CHECK_AS(ConfigError, !weights.empty() && weights.size() <= std::numeric_limits<std::int16_t>::max(),
               "a blend has 1 to 32767 datasets, not ", weights.size());
  DSP_CHECK_AS(ConfigError, size >= 0, "a blend of ", size, " samples");
  BlendingIndices out;
  out.dataset_index.resize(static_cast<std::size_t>(size));
  out.dataset_sample_index.resize(static_cast<std::size_t>(size));
  std::vector<std::int64_t> count(weights.size(), 0);
  for (std::int64_t i = 0; i < size; ++i) {
    const double at = std::max(static_cast<double>(i), 1.0);
    std::size_t best = 0;
    double best_error = weights[0] * at - static_cast<double>(count[0]);
    for (std::size_t k = 1; k < weights.size(); ++k) {
      const double error = weights[k] * at - static_cast<double>(count[k]);
      if (error > best_error) {
        best_error = error;
        best = k;
      }
    }
    out.dataset_index[static_cast<std::size_t>(i)] = static_cast<std::int16_t>(best);
    out.dataset_sample_index[static_cast<std::size_t>(i)] = count[best]++;
  }
  return out;
}

/// Samples to ask of each dataset for a blend of `target` samples:
/// ceil(ceil(target * w) * (1 + surplus)) per normalised weight w (Megatron's margin 0.005).
inline std::vector<std::int64_t> samples_per_dataset(std::span<const double> weights, std::int64_t target,
                                                     double surplus = 0.005) {
  std::vector<std::int64_t> out;
  for (double w : weights)
    out.push_back(static_cast<std::int64_t>(std::ceil(std::ceil(static_cast<double>(target) * w) * (1.0 + surplus))));
  return out;
}

}  // namespace dsp::data
