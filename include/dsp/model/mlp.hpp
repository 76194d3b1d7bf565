#pragma once
// SwiGLU MLP (Shazeer 2020), tensor-parallel: fused [gate; up] column-parallel (each half
// split over TP), down projection row-parallel.
//   x [tokens, hidden] -> gate_up [tokens, 2 ffn/tp] -> silu(gate) * up [tokens, ffn/tp]
//   -> down_proj -> [tokens, hidden] (all-reduced)

#include "dsp/backend/host/swiglu.hpp"
#include "dsp/precision/activation_precision.hpp"
#include "dsp/tp/column_parallel_linear.hpp"
#include "dsp/tp/row_parallel_linear.hpp"
#include "dsp/tp/swiglu_spec.hpp"

namespace dsp::model {

template <class Policy>
class MLP {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;
  struct Saved {
    Tensor x, gate_up, act;
    precision::ActivationPrecision precision = precision::ActivationPrecision::Fp32;  ///< what gate_up and act are rounded to
    std::vector<Tensor*> tensors() { return {&x, &gate_up, &act}; }
  };

  /// Builds this TP rank's shards of `spec` (e.g. "model.layers.{i}.mlp": DecoderBlockSpec).
  MLP(Comm& tp, const tp::SwiGluSpec& spec, std::uint64_t seed)
      : gate_up_(tp, spec.gate_up.tensor, spec.gate_up.init, seed), down_(tp, spec.down.tensor, spec.down.init, seed) {}

  /// x [tokens, hidden] -> [tokens, hidden]. saved keeps x, gate_up and (unless keep_act is
  /// false: selective recomputation) the SwiGLU activation; gate_up and the activation are
  /// rounded to `precision` (precision/activation_precision.hpp).
  Tensor forward(const Tensor& x, Saved* saved, bool keep_act = true,
                 precision::ActivationPrecision precision = precision::ActivationPrecision::Fp32) {
    Tensor gu = gate_up_.forward(x);
    round_activations(Backend{}, precision, gu);
    const std::int64_t n = x.dim(0), f = gu.dim(1) / 2;
    Tensor act({n, f});
    swiglu_forward(Backend{}, gu.data(), n, f, act.data());
    round_activations(Backend{}, precision, act);
    Tensor y = down_.forward(act);
    if (saved) *saved = {x, std::move(gu), keep_act ? std::move(act) : Tensor{}, precision};
    return y;
  }
  /// dy [tokens, hidden] -> dx [tokens, hidden] (summed over TP); accumulates weight grads.
  Tensor backward(const Tensor& dy, const Saved& s) {
    Tensor recomputed;  // the activation when the forward did not keep it
    if (s.act.numel() == 0) {
      recomputed = Tensor({s.gate_up.dim(0), s.gate_up.dim(1) / 2});
      swiglu_forward(Backend{}, s.gate_up.data(), recomputed.dim(0), recomputed.dim(1), recomputed.data());
      round_activations(Backend{}, s.precision, recomputed);
    }
    const Tensor dact = down_.backward(s.act.numel() > 0 ? s.act : recomputed, dy);
    Tensor dgu(s.gate_up.shape());
    swiglu_backward(Backend{}, s.gate_up.data(), dact.data(), dact.dim(0), dact.dim(1), dgu.data());
    return gate_up_.backward(s.x, dgu);
  }

  std::vector<Parameter*> parameters() { return {&gate_up_.weight(), &down_.weight()}; }

 private:
  tp::ColumnParallelLinear<Policy> gate_up_;
  tp::RowParallelLinear<Policy> down_;
};

}  // namespace dsp::model
