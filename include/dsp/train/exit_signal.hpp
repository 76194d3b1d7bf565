#pragma once
// Megatron's --exit-signal-handler: SIGTERM (a scheduler's notice) or SIGINT (Ctrl-C) asks the
// run to finish its current step, save and exit cleanly; a second signal exits at once.
//
//   train::ExitSignalHandler handler;            // installs the handlers, restores them at its end
//   while (...) {
//     trainer.train_step();
//     if (train::exit_signal_agreed(world)) { save; break; }   // every rank the same step
//   }
//
// The handler only records the signal (async-signal-safe); the ranks agree on it with a
// one-element all-reduce after each step, so that all of them stop after the same step even
// when the signal reached one process (MPI) or was seen by one thread first (threads as ranks).
#include <atomic>
#include <csignal>
#include <span>

#include "dsp/comm/communicator.hpp"

namespace dsp::train {

namespace detail {
inline std::atomic<int> exit_signal{0};  // the first signal received, 0 for none
static_assert(std::atomic<int>::is_always_lock_free);
extern "C" inline void on_exit_signal(int sig) {
  int none = 0;
  if (!exit_signal.compare_exchange_strong(none, sig)) {  // the second signal: exit at once
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}
}  // namespace detail

/// While it lives, SIGTERM and SIGINT are recorded instead of ending the process (the second
/// one ends it as the default action would). One per process; not copyable.
class ExitSignalHandler {
 public:
  ExitSignalHandler() {
    detail::exit_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = detail::on_exit_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // a blocking read or write in progress is resumed, not failed
    sigaction(SIGTERM, &sa, &old_term_);
    sigaction(SIGINT, &sa, &old_int_);
  }
  ~ExitSignalHandler() {
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGINT, &old_int_, nullptr);
  }
  ExitSignalHandler(const ExitSignalHandler&) = delete;
  ExitSignalHandler& operator=(const ExitSignalHandler&) = delete;

 private:
  struct sigaction old_term_ {}, old_int_ {};
};

/// The signal this process received (SIGTERM, SIGINT), 0 for none.
inline int exit_signal_received() { return detail::exit_signal.load(); }

/// Whether any rank of `world` has received an exit signal: a one-element max all-reduce, so
/// every rank gets the same answer at the same call. Collective over `world`.
template <comm::Communicator Comm>
bool exit_signal_agreed(Comm& world) {
  float seen = exit_signal_received() != 0 ? 1.0f : 0.0f;
  world.all_reduce(std::span(&seen, 1), comm::ReduceOp::Max);
  return seen > 0;
}

}  // namespace dsp::train
