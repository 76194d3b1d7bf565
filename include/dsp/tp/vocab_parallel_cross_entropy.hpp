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

  /// What backward needs, per micro-batch: row max and sum of exp over the whole vocabulary
  /// [tokens], where the logits are (the current memory space).
  struct Saved {
    Tensor max, sum_exp;
  };

  /// Per-token loss [tokens] in nats (0 where target < 0, "ignore"), on the host; the same on
  /// every TP rank. The [tokens] statistics are reduced where the logits are, then copied to
  /// the host for the loss.
  std::vector<float> forward(const Tensor& logits, const std::vector<std::int32_t>& targets, Saved& saved) const {
    const std::int64_t n = logits.dim(0), cols = logits.dim(1), offset = cols * tp_->rank();
    const std::int64_t valid = valid_columns(cols);
    saved.max = Tensor({n});
    saved.sum_exp = Tensor({n});
    Tensor target_logit({n});
    row_max(Backend{}, logits.data(), n, cols, valid, saved.max.data());
    tp_->all_reduce(saved.max.raw_span(), comm::ReduceOp::Max);
    row_sum_exp(Backend{}, logits.data(), n, cols, valid, saved.max.data(), saved.sum_exp.data());
    gather_target_logit(Backend{}, logits.data(), SpaceArray<std::int32_t>(targets).data(), n, cols, offset,
                        target_logit.data());
    tp_->all_reduce(saved.sum_exp.raw_span());
    tp_->all_reduce(target_logit.raw_span());
    const Tensor max = saved.max.to_host(), sum_exp = saved.sum_exp.to_host(), z = target_logit.to_host();
    std::vector<float> loss(static_cast<std::size_t>(n));
    for (std::size_t t = 0; t < loss.size(); ++t) {
      const auto i = static_cast<std::int64_t>(t);
      loss[t] = targets[t] < 0 ? 0.0f : std::log(sum_exp[i]) + max[i] - z[i];
    }
    return loss;
  }

  /// dloss [tokens] -> dlogits, shaped like forward's logits (this rank's columns); dloss is
  /// where the logits are.
  Tensor backward(const Tensor& logits, const std::vector<std::int32_t>& targets, const Tensor& dloss,
                  const Saved& saved) const {
    const std::int64_t n = logits.dim(0), cols = logits.dim(1);
    Tensor dlogits(logits.shape());
    cross_entropy_backward(Backend{}, logits.data(), SpaceArray<std::int32_t>(targets).data(), n, cols,
                           valid_columns(cols), cols * tp_->rank(), saved.max.data(), saved.sum_exp.data(),
                           dloss.data(), dlogits.data());
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
