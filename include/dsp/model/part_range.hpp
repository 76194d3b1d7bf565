#pragma once
// PartRange: a contiguous range of the model's parts (model/parts.hpp): the decoder layers
// [first_layer, first_layer + num_layers), with the embedding before them when pre_process and
// the final norm and output layer after them when post_process (Megatron's GPTModel
// pre_process / post_process). The whole model is one range; a pipeline stage is another
// (pp/layer_split.hpp assigns ranges to stages).
#include <cstdint>

namespace dsp::model {

struct PartRange {
  std::int64_t first_layer = 0;
  std::int64_t num_layers = 0;
  bool pre_process = true;   ///< holds the input embedding (first stage)
  bool post_process = true;  ///< holds the final norm, output layer and loss (last stage)

  /// The whole model: every layer and both ends.
  static PartRange whole(std::int64_t num_layers) { return {0, num_layers, true, true}; }
  bool operator==(const PartRange&) const = default;
};

}  // namespace dsp::model
