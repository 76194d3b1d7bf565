#pragma once
// AdamW over this rank's parameter shards (no ZeRO partitioning yet: every data-parallel
// replica holds full moments for its shards; ZeroOptimizer stages come later).
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/backend/host/adamw.hpp"
#include "dsp/model/parameter.hpp"

namespace dsp::zero {

/// Hyper-parameters (Megatron names: --adam-beta1, --adam-beta2, --adam-eps, --weight-decay).
struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  ///< decoupled; not applied to 1-D parameters (norms)
};

template <class Backend>
class AdamW {
 public:
  AdamW(std::vector<model::Parameter*> params, AdamWConfig config) : params_(std::move(params)), config_(config) {
    for (auto* p : params_) {
      exp_avg_.emplace_back(p->value.shape(), memory::Category::OptimizerState);
      exp_avg_sq_.emplace_back(p->value.shape(), memory::Category::OptimizerState);
    }
  }

  /// One update of every parameter from its (already reduced and clipped) gradient.
  void step(float lr) {
    ++step_;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto* p = params_[i];
      adamw_update(Backend{}, p->value.numel(), p->value.data(), p->grad.data(), exp_avg_[i].data(),
                   exp_avg_sq_[i].data(), lr, config_.beta1, config_.beta2, config_.eps,
                   p->weight_decay ? config_.weight_decay : 0.0f, step_);
    }
  }

  /// Optimizer steps taken so far.
  std::int64_t steps() const { return step_; }
  void set_steps(std::int64_t s) { step_ = s; }
  const std::vector<model::Parameter*>& parameters() const { return params_; }
  /// First and second moments of parameter i (shape of its local shard; counted as
  /// memory::Category::OptimizerState).
  Tensor& exp_avg(std::size_t i) { return exp_avg_.at(i); }
  Tensor& exp_avg_sq(std::size_t i) { return exp_avg_sq_.at(i); }

 private:
  std::vector<model::Parameter*> params_;
  AdamWConfig config_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
  std::int64_t step_ = 0;
};

}  // namespace dsp::zero
