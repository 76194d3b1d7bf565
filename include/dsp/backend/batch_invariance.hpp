#pragma once
// Batch-invariant forward passes for serving: inside a BatchInvariantScope, linear_forward
// (backend/linear.hpp: every projection, expert, router and the output layer) runs the
// backend's gemm_nt_batch_invariant instead of its library GEMM, so each output row depends on
// its input row alone, bitwise, whatever else is in the batch (backend/host/
// gemm_batch_invariant.hpp has the why and the order). The other ops of a forward pass (norms,
// RoPE, activations, the paged attention) already compute each row or token on its own. The
// scope is the thread's, like MatmulPrecisionScope; serve::Engine opens one on every rank.
#include "dsp/core/thread_scope.hpp"

namespace dsp::backend {

/// Makes the calling thread's linear_forward batch-invariant until the scope ends, then
/// restores the previous setting (scopes nest). Belongs to one thread's stack.
class BatchInvariantScope : public ThreadScope<BatchInvariantScope, bool> {
 public:
  explicit BatchInvariantScope(bool on = true) : ThreadScope(on) {}
};

/// True inside a BatchInvariantScope of the calling thread.
inline bool batch_invariant() { return BatchInvariantScope::current(); }

}  // namespace dsp::backend
