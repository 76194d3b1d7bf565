#pragma once
// Test helper: a ZeRO-partitioned Adam moment made whole by a plain all-gather, independent of
// the checkpoint code.
#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "dsp/core/tensor.hpp"

namespace dsp::test {

/// The moment `owned` (opt.exp_avg(i) or opt.exp_avg_sq(i)) of the whole local shard of
/// optimizer parameter i: as is at ZeRO 0, else every rank's slice all-gathered over
/// opt.group(i), padding dropped. Collective over that group from stage 1. Parameter i's values
/// must be whole (between gather_for_checkpoint and partition_after_checkpoint) for its shape.
template <class Optimizer>
Tensor whole_moment(Optimizer& opt, std::size_t i, const Tensor& owned) {
  if (opt.stage() == 0) return owned;
  Tensor out(opt.parameters()[i]->value.shape());
  auto& group = opt.group(i);
  std::vector<float> all(static_cast<std::size_t>(owned.numel() * group.size()));
  group.all_gather(std::span<const float>(owned.span()), std::span<float>(all));
  std::copy_n(all.begin(), out.numel(), out.data());
  return out;
}

}  // namespace dsp::test
