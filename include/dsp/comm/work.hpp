#pragma once
// Work: the handle of an asynchronous communication operation (as torch.distributed's Work).
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "dsp/core/trace.hpp"

namespace dsp::comm {

/// Completion handle returned by every `*_async` operation. `wait()` blocks the calling host
/// thread until the operation finished on this rank and rethrows its error (CommError,
/// TimeoutError, AbortedError). Buffers passed to the operation must stay alive and untouched
/// until wait() returned. A default-constructed Work is already complete.
class Work {
 public:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
    const char* op = nullptr;  ///< the API call (a string literal), for trace spans; may be null
    void finish(std::exception_ptr e) {
      {
        std::lock_guard lk(mu);
        done = true;
        error = e;
      }
      cv.notify_all();
    }
  };

  Work() = default;
  explicit Work(std::shared_ptr<State> s) : state_(std::move(s)) {}
  /// A pending operation that another engine drives (an MPI request): `wait` blocks until the
  /// operation finished, then does its post-processing (e.g. writing a bf16 result back) and
  /// throws its error; `test` never blocks and returns true once `wait` would return at once.
  /// Work calls `wait` at most once (from wait(), or from completed() once `test` said true),
  /// remembers its error for every later wait(), and then releases both functions.
  /// op: the API call (a string literal, e.g. "all_reduce"), which names the idle trace span
  /// "wait:<op>" of a wait that blocks; may be null ("wait").
  Work(std::function<void()> wait, std::function<bool()> test, const char* op = nullptr)
      : external_(std::make_shared<External>(std::move(wait), std::move(test), op)) {}

  /// Blocks until complete; rethrows the operation's exception, if any. While tracing, a wait
  /// that blocks is an idle span "wait:<op>".
  void wait() const {
    std::optional<trace::Span> idle;
    if (trace::enabled() && !completed())
      idle.emplace(op() ? std::string("wait:") + op() : "wait", trace::Kind::Idle);
    if (external_) return external_->wait();
    if (!state_) return;
    std::unique_lock lk(state_->mu);
    state_->cv.wait(lk, [&] { return state_->done; });
    if (state_->error) std::rethrow_exception(state_->error);
  }
  /// True once the operation completed (successfully or not); never blocks.
  bool completed() const {
    if (external_) return external_->completed();
    if (!state_) return true;
    std::lock_guard lk(state_->mu);
    return state_->done;
  }

 private:
  struct External {
    std::mutex mu;
    std::function<void()> wait_fn;
    std::function<bool()> test_fn;
    const char* op;
    bool done = false;
    std::exception_ptr error;
    External(std::function<void()> w, std::function<bool()> t, const char* o)
        : wait_fn(std::move(w)), test_fn(std::move(t)), op(o) {}
    void finish() {  // with mu held
      try {
        wait_fn();
      } catch (...) {
        error = std::current_exception();
      }
      done = true;
      wait_fn = nullptr;
      test_fn = nullptr;
    }
    void wait() {
      std::lock_guard lk(mu);
      if (!done) finish();
      if (error) std::rethrow_exception(error);
    }
    bool completed() {
      std::lock_guard lk(mu);
      if (done) return true;
      bool ready = true;  // a test that throws has completed with that error
      try {
        ready = test_fn();
      } catch (...) {
        error = std::current_exception();
        done = true;
        return true;
      }
      if (ready) finish();
      return done;
    }
  };
  // The API call that made this Work, or null.
  const char* op() const { return external_ ? external_->op : state_ ? state_->op : nullptr; }

  std::shared_ptr<State> state_;
  std::shared_ptr<External> external_;
};

}  // namespace dsp::comm
