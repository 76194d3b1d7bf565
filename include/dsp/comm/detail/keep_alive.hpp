#pragma once
// keep_until_exit: the failure path of objects that own buffers of communication still in
// flight. While an exception unwinds a rank, waiting for such an operation may never end (the
// peers may never join it), and freeing its buffer would let the communicator write freed
// memory; the buffer is handed instead to a process-lifetime store, freed at exit.
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace dsp::comm::detail {

/// Keeps v (moved, not copied: a vector's or Tensor's storage stays where it is) alive until
/// the process exits. Thread-safe.
template <class V>
void keep_until_exit(V v) {
  static std::mutex mu;
  static std::vector<std::shared_ptr<void>> kept;
  std::lock_guard lk(mu);
  kept.push_back(std::make_shared<V>(std::move(v)));
}

}  // namespace dsp::comm::detail
