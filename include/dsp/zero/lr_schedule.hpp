#pragma once
// Learning-rate schedule: linear warmup, then cosine decay to min_lr (Megatron's
// --lr-decay-style cosine; Loshchilov & Hutter 2017). Evaluated once per optimizer step.
#include <cmath>
#include <cstdint>
#include <numbers>

namespace dsp::zero {

struct WarmupCosine {
  float max_lr = 3e-4f;
  float min_lr = 3e-5f;
  std::int64_t warmup_iters = 0;
  std::int64_t decay_iters = 1;  ///< steps from 0 to the end of the decay (>= warmup)

  /// Learning rate of optimizer step `step` (0-based).
  float operator()(std::int64_t step) const {
    if (step < warmup_iters) return max_lr * static_cast<float>(step + 1) / static_cast<float>(warmup_iters);
    if (step >= decay_iters) return min_lr;
    const double progress =
        static_cast<double>(step - warmup_iters) / static_cast<double>(std::max<std::int64_t>(1, decay_iters - warmup_iters));
    return min_lr + static_cast<float>(0.5 * (1.0 + std::cos(std::numbers::pi * progress))) * (max_lr - min_lr);
  }
};

}  // namespace dsp::zero
