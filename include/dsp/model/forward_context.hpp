#pragma once
// ForwardContext: the shape of the micro-batch a forward pass runs on, and where keys and
// values live when serving.
#include <cstdint>
#include <utility>
#include <vector>

#include "dsp/ep/moe_options.hpp"
#include "dsp/model/activation_precision.hpp"
#include "dsp/model/recompute.hpp"
#include "dsp/serve/kv_cache.hpp"

namespace dsp::model {

struct ForwardContext {
  std::int64_t batch = 1;                 ///< sequences in the micro-batch
  std::int64_t seq = 1;                   ///< tokens per sequence in this call
  std::vector<std::int32_t> positions;    ///< [batch * seq] position of each token in its sequence
  serve::KvCache* cache = nullptr;        ///< serving: keys/values are appended here and attended from here
  bool training = true;                   ///< keep activations for backward
  ep::MoeOptions moe;                     ///< capacity and balance loss of MoE layers (training)
  RecomputeConfig recompute;              ///< what a training forward keeps for backward
  bool recomputing = false;               ///< a forward re-run in backward: layers count nothing twice
  /// Training with mixed precision: the 16-bit type activations are rounded to and kept in.
  ActivationPrecision activations = ActivationPrecision::Fp32;

  std::int64_t tokens() const { return batch * seq; }

  /// Serving: batch rows of seq tokens at `positions`, keys and values in `cache`.
  static ForwardContext for_serving(std::int64_t batch, std::int64_t seq, std::vector<std::int32_t> positions,
                                    serve::KvCache* cache) {
    ForwardContext c;
    c.batch = batch;
    c.seq = seq;
    c.positions = std::move(positions);
    c.cache = cache;
    c.training = false;
    return c;
  }

  /// Training layout: batch rows of seq tokens at positions 0..seq-1.
  static ForwardContext for_training(std::int64_t batch, std::int64_t seq) {
    ForwardContext c;
    c.batch = batch;
    c.seq = seq;
    c.positions.resize(static_cast<std::size_t>(batch * seq));
    for (std::int64_t i = 0; i < batch * seq; ++i) c.positions[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i % seq);
    return c;
  }
};

}  // namespace dsp::model
