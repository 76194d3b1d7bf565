#pragma once
// Shared-memory state of one ThreadComm group: a reusable barrier that also exchanges one
// pointer and a few integers per rank, and a mailbox for point-to-point messages.
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "dsp/comm/detail/universe.hpp"
#include "dsp/core/error.hpp"

namespace dsp::comm::detail {

struct Group {
  Group(std::shared_ptr<Universe> u, int n)
      : universe(std::move(u)), size(n), ptr(n), meta(n), objs(n) {}

  std::shared_ptr<Universe> universe;
  const int size;
  std::vector<const void*> ptr;                  ///< per rank: the buffer it posted
  std::vector<std::vector<std::int64_t>> meta;   ///< per rank: counts, op codes, colours
  std::vector<std::shared_ptr<Group>> objs;      ///< per rank: groups made by split

  /// Waits until all `size` ranks arrived. Throws AbortedError when another rank failed and
  /// TimeoutError (aborting the whole launch) after the universe's timeout.
  void arrive_and_wait(int rank, const char* op) {
    std::unique_lock lk(mu_);
    const std::uint64_t gen = generation_;
    if (++arrived_ == size) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    wait_until(lk, rank, op, [&] { return generation_ != gen; });
  }

  /// Point-to-point: buffered send (copies and returns).
  void post_message(int src, int dst, int tag, const void* data, std::size_t bytes) {
    const auto* p = static_cast<const std::byte*>(data);
    {
      std::lock_guard lk(mu_);
      mailbox_[{src, dst, tag}].emplace_back(p, p + bytes);
    }
    cv_.notify_all();
  }
  /// Point-to-point: waits for the next message from src with tag; throws CommError when its
  /// size differs from `bytes`.
  void take_message(int src, int dst, int tag, void* data, std::size_t bytes) {
    std::unique_lock lk(mu_);
    auto& q = mailbox_[{src, dst, tag}];
    wait_until(lk, dst, "recv", [&] { return !q.empty(); });
    std::vector<std::byte> msg = std::move(q.front());
    q.pop_front();
    DSP_CHECK_AS(CommError, msg.size() == bytes, "recv on rank ", dst, " from rank ", src, " tag ", tag,
                 ": expected ", bytes, " bytes, message has ", msg.size());
    std::copy(msg.begin(), msg.end(), static_cast<std::byte*>(data));
  }

 private:
  template <class Pred>
  void wait_until(std::unique_lock<std::mutex>& lk, int rank, const char* op, Pred ready) {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + universe->timeout;
    while (!ready()) {
      if (universe->aborted.load())
        throw AbortedError(concat("rank ", rank, ": ", op, " aborted because ", universe->reason()));
      if (clock::now() > deadline) {
        const std::string why = concat("rank ", rank, ": ", op, " timed out after ",
                                       universe->timeout.count(), " ms waiting for the other ranks");
        universe->abort_all(why);
        throw TimeoutError(why);
      }
      cv_.wait_for(lk, std::chrono::milliseconds(20));
    }
  }
  template <class... Args>
  static std::string concat(const Args&... a) { return ::dsp::detail::concat(a...); }

  std::mutex mu_;
  std::condition_variable cv_;
  std::uint64_t generation_ = 0;
  int arrived_ = 0;
  std::map<std::tuple<int, int, int>, std::deque<std::vector<std::byte>>> mailbox_;
};

}  // namespace dsp::comm::detail
