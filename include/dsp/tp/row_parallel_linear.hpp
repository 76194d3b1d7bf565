#pragma once
// RowParallelLinear (Megatron-LM, Shoeybi et al. 2019, section 3): Y = X W^T with W
// [out, in] split along `in`; each rank multiplies its input columns [tokens, in/tp] and
// the partial results are summed with reduce_from_tp_region (one all-reduce). Paired after
// a ColumnParallelLinear, a whole MLP or attention block costs one all-reduce forward and
// one backward.
#include <memory>

#include "dsp/backend/linear.hpp"
#include "dsp/parallel/parameter.hpp"
#include "dsp/tp/mappings.hpp"

namespace dsp::tp {

template <class Policy>
class RowParallelLinear {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;

  /// spec: a Split tensor of global [out, in] with split_dim 1. input_is_parallel: the input
  /// already is this rank's [tokens, in/tp] (the output of a ColumnParallelLinear); else the
  /// input is the full [tokens, in] and is scattered first.
  RowParallelLinear(Comm& tp, ShardedTensor spec, Init init, std::uint64_t seed, bool input_is_parallel = true)
      : tp_(&tp),
        weight_(std::move(spec), init, seed, tp.size(), tp.rank()),
        input_is_parallel_(input_is_parallel) {}

  /// x [tokens, in/tp] (or [tokens, in]) -> y [tokens, out], the same on every TP rank.
  Tensor forward(const Tensor& x) const {
    const Tensor x_local = input_is_parallel_ ? x : ScatterToTpRegion<Backend>::forward(*tp_, x);
    Tensor y({x.dim(0), out()});
    linear_forward(Backend{}, x_local.data(), weight_.value.data(), y.data(), x.dim(0), in_local(), out());
    ReduceFromTpRegion::forward(*tp_, y);
    return y;
  }

  /// Given forward's input x and dy [tokens, out], adds dW += dy^T x_local and returns dx
  /// shaped like x.
  Tensor backward(const Tensor& x, Tensor dy) {
    ReduceFromTpRegion::backward(*tp_, dy);
    const Tensor x_local = input_is_parallel_ ? x : ScatterToTpRegion<Backend>::forward(*tp_, x);
    linear_backward_weight(Backend{}, dy.data(), x_local.data(), weight_.grad.data(), x.dim(0), in_local(), out());
    Tensor dx({x.dim(0), in_local()});
    linear_backward_input(Backend{}, dy.data(), weight_.value.data(), dx.data(), x.dim(0), in_local(), out());
    if (input_is_parallel_) return dx;
    return ScatterToTpRegion<Backend>::backward(*tp_, dx);
  }

  Parameter& weight() { return weight_; }
  const Parameter& weight() const { return weight_; }
  std::int64_t out() const { return weight_.value.dim(0); }
  std::int64_t in_local() const { return weight_.value.dim(1); }

 private:
  Comm* tp_;
  Parameter weight_;
  bool input_is_parallel_;
};

}  // namespace dsp::tp
