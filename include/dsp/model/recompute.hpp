#pragma once
// Activation recomputation (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
// Cost"; Megatron-LM's flags and Korthikanti et al. 2022, "Reducing Activation Recomputation in
// Large Transformer Models", section 4): keep less of the forward for backward and recompute it.
//   selective: the attention core's softmax probabilities [batch, heads, seq, seq] and the
//              SwiGLU activation [tokens, ffn] (dense and expert MLPs) are not kept; backward
//              recomputes them from the kept q, k, v and gate/up projections. With
//              --use-flash-attn no probabilities are kept anyway (model/config.hpp).
//   full:      a group of decoder layers keeps only its input; backward re-runs the group's
//              forward, then its backward. uniform: the stage's layers in consecutive groups of
//              num_layers; block: each of the stage's first num_layers layers alone, the rest
//              keep everything.
// The recomputed forward is the same arithmetic on the same inputs, so gradients are bitwise
// those without recomputation.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "dsp/core/error.hpp"

namespace dsp::model {

enum class RecomputeGranularity { None, Selective, Full };
enum class RecomputeMethod { Uniform, Block };

/// --recompute-granularity, --recompute-method, --recompute-num-layers (Megatron names).
struct RecomputeConfig {
  RecomputeGranularity granularity = RecomputeGranularity::None;
  RecomputeMethod method = RecomputeMethod::Uniform;
  std::int64_t num_layers = 1;  ///< layers per group (uniform) or recomputed layers per stage (block)

  bool selective() const { return granularity == RecomputeGranularity::Selective; }

  /// With full recomputation, the group [first, end) of a stage's local layer `layer` (of
  /// `layers`) whose input is kept and whose forward backward re-runs; nullopt when the layer
  /// keeps its activations.
  std::optional<std::pair<std::int64_t, std::int64_t>> group(std::int64_t layer, std::int64_t layers) const {
    if (granularity != RecomputeGranularity::Full) return std::nullopt;
    if (method == RecomputeMethod::Block) {
      if (layer >= num_layers) return std::nullopt;
      return std::pair{layer, layer + 1};
    }
    const std::int64_t first = layer / num_layers * num_layers;
    return std::pair{first, std::min(first + num_layers, layers)};
  }

  /// Throws ConfigError unless num_layers >= 1.
  void validate() const {
    DSP_CHECK_AS(ConfigError, num_layers >= 1, "--recompute-num-layers must be >= 1, got ", num_layers);
  }

  /// From the flag values: granularity "none" | "selective" | "full", method "uniform" |
  /// "block". Throws ConfigError naming a bad value.
  static RecomputeConfig from_names(const std::string& granularity, const std::string& method,
                                    std::int64_t num_layers) {
    RecomputeConfig c;
    if (granularity == "selective") c.granularity = RecomputeGranularity::Selective;
    else if (granularity == "full") c.granularity = RecomputeGranularity::Full;
    else DSP_CHECK_AS(ConfigError, granularity == "none", "--recompute-granularity must be none, selective or full, got '", granularity, "'");
    if (method == "block") c.method = RecomputeMethod::Block;
    else DSP_CHECK_AS(ConfigError, method == "uniform", "--recompute-method must be uniform or block, got '", method, "'");
    c.num_layers = num_layers;
    c.validate();
    return c;
  }
};

}  // namespace dsp::model
