#pragma once
// ParallelLayout: how many ways each parallel axis splits the world.
#include <cstdint>
#include <string>

#include "dsp/core/error.hpp"

namespace dsp {

/// Degrees of the parallel axes (Megatron names: tensor / pipeline / data / expert model
/// parallel size). data == 0 means "whatever is left": world / (tensor x pipeline).
struct ParallelLayout {
  int tensor = 1;
  int pipeline = 1;
  int data = 0;
  int expert = 1;

  /// Returns the layout with `data` filled in for world_size ranks. Throws ConfigError,
  /// naming the numbers, when a degree is < 1 or the product does not equal the world size.
  ParallelLayout resolved(int world_size) const {
    DSP_CHECK_AS(ConfigError, tensor >= 1 && pipeline >= 1 && expert >= 1 && data >= 0,
                 "parallel sizes must be >= 1 (tensor=", tensor, ", pipeline=", pipeline, ", data=", data,
                 ", expert=", expert, ")");
    DSP_CHECK_AS(ConfigError, world_size >= 1, "world size must be >= 1, got ", world_size);
    const int mp = tensor * pipeline;
    DSP_CHECK_AS(ConfigError, world_size % mp == 0, "world size ", world_size,
                 " is not divisible by tensor-model-parallel-size x pipeline-model-parallel-size = ", tensor,
                 " x ", pipeline, " = ", mp);
    ParallelLayout out = *this;
    if (out.data == 0) out.data = world_size / mp;
    DSP_CHECK_AS(ConfigError, out.tensor * out.pipeline * out.data == world_size, "tensor (", tensor,
                 ") x pipeline (", pipeline, ") x data (", out.data, ") = ", mp * out.data,
                 " does not equal the world size ", world_size);
    DSP_CHECK_AS(ConfigError, out.data % expert == 0, "data-parallel size ", out.data,
                 " is not divisible by expert-model-parallel-size ", expert);
    return out;
  }
  int world_size() const { return tensor * pipeline * data; }
  std::string str() const {
    return "TP" + std::to_string(tensor) + "/PP" + std::to_string(pipeline) + "/DP" + std::to_string(data) +
           (expert > 1 ? "/EP" + std::to_string(expert) : "");
  }
  bool operator==(const ParallelLayout&) const = default;
};

/// Coordinates of one rank. Megatron order: tensor rank varies fastest, then data, then
/// pipeline: global = tp + TP * (dp + DP * pp).
struct RankCoord {
  int tp = 0, dp = 0, pp = 0;

  static RankCoord of(int global_rank, const ParallelLayout& l) {
    return {global_rank % l.tensor, (global_rank / l.tensor) % l.data, global_rank / (l.tensor * l.data)};
  }
  int global(const ParallelLayout& l) const { return tp + l.tensor * (dp + l.data * pp); }
};

}  // namespace dsp
