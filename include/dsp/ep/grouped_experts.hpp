#pragma once
// GroupedExperts: a rank's SwiGLU experts run over contiguous blocks of rows, one GEMM pair per
// expert (a grouped GEMM). Each expert is split over the tensor-parallel group as the dense
// MLP is (gate/up by output rows, down by input columns), but no collective runs here: the
// output is this TP rank's partial sum, reduced once per MoE layer by its caller.
//   rows [n_e, hidden] -> gate_up [n_e, 2 f/tp] -> silu(gate) * up [n_e, f/tp] -> [n_e, hidden] (partial over TP)
// Hugging Face names: "{prefix}.gate_proj.weight", "{prefix}.up_proj.weight" (fused here as
// "{prefix}.gate_up_proj.weight" with those parts) and "{prefix}.down_proj.weight".
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dsp/backend/linear.hpp"
#include "dsp/backend/host/swiglu.hpp"
#include "dsp/core/error.hpp"
#include "dsp/precision/activation_precision.hpp"
#include "dsp/parallel/parameter.hpp"
#include "dsp/tp/swiglu_spec.hpp"

namespace dsp::ep {

template <class Backend>
class GroupedExperts {
 public:
  struct Saved {
    Tensor x, gate_up, act;
    std::vector<std::int64_t> rows;  ///< [experts] rows of each block
    precision::ActivationPrecision precision = precision::ActivationPrecision::Fp32;  ///< of gate_up and act
    std::vector<Tensor*> tensors() { return {&x, &gate_up, &act}; }
  };

  /// One SwiGLU expert per spec (tp::SwiGluSpec::describe, e.g. "model.layers.3.mlp.experts.12"),
  /// all of width ffn and `hidden` wide, this rank's shard of tp_size (flags such as
  /// Parameter::expert from the specs). Throws ConfigError when ffn does not split over tp_size.
  GroupedExperts(const std::vector<tp::SwiGluSpec>& experts, std::int64_t hidden, std::uint64_t seed, int tp_size,
                 int tp_rank)
      : hidden_(hidden) {
    for (const auto& e : experts) {
      gate_up_.push_back(std::make_unique<Parameter>(e.gate_up, seed, tp_size, tp_rank));
      down_.push_back(std::make_unique<Parameter>(e.down, seed, tp_size, tp_rank));
    }
    ffn_local_ = gate_up_.empty() ? 0 : gate_up_.front()->value.dim(0) / 2;
  }

  std::int64_t num_experts() const { return static_cast<std::int64_t>(gate_up_.size()); }

  /// x [sum rows, hidden], expert e on the rows[e] rows after those of experts < e ->
  /// [sum rows, hidden], this TP rank's partial output. saved may be null (inference); it
  /// keeps x, gate_up and, unless keep_act is false (selective recomputation), the SwiGLU
  /// activation, both rounded to `precision` (precision/activation_precision.hpp). Throws Error when
  /// rows does not match the experts or x.
  Tensor forward(const Tensor& x, const std::vector<std::int64_t>& rows, Saved* saved, bool keep_act = true,
                 precision::ActivationPrecision precision = precision::ActivationPrecision::Fp32) const {
    check(x, rows);
    const std::int64_t n = x.dim(0), f = ffn_local_;
    Tensor gu({n, 2 * f}), act({n, f}), y({n, hidden_});
    std::int64_t r0 = 0;
    for (std::size_t e = 0; e < rows.size(); r0 += rows[e], ++e) {
      if (rows[e] == 0) continue;
      linear_forward(Backend{}, x.data() + r0 * hidden_, gate_up_[e]->value.data(), gu.data() + r0 * 2 * f, rows[e],
                     hidden_, 2 * f);
      precision::round_activations(Backend{}, precision, gu.data() + r0 * 2 * f, rows[e] * 2 * f);
      swiglu_forward(Backend{}, gu.data() + r0 * 2 * f, rows[e], f, act.data() + r0 * f);
      precision::round_activations(Backend{}, precision, act.data() + r0 * f, rows[e] * f);
      linear_forward(Backend{}, act.data() + r0 * f, down_[e]->value.data(), y.data() + r0 * hidden_, rows[e], f,
                     hidden_);
    }
    if (saved) *saved = {x, std::move(gu), keep_act ? std::move(act) : Tensor{}, rows, precision};
    return y;
  }

  /// dy [sum rows, hidden] (the full output gradient, the same on every TP rank) -> dx [sum
  /// rows, hidden], this TP rank's partial input gradient; accumulates the weight gradients.
  Tensor backward(const Tensor& dy, const Saved& s) {
    const std::int64_t n = dy.dim(0), f = ffn_local_;
    Tensor recomputed;  // the activation when the forward did not keep it
    if (s.act.numel() == 0 && n > 0) {
      recomputed = Tensor({n, f});
      swiglu_forward(Backend{}, s.gate_up.data(), n, f, recomputed.data());
      precision::round_activations(Backend{}, s.precision, recomputed);
    }
    const Tensor& act = s.act.numel() > 0 ? s.act : recomputed;
    Tensor dact({n, f}), dgu({n, 2 * f}), dx({n, hidden_});
    std::int64_t r0 = 0;
    for (std::size_t e = 0; e < s.rows.size(); r0 += s.rows[e], ++e) {
      const std::int64_t m = s.rows[e];
      if (m == 0) continue;
      linear_backward_weight(Backend{}, dy.data() + r0 * hidden_, act.data() + r0 * f, down_[e]->grad.data(), m, f,
                             hidden_);
      linear_backward_input(Backend{}, dy.data() + r0 * hidden_, down_[e]->value.data(), dact.data() + r0 * f, m, f,
                            hidden_);
      swiglu_backward(Backend{}, s.gate_up.data() + r0 * 2 * f, dact.data() + r0 * f, m, f, dgu.data() + r0 * 2 * f);
      linear_backward_weight(Backend{}, dgu.data() + r0 * 2 * f, s.x.data() + r0 * hidden_, gate_up_[e]->grad.data(),
                             m, hidden_, 2 * f);
      linear_backward_input(Backend{}, dgu.data() + r0 * 2 * f, gate_up_[e]->value.data(), dx.data() + r0 * hidden_, m,
                            hidden_, 2 * f);
    }
    return dx;
  }

  /// Every expert's gate/up then down weight, expert by expert.
  std::vector<Parameter*> parameters() {
    std::vector<Parameter*> p;
    for (std::size_t e = 0; e < gate_up_.size(); ++e) {
      p.push_back(gate_up_[e].get());
      p.push_back(down_[e].get());
    }
    return p;
  }

 private:
  void check(const Tensor& x, const std::vector<std::int64_t>& rows) const {
    std::int64_t total = 0;
    for (auto r : rows) total += r;
    DSP_CHECK(static_cast<std::int64_t>(rows.size()) == num_experts() && x.rank() == 2 && x.dim(0) == total &&
                  x.dim(1) == hidden_,
              "grouped experts: input ", shape_str(x.shape()), " with ", rows.size(), " row blocks summing to ", total,
              " does not fit ", num_experts(), " experts of hidden size ", hidden_);
  }

  std::int64_t hidden_, ffn_local_ = 0;
  std::vector<std::unique_ptr<Parameter>> gate_up_, down_;
};

}  // namespace dsp::ep
