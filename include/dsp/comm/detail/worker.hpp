#pragma once
// One background thread per (rank, communicator, kind) that runs that rank's asynchronous
// operations in the order they were issued, so every rank meets the same sequence.
// Destroyed while an exception unwinds the rank with operations still pending, it aborts the
// whole launch (the peers would otherwise wait for this rank until the timeout); once the
// launch is aborted, queued operations complete with AbortedError without running.
// Each operation is a trace::Span of kind comm on the worker's thread, which records for the
// trace rank of the thread that created the worker, on the track given at construction.
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "dsp/comm/detail/universe.hpp"
#include "dsp/comm/work.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/trace.hpp"

namespace dsp::comm::detail {

class Worker {
 public:
  /// track: the worker thread's name in a trace ("comm", "p2p").
  Worker(std::shared_ptr<Universe> universe, int rank, const char* track = "comm")
      : universe_(std::move(universe)), rank_(rank), trace_rank_(trace::thread_rank()), track_(track),
        thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
      if (pending_ > 0 && std::uncaught_exceptions() > 0)
        universe_->abort_all(::dsp::detail::concat("rank ", rank_, " failed with communication pending"));
    }
    cv_.notify_all();
    thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Queues fn; the returned Work completes when fn returned or threw. name (a string
  /// literal: the API call) and bytes label its trace span.
  Work submit(const char* name, std::int64_t bytes, std::function<void()> fn) {
    auto state = std::make_shared<Work::State>();
    state->op = name;
    {
      std::lock_guard lk(mu_);
      queue_.push_back({std::move(fn), state, name, bytes});
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
    const char* name = "";
    std::int64_t bytes = 0;
  };
  void loop() {
    trace::set_thread_rank(trace_rank_, track_);
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
        if (universe_->aborted.load())
          throw AbortedError(::dsp::detail::concat("rank ", rank_, ": operation cancelled because ", universe_->reason()));
        trace::Span span(t.name, trace::Kind::Comm, {{"bytes", t.bytes}});
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

  std::shared_ptr<Universe> universe_;
  int rank_;
  int trace_rank_;
  const char* track_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  int pending_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dsp::comm::detail
