#pragma once
// parallel_for: the host ops' own compute threads, for the kernels dsp writes itself (the
// batch-invariant GEMM, paged attention, SwiGLU through parallel_for_rows); OpenBLAS keeps its
// own pool for its GEMMs. Each rank thread owns a pool of threads_per_rank() - 1 helpers
// (core/threads.hpp: ranks x threads <= cores), created on its first parallel call and joined
// when the rank thread ends. The caller works too. Helpers spin briefly for the next job
// before they sleep, so the back-to-back calls of a forward pass do not pay a wake-up each.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "dsp/backend/host/host.hpp"
#include "dsp/core/threads.hpp"

namespace dsp::backend {

namespace detail {

// Helpers that run tasks [0, n) of one job at a time, claiming them through an atomic counter.
class HostWorkerPool {
 public:
  explicit HostWorkerPool(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { work(); });
  }
  ~HostWorkerPool() {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }
  HostWorkerPool(const HostWorkerPool&) = delete;
  HostWorkerPool& operator=(const HostWorkerPool&) = delete;

  int helpers() const { return static_cast<int>(threads_.size()); }

  // Runs task(i) for every i in [0, n) on the helpers and the calling thread; rethrows the
  // first exception a task threw, once every task has ended.
  void run(std::int64_t n, const std::function<void(std::int64_t)>& task) {
    {
      const std::lock_guard lock(mutex_);
      task_ = &task;
      tasks_ = n;
      next_.store(0);
      busy_.store(helpers());
      error_ = nullptr;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    drain();
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return busy_.load() == 0; });
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void drain() {
    for (std::int64_t i = next_.fetch_add(1); i < tasks_; i = next_.fetch_add(1)) {
      try {
        (*task_)(i);
      } catch (...) {
        const std::lock_guard lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }
  void work() {
    std::uint64_t seen = 0;
    for (;;) {
      // A short spin (some hundred microseconds of yields) catches the next call of a forward pass.
      for (int spin = 0; spin < 256 && generation_.load() == seen; ++spin) std::this_thread::yield();
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        seen = generation_.load();
        if (stop_) return;
      }
      drain();
      if (busy_.fetch_sub(1) == 1) {
        const std::lock_guard lock(mutex_);
        done_.notify_all();
      }
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<std::int64_t> next_{0};
  std::atomic<int> busy_{0};
  std::int64_t tasks_ = 0;
  const std::function<void(std::int64_t)>* task_ = nullptr;
  std::exception_ptr error_;
  bool stop_ = false;
};

// The calling thread's pool, (re)built when threads_per_rank() changed since it was made.
inline HostWorkerPool& host_worker_pool() {
  thread_local std::unique_ptr<HostWorkerPool> pool;
  const int helpers = threads_per_rank() - 1;
  if (!pool || pool->helpers() != helpers) {
    pool.reset();
    pool = std::make_unique<HostWorkerPool>(helpers);
  }
  return *pool;
}

}  // namespace detail

/// Compute threads a host op of this rank may run on: threads_per_rank() (core/threads.hpp).
inline int host_threads(Host) { return threads_per_rank(); }

/// Calls task(i) exactly once for every i in [0, n), on the calling thread and the rank's
/// helper threads (at most host_threads() at a time; order unspecified); blocks until all
/// have returned. With one thread per rank, or n <= 1, everything runs on the caller. The
/// first exception a task throws is rethrown after the others end. Not reentrant: a task must
/// not call parallel_for.
inline void parallel_for(Host h, std::int64_t n, const std::function<void(std::int64_t)>& task) {
  if (n <= 0) return;
  if (n == 1 || host_threads(h) == 1) {
    for (std::int64_t i = 0; i < n; ++i) task(i);
    return;
  }
  detail::host_worker_pool().run(n, task);
}

/// Elements of one block of parallel_for_rows: enough work (tens of microseconds of an
/// elementwise op with an exp) to outweigh handing the block to a helper.
constexpr std::int64_t parallel_rows_block_elements = 8192;

/// Calls task(r0, r1) for consecutive blocks of whole rows covering [0, rows), each of
/// max(1, parallel_rows_block_elements / row_elements) rows (the last may be shorter), through
/// parallel_for: for row-wise elementwise ops of row_elements values per row. A single block (a
/// decode step of one token) runs on the caller alone.
inline void parallel_for_rows(Host h, std::int64_t rows, std::int64_t row_elements,
                              const std::function<void(std::int64_t, std::int64_t)>& task) {
  const std::int64_t per = std::max<std::int64_t>(1, parallel_rows_block_elements / std::max<std::int64_t>(1, row_elements));
  parallel_for(h, (rows + per - 1) / per, [&](std::int64_t b) { task(b * per, std::min(rows, (b + 1) * per)); });
}

}  // namespace dsp::backend
