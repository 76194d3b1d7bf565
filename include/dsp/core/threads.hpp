#pragma once
// How many ranks share this process (threads as ranks), so that compute libraries can size
// their own thread pools: ranks x threads <= cores.
#include <algorithm>
#include <atomic>
#include <thread>

namespace dsp {

namespace detail {
inline std::atomic<int>& ranks_per_process_storage() {
  static std::atomic<int> n{1};
  return n;
}
}  // namespace detail

/// Ranks running in this process (1 outside comm::launch).
inline int ranks_per_process() { return detail::ranks_per_process_storage().load(); }

/// Hardware threads of this machine, read once (glibc's hardware_concurrency reads
/// /sys/devices/system/cpu/online at every call: three system calls per GEMM otherwise).
inline int hardware_threads() {
  static const int n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return n;
}

/// Compute threads one rank may use: max(1, hardware threads / ranks in this process).
inline int threads_per_rank() { return std::max(1, hardware_threads() / ranks_per_process()); }

/// Sets ranks_per_process() for its lifetime (comm::launch uses it), restoring the old value.
class RanksPerProcess {
 public:
  explicit RanksPerProcess(int n) : old_(detail::ranks_per_process_storage().exchange(n)) {}
  ~RanksPerProcess() { detail::ranks_per_process_storage().store(old_); }
  RanksPerProcess(const RanksPerProcess&) = delete;
  RanksPerProcess& operator=(const RanksPerProcess&) = delete;

 private:
  int old_;
};

}  // namespace dsp
