#pragma once
// One background thread per (rank, communicator) that runs that rank's asynchronous
// operations in the order they were issued, so every rank meets the same sequence.
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "dsp/comm/work.hpp"

namespace dsp::comm::detail {

class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Queues fn; the returned Work completes when fn returned or threw.
  Work submit(std::function<void()> fn) {
    auto state = std::make_shared<Work::State>();
    {
      std::lock_guard lk(mu_);
      queue_.push_back({std::move(fn), state});
      ++pending_;
    }
    cv_.notify_all();
    return Work(state);
  }
  /// Number of queued or running operations.
  int pending() {
    std::lock_guard lk(mu_);
    return pending_;
  }

 private:
  struct Task {
    std::function<void()> fn;
    std::shared_ptr<Work::State> state;
  };
  void loop() {
    for (;;) {
      Task t;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr err;
      try {
        t.fn();
      } catch (...) {
        err = std::current_exception();
      }
      {
        std::lock_guard lk(mu_);
        --pending_;
      }
      t.state->finish(err);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  int pending_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dsp::comm::detail
