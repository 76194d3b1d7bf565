#pragma once
// Global gradient-norm clipping (Pascanu et al. 2013) over tensor-parallel shards. Each
// global element counts once: replicated parameters only on TP rank 0, K/V heads replicated
// across TP ranks only on the first rank holding them (ShardedTensor::owned); a tied
// embedding held by two pipeline stages only on the first; a routed expert (held by one rank
// of each expert-parallel group) once, by summing the experts' part over that group.
#include <algorithm>
#include <cmath>
#include <vector>

#include "dsp/backend/host/elementwise.hpp"
#include "dsp/comm/communicator.hpp"
#include "dsp/model/parameter.hpp"

namespace dsp::zero {

template <class Backend>
class GradClipper {
 public:
  /// params: this rank's shards; tp_size/tp_rank: its place in the tensor-parallel group.
  /// A tied copy (Parameter::tied_copy) is scaled but left out of the norm: its owner
  /// counts it.
  GradClipper(std::vector<model::Parameter*> params, int tp_size, int tp_rank) : params_(std::move(params)) {
    for (auto* p : params_) {
      auto w = ownership_weights(p->spec, tp_size, tp_rank);
      const bool all_owned = std::all_of(w.begin(), w.end(), [](float x) { return x == 1.0f; });
      weights_.push_back(all_owned ? std::vector<float>{} : std::move(w));
    }
  }

  /// L2 norm of the global gradient: sum of squares of owned elements, the routed experts'
  /// (Parameter::expert) summed over the expert-parallel group `ep` (null: EP 1), then all
  /// summed over the model-parallel group `mp` (collective over both). Gradients must already
  /// be reduced over data parallelism.
  template <comm::Communicator Comm>
  float global_norm(Comm& mp, Comm* ep = nullptr) const {
    std::vector<double> sq{0.0, 0.0};  // fp64 sums of squares (others, experts), summed in fp64
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (!params_[i]->tied_copy)
        sq[params_[i]->expert ? 1 : 0] += sum_squares(Backend{}, params_[i]->grad.numel(), params_[i]->grad.data(),
                                                      weights_[i].empty() ? nullptr : weights_[i].data());
    if (ep && ep->size() > 1) ep->all_reduce(std::span(sq).subspan(1));
    sq[0] += sq[1];
    mp.all_reduce(std::span(sq).first(1));
    return static_cast<float>(std::sqrt(sq[0]));
  }

  /// Scales every gradient by max_norm / norm when norm > max_norm (max_norm <= 0: never).
  /// Returns the norm before clipping (global_norm(mp, ep)).
  template <comm::Communicator Comm>
  float clip(Comm& mp, float max_norm, Comm* ep = nullptr) const {
    const float norm = global_norm(mp, ep);
    if (max_norm > 0.0f && norm > max_norm) {
      const float s = max_norm / (norm + 1e-6f);
      for (auto* p : params_) scale(Backend{}, p->grad.numel(), s, p->grad.data());
    }
    return norm;
  }

 private:
  std::vector<model::Parameter*> params_;
  std::vector<std::vector<float>> weights_;
};

}  // namespace dsp::zero
