#pragma once
// Dynamic loss scaling for fp16 training (Micikevicius et al., "Mixed Precision Training",
// ICLR 2018, section 3.2): the loss is multiplied by `scale` before backward so that small
// gradients survive fp16; the gradients are divided by it (inv_scale) before the optimizer.
// When any rank's scaled gradients hold inf or NaN the step is skipped and the scale backs
// off; after `growth_interval` clean steps it grows.
//
// The update rule is Megatron-LM's DynamicGradScaler (megatron/core/optimizer/grad_scaler.py):
//   overflow:  growth_tracker = 0; hysteresis_tracker -= 1;
//              if hysteresis_tracker <= 0: scale = max(scale * backoff_factor, min_scale)
//   clean:     growth_tracker += 1;
//              if growth_tracker == growth_interval: growth_tracker = 0;
//                 hysteresis_tracker = hysteresis; scale = scale * growth_factor
// The hysteresis tracker is restored only when the scale grows, not on a clean step: two
// overflows with clean steps between them still back off, and once it reaches 0 every
// further overflow backs off until the next growth. Megatron has no upper bound; dsp adds
// `max_scale` (scale = min(scale * growth_factor, max_scale)). The default initial_scale
// (2^16) is ColossalAI's DynamicGradScaler's
// (colossalai/amp/naive_amp/grad_scaler/dynamic_grad_scaler.py); max_scale's 2^24 is dsp's own
// cap (that class has none by default); Megatron passes the factors
// as constants (growth 2, backoff 0.5; megatron/core/optimizer/__init__.py). The scale and
// its products are fp32, as Megatron's scale tensor.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include <nlohmann/json.hpp>

#include "dsp/comm/communicator.hpp"
#include "dsp/comm/reduce_op.hpp"
#include "dsp/core/error.hpp"

namespace dsp::precision {

/// Settings of DynamicLossScaler (Megatron flag names where Megatron has the setting).
struct LossScalerConfig {
  /// --initial-loss-scale: scale of the first step (unitless multiplier of the loss). Default
  /// 2^16 (ColossalAI); Megatron's default is 2^32.
  float initial_scale = 65536.0f;
  /// --min-loss-scale: the scale never backs off below this. Default 1 (Megatron).
  float min_scale = 1.0f;
  /// --max-loss-scale: the scale never grows above this (finite). Default 2^24 (dsp's choice;
  /// Megatron has no bound).
  float max_scale = 16777216.0f;
  /// --loss-scale-growth-factor: multiplier on growth, > 1. Default 2 (Megatron's constant).
  float growth_factor = 2.0f;
  /// --loss-scale-backoff-factor: multiplier on backoff, in (0, 1). Default 0.5 (Megatron's
  /// constant).
  float backoff_factor = 0.5f;
  /// --loss-scale-window: clean (overflow-free) steps in a row before the scale grows.
  /// Default 1000 (Megatron).
  std::int64_t growth_interval = 1000;
  /// --hysteresis: overflows, counted since the last growth, before the scale backs off.
  /// Default 2 (Megatron).
  int hysteresis = 2;

  /// Throws ConfigError naming the flag and the value unless initial_scale is finite and > 0,
  /// 0 < min_scale <= max_scale with max_scale finite, min_scale <= initial_scale <=
  /// max_scale, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1 and
  /// hysteresis >= 1.
  void validate() const {
    DSP_CHECK_AS(ConfigError, std::isfinite(initial_scale) && initial_scale > 0.0f,
                 "--initial-loss-scale must be finite and > 0, got ", initial_scale);
    DSP_CHECK_AS(ConfigError, min_scale > 0.0f, "--min-loss-scale must be > 0, got ", min_scale);
    DSP_CHECK_AS(ConfigError, std::isfinite(max_scale) && min_scale <= max_scale, "--min-loss-scale (", min_scale,
                 ") must be <= --max-loss-scale (", max_scale, "), which must be finite");
    DSP_CHECK_AS(ConfigError, min_scale <= initial_scale && initial_scale <= max_scale, "--initial-loss-scale (",
                 initial_scale, ") must be in [--min-loss-scale, --max-loss-scale] = [", min_scale, ", ", max_scale,
                 "]");
    DSP_CHECK_AS(ConfigError, growth_factor > 1.0f, "--loss-scale-growth-factor must be > 1, got ", growth_factor);
    DSP_CHECK_AS(ConfigError, backoff_factor > 0.0f && backoff_factor < 1.0f,
                 "--loss-scale-backoff-factor must be in (0, 1), got ", backoff_factor);
    DSP_CHECK_AS(ConfigError, growth_interval >= 1, "--loss-scale-window must be >= 1 step, got ", growth_interval);
    DSP_CHECK_AS(ConfigError, hysteresis >= 1, "--hysteresis must be >= 1, got ", hysteresis);
  }
};

/// Megatron-LM's DynamicGradScaler (see the file comment), with an upper bound. One per
/// rank; every rank must feed it the same found_inf (any_rank) so that the scales agree.
class DynamicLossScaler {
 public:
  /// Scaler state (saved in checkpoints for an exact resume).
  struct State {
    float scale = 1.0f;                  ///< current loss scale
    std::int64_t growth_tracker = 0;     ///< clean steps since the last overflow or growth
    int hysteresis_tracker = 1;          ///< overflows left before backoff (may go below 0)
    std::int64_t skipped_steps = 0;      ///< update(true) calls so far
    NLOHMANN_DEFINE_TYPE_INTRUSIVE(State, scale, growth_tracker, hysteresis_tracker, skipped_steps)
  };

