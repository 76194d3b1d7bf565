#pragma once
// Shared failure state of every communicator created by one comm::launch: the first
// failure aborts all of them, and every waiting rank sees it.
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>

namespace dsp::comm::detail {

struct Universe {
  explicit Universe(std::chrono::milliseconds t) : timeout(t) {}

  const std::chrono::milliseconds timeout;  ///< longest wait of one collective before it throws
  std::atomic<bool> aborted{false};

  /// Marks every communicator of this launch aborted; the first reason wins.
  void abort_all(const std::string& why) {
    std::lock_guard lk(mu_);
    if (!aborted.load()) reason_ = why;
    aborted.store(true);
  }
  std::string reason() const {
    std::lock_guard lk(mu_);
    return reason_;
  }

 private:
  mutable std::mutex mu_;
  std::string reason_;
};

}  // namespace dsp::comm::detail
