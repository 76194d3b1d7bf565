#pragma once
// Data-parallel gradient reduction: one all-reduce (sum) of every gradient over the data-
// parallel group per optimizer step, after the last micro-batch. The loss is normalised by
// the global number of loss tokens (all micro-batches, all DP ranks), so the sum is the
// gradient of the global mean. Bucketing and overlap with backward come with the
// communication-engine issue.
#include <vector>

#include "dsp/comm/communicator.hpp"
#include "dsp/model/parameter.hpp"

namespace dsp::dp {

/// Sums every parameter's gradient over the data-parallel group `dp` (collective over it).
template <comm::Communicator Comm>
void all_reduce_gradients(Comm& dp, const std::vector<model::Parameter*>& params) {
  if (dp.size() == 1) return;
  for (auto* p : params) dp.all_reduce(p->grad.span());
}

}  // namespace dsp::dp
