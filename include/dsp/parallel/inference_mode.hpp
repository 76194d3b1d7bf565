#pragma once
// InferenceMode: parameters built without gradients, for a model that only serves
// (torch.inference_mode's role at construction). A model built as for training holds a zeroed
// gradient as large as every weight, which serving never writes: as much memory again as the
// weights (device memory on a GPU), and not what the serving ledger (plan::predict_serving)
// counts.
#include "dsp/core/thread_scope.hpp"

namespace dsp {

/// While it lives, Parameters (and so models) built on the calling thread get no gradient
/// buffer: values only. A model built so serves (forward, infer, serve::Engine) and saves and
/// loads checkpoints; its backward throws Error. InferenceMode(false) turns it off within an
/// enclosing scope. Scopes nest and restore the previous state; one belongs to one thread's
/// stack (a model is built on each rank's own thread: open the scope there).
class InferenceMode : public ThreadScope<InferenceMode, bool> {
 public:
  explicit InferenceMode(bool enabled = true) : ThreadScope(enabled) {}
};

/// True while an InferenceMode scope that enables it is the calling thread's innermost one.
inline bool inference_mode() { return InferenceMode::current(); }

}  // namespace dsp
