#pragma once
// RMSNorm layer (Zhang & Sennrich 2019) with a replicated weight [hidden].
#include <string>

#include "dsp/backend/host/rms_norm.hpp"
#include "dsp/parallel/parameter.hpp"

namespace dsp::model {

template <class Policy>
class RMSNorm {
 public:
  using Backend = typename Policy::Backend;
  struct Saved {
    Tensor x;
    Tensor rstd;  ///< [tokens]
    /// The activations (rstd is an fp32 statistic).
    std::vector<Tensor*> tensors() { return {&x}; }
  };

  /// weight: a replicated [hidden] (DecoderBlockSpec::norm); every TP rank holds all of it.
  RMSNorm(const ParameterSpec& weight, float eps, int tp_size, int tp_rank)
      : weight_(weight, 0, tp_size, tp_rank), eps_(eps) {}

  /// x [tokens, hidden] -> y [tokens, hidden]; saved (may be null when not training).
  Tensor forward(const Tensor& x, Saved* saved) const {
    Tensor y(x.shape());
    Tensor rstd({x.dim(0)});
    rms_norm_forward(Backend{}, x.data(), weight_.value.data(), eps_, x.dim(0), x.dim(1), y.data(), rstd.data());
    if (saved) *saved = {x, std::move(rstd)};
    return y;
  }
  /// dy [tokens, hidden] -> dx; accumulates the weight gradient.
  Tensor backward(const Tensor& dy, const Saved& s) {
    Tensor dx(dy.shape());
    rms_norm_backward(Backend{}, s.x.data(), weight_.value.data(), s.rstd.data(), dy.data(), dy.dim(0), dy.dim(1),
                      dx.data(), weight_.grad.data());
    return dx;
  }
  Parameter& weight() { return weight_; }

 private:
  Parameter weight_;
  float eps_;
};

}  // namespace dsp::model
