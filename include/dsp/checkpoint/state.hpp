#pragma once
// State: how a model (and its optimizer) is presented to the checkpoint code, independent of
// the model class: a list of (ShardedTensor spec, this TP rank's local shard) pairs.
//
// Optimizer moments are further entries whose spec is the parameter's spec with the name
// prefixed, e.g. "optimizer.exp_avg." + parameter name: they share the parameter's split.
#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/core/tensor.hpp"
#include "dsp/parallel/sharded_tensor.hpp"

namespace dsp::checkpoint {

/// Names starting with this are optimizer state: split like their parameters, saved in
/// partition files (reshard writes them there too, or drops them), not read by a model-only
/// load (ReadScope::Model) and left out of a merged Hugging Face export.
inline constexpr std::string_view optimizer_prefix = "optimizer.";

/// Whether the tensor called `name` is optimizer state (its name starts with optimizer_prefix).
inline bool is_optimizer_state(std::string_view name) { return name.starts_with(optimizer_prefix); }

/// One tensor of a state: its global description and this TP rank's local shard, of shape
/// spec.local_shape(tp_size). The tensor is owned by the model; saving reads it, loading
/// overwrites it.
struct ShardEntry {
  ShardedTensor spec;
  Tensor* local = nullptr;
};

/// Every tensor one rank saves or loads.
using State = std::vector<ShardEntry>;

/// Part of one tensor of a state: elements [begin, begin + values.size()) of this TP rank's
/// local shard (of shape spec.local_shape(TP)), flattened row-major; ZeRO's owned slice of an
/// optimizer moment. The values are owned by the caller.
struct PartitionEntry {
  ShardedTensor spec;
  std::int64_t begin = 0;
  std::span<const float> values;
};

/// The parts of tensors one data-parallel rank saves.
using Partition = std::vector<PartitionEntry>;

/// Checks a state before saving or loading it as rank tp_rank of tp_size. Throws ConfigError
/// when tp_rank is outside [0, tp_size) or a spec cannot be split tp_size ways (see
/// ShardedTensor::validate), and Error, naming the tensor, when an entry has no local tensor,
/// two entries share a name, or a local tensor's shape is not spec.local_shape(tp_size).
inline void check_state(const State& state, int tp_size, int tp_rank) {
  DSP_CHECK_AS(ConfigError, tp_size >= 1 && tp_rank >= 0 && tp_rank < tp_size, "tensor-parallel rank ", tp_rank,
               " is outside [0, ", tp_size, ")");
  for (const ShardEntry& e : state) e.spec.validate(tp_size);
  std::set<std::string_view> names;
  for (const ShardEntry& e : state) {
    const Shape expected = e.spec.local_shape(tp_size);
    DSP_CHECK(e.local != nullptr, "state: tensor ", e.spec.name, " has no local tensor");
    DSP_CHECK(names.insert(e.spec.name).second, "state: tensor ", e.spec.name, " appears twice");
    DSP_CHECK(e.local->shape() == expected, "state: tensor ", e.spec.name, " has local shape ",
              shape_str(e.local->shape()), ", expected ", shape_str(expected), " at TP ", tp_size);
  }
}

}  // namespace dsp::checkpoint
