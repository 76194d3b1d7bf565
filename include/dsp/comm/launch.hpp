#pragma once
// comm::launch: runs a function on `world_size` ranks (threads) with a ThreadComm world.
#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dsp/comm/thread_comm.hpp"
#include "dsp/comm/timeout.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/threads.hpp"
#include "dsp/core/trace.hpp"

namespace dsp::comm {

/// Options of launch.
struct LaunchOptions {
  /// Longest time one collective waits for its peers before it throws TimeoutError and
  /// aborts every rank. Default 300 s, or the environment variable DSP_COMM_TIMEOUT_S.
  std::chrono::milliseconds timeout = default_timeout();
};

/// Runs fn(world) on world_size threads, each with its rank's ThreadComm over all ranks, and
/// returns when every rank returned. When a rank throws, every communicator of this launch
/// is aborted (the other ranks' pending and later operations throw AbortedError) and launch
/// rethrows the first rank's original exception after joining all threads. While it runs,
/// dsp::ranks_per_process() is world_size (the host backend sizes its BLAS threads from it).
/// Each rank's thread starts as trace rank `rank` on the "main" track (trace::set_thread_rank).
/// Throws ConfigError when world_size < 1.
inline void launch(int world_size, const std::function<void(ThreadComm&)>& fn, LaunchOptions options = {}) {
  DSP_CHECK_AS(ConfigError, world_size >= 1, "launch: world size must be >= 1, got ", world_size);
  auto universe = std::make_shared<detail::Universe>(options.timeout);
  auto group = std::make_shared<detail::Group>(universe, world_size);
  RanksPerProcess scope(world_size);

  std::mutex mu;
  std::exception_ptr first;        // first error that is not a consequence of the abort
  std::exception_ptr first_abort;  // kept in case only aborts were seen
  auto rank_main = [&](int rank) {
    trace::set_thread_rank(rank);
    try {
      ThreadComm world(group, rank);
      fn(world);
    } catch (const AbortedError&) {
      std::lock_guard lk(mu);
      if (!first_abort) first_abort = std::current_exception();
    } catch (const std::exception& e) {
      {
        std::lock_guard lk(mu);
        if (!first) first = std::current_exception();
      }
      universe->abort_all(::dsp::detail::concat("rank ", rank, " failed: ", e.what()));
    } catch (...) {
      {
        std::lock_guard lk(mu);
        if (!first) first = std::current_exception();
      }
      universe->abort_all(::dsp::detail::concat("rank ", rank, " failed with a non-standard exception"));
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(world_size));
  for (int r = 0; r < world_size; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
  if (first_abort) std::rethrow_exception(first_abort);
  // An asynchronous operation failed (e.g. timed out) and no rank waited on its Work.
  if (universe->aborted.load()) throw CommError(universe->reason());
}

}  // namespace dsp::comm
