#pragma once
// Reduction operators of all_reduce / reduce_scatter.
#include <algorithm>

namespace dsp::comm {

/// Element-wise reduction applied across ranks.
enum class ReduceOp { Sum, Max, Min };

namespace detail {
/// Combines two accumulator values with op.
template <class A>
A combine(ReduceOp op, A a, A b) {
  switch (op) {
    case ReduceOp::Sum: return a + b;
    case ReduceOp::Max: return std::max(a, b);
    case ReduceOp::Min: return std::min(a, b);
  }
  return a;
}
}  // namespace detail

}  // namespace dsp::comm
