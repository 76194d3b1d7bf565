#pragma once
// PipelineConfig: how a model is laid over the pipeline ranks (Megatron flag names): the
// schedule, the virtual stages of interleaving, and the layers of each (virtual) stage.
#include <cstdint>
#include <string>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/pp/layer_split.hpp"

namespace dsp::pp {

struct PipelineConfig {
  /// --pipeline-schedule: "gpipe", "1f1b" or "interleaved"; empty: interleaved when
  /// num_layers_per_virtual_stage is set, else 1f1b.
  std::string schedule;
  /// --num-layers-per-virtual-pipeline-stage K: v = layers / (p x K) model chunks per rank
  /// (0: one chunk per rank).
  std::int64_t num_layers_per_virtual_stage = 0;
  /// Explicit layers per virtual stage (p x v counts, summing to the layer count); empty:
  /// even_layer_split.
  std::vector<std::int64_t> layer_split;

  /// The schedule name after defaults. Throws ConfigError when K < 0 or interleaving and the
  /// schedule disagree (interleaved without K, or K with gpipe/1f1b).
  std::string schedule_name() const {
    check_layers_per_virtual_stage();
    const std::string name = schedule.empty() ? (num_layers_per_virtual_stage > 0 ? "interleaved" : "1f1b") : schedule;
    DSP_CHECK_AS(ConfigError, (name == "interleaved") == (num_layers_per_virtual_stage > 0),
                 name == "interleaved"
                     ? "--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage"
                     : "--num-layers-per-virtual-pipeline-stage needs the interleaved schedule, not " + name);
    return name;
  }

  /// v: model chunks per pipeline rank. Throws ConfigError, naming the numbers, when K < 0,
  /// num_layers is not a multiple of p x K or v would be 1 (that is plain 1F1B).
  int virtual_size(std::int64_t num_layers, int p) const {
    check_layers_per_virtual_stage();
    if (num_layers_per_virtual_stage <= 0) return 1;
    const std::int64_t per_rank = p * num_layers_per_virtual_stage;
    DSP_CHECK_AS(ConfigError, num_layers % per_rank == 0, "number of layers (", num_layers,
                 ") is not divisible by pipeline-model-parallel-size x num-layers-per-virtual-pipeline-stage = ", p,
                 " x ", num_layers_per_virtual_stage, " = ", per_rank);
    const std::int64_t v = num_layers / per_rank;
    DSP_CHECK_AS(ConfigError, v >= 2, "num-layers-per-virtual-pipeline-stage ", num_layers_per_virtual_stage,
                 " gives one virtual stage per rank (", num_layers, " layers on ", p,
                 " ranks): use the 1f1b schedule");
    return static_cast<int>(v);
  }

  /// The layers of every virtual stage s = chunk * p + rank, in order. Throws ConfigError as
  /// virtual_size, even_layer_split and stage_layers, or when the explicit split does not
  /// have p x v entries.
  std::vector<StageLayers> stages(std::int64_t num_layers, int p) const {
    const int n = p * virtual_size(num_layers, p);
    if (layer_split.empty()) return stage_layers(even_layer_split(num_layers, n), num_layers);
    DSP_CHECK_AS(ConfigError, static_cast<int>(layer_split.size()) == n, "layer split has ", layer_split.size(),
                 " entries for ", n, " pipeline stages (pipeline size x virtual stages)");
    return stage_layers(layer_split, num_layers);
  }

 private:
  void check_layers_per_virtual_stage() const {
    DSP_CHECK_AS(ConfigError, num_layers_per_virtual_stage >= 0, "--num-layers-per-virtual-pipeline-stage must be >= 0, got ",
                 num_layers_per_virtual_stage);
  }
};

}  // namespace dsp::pp
