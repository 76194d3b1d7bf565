#pragma once
// PipelineStage: what one pipeline rank runs for one (virtual) stage: the model restricted to
// the range of parts (layers, and the embedding / output layer at the ends) that
// pp/layer_split.hpp assigns to the stage. The model owns its parts (model::CausalLM); pp/
// only chooses the range.
#include "dsp/model/causal_lm.hpp"
#include "dsp/pp/layer_split.hpp"

namespace dsp::pp {

/// The model over one stage's layers: model::CausalLM(config, tp, StageLayers, seed, ep).
template <class Policy>
using PipelineStage = model::CausalLM<Policy>;

}  // namespace dsp::pp
