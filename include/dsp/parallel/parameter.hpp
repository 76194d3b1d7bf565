#pragma once
// Parameter: a local shard, its gradient and its ShardedTensor description; ParameterSpec: the
// same before anything is allocated (what the model's parts are described with, model/parts.hpp).
// Below model/ so that the tensor- and expert-parallel layers (tp/, ep/) own parameters
// without including the model.
#include <cmath>
#include <cstdint>
#include <string>

#include "dsp/core/rng.hpp"
#include "dsp/core/tensor.hpp"
#include "dsp/parallel/inference_mode.hpp"
#include "dsp/parallel/sharded_tensor.hpp"

namespace dsp {

/// How a parameter's global values are drawn.
struct Init {
  enum Kind { Normal, Ones, Zeros } kind = Normal;
  float std = 0.02f;  ///< standard deviation for Normal
};

/// One parameter before it is allocated: its sharding, how its values are drawn, and how
/// training treats it. The Parameter built from it holds the same flags.
struct ParameterSpec {
  ShardedTensor tensor;    ///< global name, global shape, TP split
  Init init;               ///< how the global values are drawn
  bool expert = false;     ///< Parameter::expert (a routed expert's weight)
  bool tied_copy = false;  ///< Parameter::tied_copy (the last stage's copy of a tied embedding)
  bool buffer = false;     ///< saved state without gradient or optimizer state (MoE expert bias)

  /// This rank's shard at TP size `tp`: tensor.local_shape(tp).
  Shape local_shape(int tp) const { return tensor.local_shape(tp); }
};

/// One trainable tensor on one rank: `value` and `grad` have shape spec.local_shape(tp). The
/// value counts as memory::Category::Parameters, the gradient as Gradients. Built in an
/// InferenceMode scope, `grad` is empty (no buffer).
struct Parameter {
  ShardedTensor spec;
  Tensor value;
  Tensor grad;
  bool weight_decay = true;  ///< Megatron: no decay on norms (1-D parameters)
  /// This rank's copy of a parameter that another pipeline stage owns (the tied output
  /// embedding on the last stage): trained with the same summed gradient, so equal to the
  /// owner's; only the owner saves it and counts it in the gradient norm.
  bool tied_copy = false;
  /// A routed expert's weight (one expert-parallel rank holds it): its gradient is reduced over
  /// the expert-data-parallel group, and its square counts in the gradient norm once per
  /// expert-parallel group.
  bool expert = false;

  /// Builds the local shard of TP rank `tp_rank` of `tp_size`. Element (global flat index g)
  /// is std * N(0,1) drawn from CounterRng(seed, spec.name) at g, so every layout holds the
  /// same global values; padding is zero. Throws ConfigError when the spec cannot split.
  /// `value` (and `grad`, when there is one) live in the calling thread's current memory space
  /// (values drawn on the host, then copied there).
  Parameter(ShardedTensor s, Init init, std::uint64_t seed, int tp_size, int tp_rank)
      : spec(std::move(s)),
        value(initial_values(spec, init, seed, tp_size, tp_rank)),
        grad(inference_mode() ? Tensor{} : Tensor(spec.local_shape(tp_size), memory::Category::Gradients)),
        weight_decay(spec.global_shape.size() >= 2) {}

  /// Builds the local shard of `p` as above, with its flags; a buffer gets no gradient.
  Parameter(const ParameterSpec& p, std::uint64_t seed, int tp_size, int tp_rank)
      : spec(p.tensor),
        value(initial_values(spec, p.init, seed, tp_size, tp_rank)),
        grad(p.buffer || inference_mode() ? Tensor{} : Tensor(spec.local_shape(tp_size), memory::Category::Gradients)),
        weight_decay(spec.global_shape.size() >= 2),
        tied_copy(p.tied_copy),
        expert(p.expert) {}

 private:
  static Tensor initial_values(const ShardedTensor& spec, Init init, std::uint64_t seed, int tp_size, int tp_rank) {
    Tensor host(spec.local_shape(tp_size), memory::Category::Parameters, nullptr);
    if (init.kind != Init::Normal) {
      host.fill(init.kind == Init::Ones ? 1.0f : 0.0f);
    } else {
      const CounterRng rng(seed, spec.name);
      for_each_shard_row(spec, tp_size, tp_rank, [&](std::int64_t l, std::int64_t g, std::int64_t n) {
        for (std::int64_t k = 0; k < n; ++k)  // vocabulary padding is skipped: it stays zero
          host[l + k] = static_cast<float>(init.std * rng.normal(static_cast<std::uint64_t>(g + k)));
      });
    }
    memory::CategoryScope category(memory::Category::Parameters);
    return std::move(host).to(current_memory_space());
  }
};

}  // namespace dsp
