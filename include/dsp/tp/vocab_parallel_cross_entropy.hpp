#pragma once
// Cross-entropy over logits split by vocabulary across the TP group (Megatron-LM's
// vocab_parallel_cross_entropy): three all-reduces of [tokens] vectors (max, sum of exp,
// target logit) instead of gathering [tokens, vocab]. Padding columns (vocab rounded up to
// a multiple of TP) never contribute to the max, the sum or the gradient.
//   loss_t = log(sum_j exp(z_tj - m_t)) + m_t - z_t,target
//   dz_tj  = (softmax_tj - [j == target_t]) * dloss_t
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "dsp/backend/host/cross_entropy.hpp"
#include "dsp/comm/communicator.hpp"
#include "dsp/core/tensor.hpp"

namespace dsp::tp {

template <class Policy>
class VocabParallelCrossEntropy {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;

  /// vocab: real vocabulary size; logits on each rank are [tokens, vocab_padded / tp].
  VocabParallelCrossEntropy(Comm& tp, std::int64_t vocab) : tp_(&tp), vocab_(vocab) {}

  /// What backward needs, per micro-batch: row max and sum of exp over the whole vocabulary.
  struct Saved {
    std::vector<float> max, sum_exp;
  };

  /// Per-token loss [tokens] in nats (0 where target < 0, "ignore"); the same on every TP
  /// rank.
  std::vector<float> forward(const Tensor& logits, const std::vector<std::int32_t>& targets, Saved& saved) const {
    const std::int64_t n = logits.dim(0), cols = logits.dim(1), offset = cols * tp_->rank();
    const std::int64_t valid = valid_columns(cols);
    auto& max = saved.max;
    auto& sum_exp = saved.sum_exp;
    max.assign(static_cast<std::size_t>(n), 0.0f);
    sum_exp.assign(static_cast<std::size_t>(n), 0.0f);
    std::vector<float> target_logit(static_cast<std::size_t>(n));
    row_max(Backend{}, logits.data(), n, cols, valid, max.data());
    tp_->all_reduce(std::span(max), comm::ReduceOp::Max);
    row_sum_exp(Backend{}, logits.data(), n, cols, valid, max.data(), sum_exp.data());
    gather_target_logit(Backend{}, logits.data(), targets.data(), n, cols, offset, target_logit.data());
    tp_->all_reduce(std::span(sum_exp));
    tp_->all_reduce(std::span(target_logit));
    std::vector<float> loss(static_cast<std::size_t>(n));
    for (std::size_t t = 0; t < loss.size(); ++t)
      loss[t] = targets[t] < 0 ? 0.0f : std::log(sum_exp[t]) + max[t] - target_logit[t];
    return loss;
  }

  /// dloss [tokens] -> dlogits, shaped like forward's logits (this rank's columns).
  Tensor backward(const Tensor& logits, const std::vector<std::int32_t>& targets, std::span<const float> dloss,
                  const Saved& saved) const {
    const std::int64_t n = logits.dim(0), cols = logits.dim(1);
    Tensor dlogits(logits.shape());
    cross_entropy_backward(Backend{}, logits.data(), targets.data(), n, cols, valid_columns(cols), cols * tp_->rank(),
                           saved.max.data(), saved.sum_exp.data(), dloss.data(), dlogits.data());
    return dlogits;
  }

  /// Columns of this rank's logits that are real vocabulary (the rest is padding).
  std::int64_t valid_columns(std::int64_t cols) const {
    return std::clamp<std::int64_t>(vocab_ - cols * tp_->rank(), 0, cols);
  }

 private:
  Comm* tp_;
  std::int64_t vocab_;
};

}  // namespace dsp::tp
