#pragma once
// The tensors of a tensor-parallel SwiGLU feed-forward (Shazeer 2020) before they are
// allocated: the dense MLP (model::MLP), the shared experts and each routed expert
// (ep::GroupedExperts) all have these two.
//   gate_up  "{prefix}.gate_up_proj.weight" [2 ffn, hidden]: gate_proj | up_proj fused, each half
//            split by output rows over TP (column-parallel)
//   down     "{prefix}.down_proj.weight" [hidden, ffn]: split by input columns (row-parallel)
#include <cstdint>
#include <string>

#include "dsp/parallel/parameter.hpp"

namespace dsp::tp {

struct SwiGluSpec {
  ParameterSpec gate_up;
  ParameterSpec down;

  /// The SwiGLU of width `ffn` under `prefix` (e.g. "model.layers.3.mlp.experts.12"): gate/up
  /// drawn with init_std, down with down_std; expert marks both as a routed expert's
  /// (Parameter::expert).
  static SwiGluSpec describe(const std::string& prefix, std::int64_t hidden, std::int64_t ffn, float init_std,
                             float down_std, bool expert = false) {
    return {{ShardedTensor::gate_up(prefix + ".gate_up_proj.weight", hidden, ffn,
                                    {prefix + ".gate_proj.weight", prefix + ".up_proj.weight"}),
             {Init::Normal, init_std}, expert},
            {ShardedTensor::split(prefix + ".down_proj.weight", {hidden, ffn}, 1), {Init::Normal, down_std}, expert}};
  }
};

}  // namespace dsp::tp
