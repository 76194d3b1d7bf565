#pragma once
// Test helper: the global tensor of a TP-sharded parameter (or its gradient), gathered from
// every rank of the tensor-parallel group and placed by its ShardedTensor description.
#include <span>
#include <vector>

#include "dsp/comm/communicator.hpp"
#include "dsp/parallel/sharded_tensor.hpp"

namespace dsp::test {

/// Collective over `tp`: every rank passes its shard `local` of `spec`; all get the global tensor.
template <comm::Communicator Comm>
Tensor gather_global(Comm& tp, const ShardedTensor& spec, const Tensor& local) {
  const int n = tp.size();
  const std::int64_t size = local.numel();
  Tensor all({n, size}), global;
  tp.all_gather(std::span<const float>(local.span()), all.span());
  for (int r = 0; r < n; ++r)
    unshard_into(spec, Tensor(local.shape(), Tensor::Storage(all.data() + r * size, all.data() + (r + 1) * size)), n, r, global);
  return global;
}

}  // namespace dsp::test
