#pragma once
// Which of the model's parts (global decoder layers) each (virtual) pipeline stage holds: the
// assignment of parts to stages. Stages hold contiguous, ordered ranges that together cover
// layers 0..L-1 exactly once; the first stage also holds the embedding, the last one the final
// norm and the output layer (Megatron's pre_process / post_process).
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/model/part_range.hpp"

namespace dsp::pp {

/// One stage's part of the model: the parts of layers [first_layer, first_layer + num_layers),
/// with the embedding on the first stage and the output layer on the last.
using StageLayers = model::PartRange;

/// Layers per stage for `num_layers` over `stages` stages, as even as possible: with
/// L = q * S + r, stages 0..r-1 get q + 1 layers and the others q (so 30 layers on 4 stages
/// give 8, 8, 7, 7; the extra layers go to the early stages, away from the last stage, which
/// also holds the output layer and loss). Throws ConfigError when stages < 1 or
/// num_layers < stages (a stage would hold no layer; give an explicit split for that).
inline std::vector<std::int64_t> even_layer_split(std::int64_t num_layers, int stages) {
  DSP_CHECK_AS(ConfigError, stages >= 1, "pipeline stages must be >= 1, got ", stages);
  DSP_CHECK_AS(ConfigError, num_layers >= stages, "number of layers (", num_layers,
               ") is smaller than the number of pipeline stages (", stages,
               "): every stage needs a layer, or give an explicit layer split");
  const std::int64_t q = num_layers / stages, r = num_layers % stages;
  std::vector<std::int64_t> counts(static_cast<std::size_t>(stages), q);
  for (std::int64_t s = 0; s < r; ++s) ++counts[static_cast<std::size_t>(s)];
  return counts;
}

/// The stages of a split: stage s holds counts[s] layers starting after those of stages
/// 0..s-1. An explicit split may give a stage zero layers (it then holds only the embedding or
/// the output layer, or nothing). Throws ConfigError when the split has no stage, a count is
/// negative, or the counts do not sum to num_layers (naming both numbers): a layer is never
/// silently dropped or added.
inline std::vector<StageLayers> stage_layers(const std::vector<std::int64_t>& counts, std::int64_t num_layers) {
  DSP_CHECK_AS(ConfigError, !counts.empty(), "a layer split needs at least one stage");
  std::string listed;
  for (auto c : counts) {
    DSP_CHECK_AS(ConfigError, c >= 0, "a layer split cannot give a stage ", c, " layers");
    if (!listed.empty()) listed += ',';
    listed += std::to_string(c);
  }
  const std::int64_t sum = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
  DSP_CHECK_AS(ConfigError, sum == num_layers, "layer split ", listed, " sums to ", sum,
               " layers, but the model has ", num_layers);
  std::vector<StageLayers> out;
  std::int64_t first = 0;
  for (std::size_t s = 0; s < counts.size(); ++s) {
    out.push_back({first, counts[s], s == 0, s + 1 == counts.size()});
    first += counts[s];
  }
  return out;
}

}  // namespace dsp::pp
