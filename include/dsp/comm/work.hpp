#pragma once
// Work: the handle of an asynchronous communication operation (as torch.distributed's Work).
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>

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

  /// Blocks until complete; rethrows the operation's exception, if any.
  void wait() const {
    if (!state_) return;
    std::unique_lock lk(state_->mu);
    state_->cv.wait(lk, [&] { return state_->done; });
    if (state_->error) std::rethrow_exception(state_->error);
  }
  /// True once the operation completed (successfully or not); never blocks.
  bool completed() const {
    if (!state_) return true;
    std::lock_guard lk(state_->mu);
    return state_->done;
  }

 private:
  std::shared_ptr<State> state_;
};

}  // namespace dsp::comm
