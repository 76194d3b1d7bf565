#pragma once
// Reduction operators of all_reduce / reduce_scatter.

namespace dsp::comm {

/// Element-wise reduction applied across ranks.
enum class ReduceOp { Sum, Max, Min };

}  // namespace dsp::comm
