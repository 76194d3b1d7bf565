#pragma once
// ColumnParallelLinear (Megatron-LM, Shoeybi et al. 2019, section 3): Y = X W^T with W
// [out, in] split along `out` over the TP group, so each rank computes Y's columns
// [tokens, out/tp]. Its input enters the TP region with copy_to_tp_region (backward:
// all-reduce of dX). No bias (DeepSeek and Llama projections have none).
#include <memory>

#include "dsp/backend/linear.hpp"
#include "dsp/parallel/parameter.hpp"
#include "dsp/tp/mappings.hpp"

namespace dsp::tp {

template <class Policy>
class ColumnParallelLinear {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;

  /// Owns a weight described by `spec` (split along dim 0: Split, Vocab, Qkv or GateUp),
  /// initialised as dsp::Parameter does. gather_output: forward returns the full
  /// [tokens, out] (padding included) instead of this rank's columns.
  ColumnParallelLinear(Comm& tp, ShardedTensor spec, Init init, std::uint64_t seed, bool gather_output = false)
      : tp_(&tp),
        owned_(std::make_unique<Parameter>(std::move(spec), init, seed, tp.size(), tp.rank())),
        weight_(owned_.get()),
        gather_output_(gather_output) {}
  /// Uses an existing parameter of shape [out/tp, in] (tied input/output embeddings).
  ColumnParallelLinear(Comm& tp, Parameter& shared, bool gather_output = false)
      : tp_(&tp), weight_(&shared), gather_output_(gather_output) {}

  /// x [tokens, in] (same on every TP rank) -> [tokens, out/tp], or [tokens, out_padded]
  /// with gather_output.
  Tensor forward(Tensor x) const {
    CopyToTpRegion::forward(*tp_, x);
    Tensor y({x.dim(0), out_local()});
    linear_forward(Backend{}, x.data(), weight_->value.data(), y.data(), x.dim(0), in(), out_local());
    if (gather_output_) return GatherFromTpRegion<Backend>::forward(*tp_, y);
    return y;
  }

  /// Given the forward input x [tokens, in] and dy (shaped like forward's output), adds
  /// dW += dy^T x to the weight's gradient and returns dx [tokens, in], summed over TP.
  Tensor backward(const Tensor& x, const Tensor& dy) {
    const Tensor dy_local = gather_output_ ? GatherFromTpRegion<Backend>::backward(*tp_, dy) : dy;
    linear_backward_weight(Backend{}, dy_local.data(), x.data(), weight_->grad.data(), x.dim(0), in(), out_local());
    Tensor dx({x.dim(0), in()});
    linear_backward_input(Backend{}, dy_local.data(), weight_->value.data(), dx.data(), x.dim(0), in(), out_local());
    CopyToTpRegion::backward(*tp_, dx);
    return dx;
  }

  Parameter& weight() { return *weight_; }
  const Parameter& weight() const { return *weight_; }
  std::int64_t in() const { return weight_->value.dim(1); }
  std::int64_t out_local() const { return weight_->value.dim(0); }

 private:
  Comm* tp_;
  std::unique_ptr<Parameter> owned_;
  Parameter* weight_;
  bool gather_output_;
};

}  // namespace dsp::tp