  /// Starts at config.initial_scale with growth_tracker 0 and hysteresis_tracker
  /// config.hysteresis (Megatron). Throws ConfigError as LossScalerConfig::validate.
  explicit DynamicLossScaler(LossScalerConfig config) : config_(config) {
    config_.validate();
    state_ = {.scale = config_.initial_scale,
              .growth_tracker = 0,
              .hysteresis_tracker = config_.hysteresis,
              .skipped_steps = 0};
  }

  /// Advances the state after one step; found_inf: the (all-rank) overflow flag of this step's
  /// gradients, whose optimizer step the caller skips. Rules in the file comment. The growth
  /// test is growth_tracker >= growth_interval (Megatron: ==; the same whenever the tracker
  /// starts below the interval, and it also grows a state restored under a smaller
  /// --loss-scale-window).
  void update(bool found_inf) {
    if (found_inf) {
      ++state_.skipped_steps;
      state_.growth_tracker = 0;
      state_.hysteresis_tracker -= 1;
      if (state_.hysteresis_tracker <= 0)
        state_.scale = std::max(state_.scale * config_.backoff_factor, config_.min_scale);
    } else {
      state_.growth_tracker += 1;
      if (state_.growth_tracker >= config_.growth_interval) {
        state_.growth_tracker = 0;
        state_.hysteresis_tracker = config_.hysteresis;
        state_.scale = std::min(state_.scale * config_.growth_factor, config_.max_scale);
      }
    }
  }

  /// Current loss scale (multiply the loss by it before backward).
  float scale() const { return state_.scale; }
  /// 1 / scale, computed in fp64 and rounded to fp32 (Megatron's inv_scale); multiply the
  /// gradients by it before the optimizer.
  float inv_scale() const { return static_cast<float>(1.0 / static_cast<double>(state_.scale)); }
  /// Clean steps since the last overflow or growth.
  std::int64_t growth_tracker() const { return state_.growth_tracker; }
  /// Overflows left before the scale backs off (<= 0: every overflow backs off).
  int hysteresis_tracker() const { return state_.hysteresis_tracker; }
  /// Number of update(true) calls (skipped optimizer steps) since construction or set_state.
  std::int64_t skipped_steps() const { return state_.skipped_steps; }
  const LossScalerConfig& config() const { return config_; }

  const State& state() const { return state_; }
  /// Restores a saved state. Throws CheckpointError naming the field unless scale is finite
  /// and > 0, growth_tracker >= 0 and skipped_steps >= 0. The scale is kept as saved (not
  /// clamped to this config's bounds), as Megatron's load_state_dict.
  void set_state(const State& s) {
    DSP_CHECK_AS(CheckpointError, std::isfinite(s.scale) && s.scale > 0.0f,
                 "loss scaler state: scale must be finite and > 0, got ", s.scale);
    DSP_CHECK_AS(CheckpointError, s.growth_tracker >= 0, "loss scaler state: growth_tracker must be >= 0, got ",
                 s.growth_tracker);
    DSP_CHECK_AS(CheckpointError, s.skipped_steps >= 0, "loss scaler state: skipped_steps must be >= 0, got ",
                 s.skipped_steps);
    state_ = s;
  }

 private:
  LossScalerConfig config_;
  State state_;
};

/// The overflow check of the loss-scaled gradients: true when any element of `values` is
/// +inf, -inf or NaN (not std::isfinite); large finite values are not overflows. Local to
/// this rank; combine the ranks' flags with any_rank.
inline bool has_inf_or_nan(std::span<const float> values) {
  return std::any_of(values.begin(), values.end(), [](float x) { return !std::isfinite(x); });
}

/// True on every rank of `group` when `flag` is true on any of them: an all_reduce with
/// ReduceOp::Max of 1.0f / 0.0f (Megatron all-reduces found_inf with MAX over its
/// model-parallel group). Collective over `group`. To make ranks of several groups agree,
/// call it once on a group holding all of them (e.g. the world) or on each group in turn
/// (the result of the first feeding the second, e.g. TP then PP then DP).
template <comm::Communicator Comm>
bool any_rank(Comm& group, bool flag) {
  float v = flag ? 1.0f : 0.0f;
  group.all_reduce(std::span<float>(&v, 1), comm::ReduceOp::Max);
  return v > 0.0f;
}

}  // namespace dsp::precision
