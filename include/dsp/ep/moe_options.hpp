#pragma once
// Training-time settings of the MoE layers (Megatron flag names), carried by every forward
// context: capacity and dropping, and the auxiliary balance loss. Serving ignores them
// (dropless, no loss).
#include "dsp/ep/capacity.hpp"

namespace dsp::ep {

struct MoeOptions {
  /// --moe-expert-capacity-factor: each expert takes at most ceil(factor x tokens x k / E)
  /// assignments of a micro-batch on a rank (ep::expert_capacity); <= 0: dropless. Must be
  /// finite (the Trainer throws ConfigError otherwise).
  float capacity_factor = 0.0f;
  /// --moe-token-drop-policy: which assignments an over-full expert keeps.
  DropPolicy drop_policy = DropPolicy::Probability;
  /// --moe-aux-loss-coeff: alpha of the sequence-wise balance loss (0: none).
  float aux_loss_coeff = 0.0f;
  /// d(objective) / d(this micro-batch's aux loss): its sequences' share of the global batch
  /// (micro batch / global batch), so the loss is a mean over all sequences of the step.
  float aux_loss_scale = 1.0f;
  /// The dynamic loss scale the backward runs at (train::TrainConfig::loss_scaler; 1 without):
  /// multiplies the aux loss's gradient like the main loss's, not the aux loss reported.
  float loss_scale = 1.0f;
};

}  // namespace dsp::ep
