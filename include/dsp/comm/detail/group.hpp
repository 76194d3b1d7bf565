#pragma once
// Shared-memory state of one ThreadComm group: a reusable barrier, per-rank slots through which
// the ranks of a collective exchange a buffer pointer and a few integers, per-rank staging
// buffers for small messages, and a mailbox for point-to-point messages.
//
// Barrier (arrive_and_wait): an arrival counter and a generation counter, both atomics, on
// cache lines of their own. The last rank to arrive resets the counter and bumps the generation;
// the others wait for the generation to change in two phases:
//   1. poll, calling std::this_thread::yield() in between, for up to kYieldFor (500 us): when
//      there are more ranks than cores (4 ranks on 2 cores) the rank being waited for is often
//      runnable on this very core and yielding hands it the core at once; when nothing else is
//      runnable, yield returns at once (~0.3 us) and this is a spin.
//   2. sleep on a condition variable with 20 ms time-outs, for waits that are really long (a
//      peer computing), so that waiting ranks stop burning CPU. Waking a sleeper costs 30-100 us
//      on the development machine (futex + an idle vCPU), hence phase 1.
// Measured on the 2-vCPU development machine (KVM guest), back-to-back 4 KiB all_reduce: a
// phase of pause-instruction spinning before the yields (30, 100, 1000 iterations of ~17 ns)
// made 4 ranks 1.3-10x slower (each spinning rank holds the core its peer needs) and did not
// help 2 ranks measurably, so there is none. Both phases check Universe::aborted (phase 1 every
// kCheckEvery polls), so a failure on another rank is seen within microseconds, not only at
// the 20 ms wake-ups. Memory ordering: a rank's writes before arrive_and_wait (its slot, its
// staging buffer, its payload) happen before every other rank's reads after it returns: the
// arrival fetch_adds (acq_rel) chain all arrivals into the last arriver, whose generation store
// (seq_cst, so release) the waiters read with acquire.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "dsp/comm/detail/universe.hpp"
#include "dsp/core/error.hpp"

namespace dsp::comm::detail {

/// What one rank publishes for one collective. Cache-line aligned so that ranks writing their
/// own slots do not invalidate each other's lines.
struct alignas(64) Slot {
  const void* ptr = nullptr;                  ///< the rank's payload buffer
  std::int64_t op = 0;                        ///< which collective (an OpCode)
  std::int64_t arg[3] = {0, 0, 0};            ///< size, reduce op, root, colour/key, ...
  const std::int64_t* send_counts = nullptr;  ///< all_to_all_v: `size` entries
  const std::int64_t* recv_counts = nullptr;  ///< all_to_all_v: `size` entries
};

struct Group {
  /// Bytes of each rank's staging buffer: messages up to this size take the one-barrier
  /// "eager" path of thread_comm.hpp (copy into staging, one barrier, read the peers' staging).
  /// 8 KiB: on the development machine eager was clearly faster at 64 B - 4 KiB and no faster
  /// than the two-barrier direct algorithm at 16-32 KiB, where it moves n times the data (every
  /// rank reduces the whole message). Costs 2 x size x 8 KiB per group.
  static constexpr std::size_t kStagingBytes = std::size_t{8} << 10;
  /// Grace period of closing barriers after an abort (see arrive_and_wait): far longer than a
  /// rank needs between its collective's two barriers (a 256 MiB all_reduce takes ~70 ms
  /// here), short enough not to matter when a peer really is gone.
  static constexpr std::chrono::milliseconds kAbortGrace{2000};

  Group(std::shared_ptr<Universe> u, int n)
      : universe(std::move(u)), size(n), objs(static_cast<std::size_t>(n)), slots_(2 * static_cast<std::size_t>(n)),
        claims_(2 * static_cast<std::size_t>(n)),
        staging_(2 * static_cast<std::size_t>(n) * (kStagingBytes / sizeof(Line))) {}

  std::shared_ptr<Universe> universe;
  const int size;
  std::vector<std::shared_ptr<Group>> objs;  ///< per rank: groups made by split

  /// Index of the next barrier instance, as seen by a rank between two of its barriers: exact,
  /// because the next instance cannot complete without this rank.
  std::uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  /// Rank's slot for barrier instance `gen`. Slots alternate between two sets by the parity of
  /// the instance: a rank writes set gen % 2 before instance gen and peers read it between
  /// instances gen and gen + 1; the rank writes that set again only before instance gen + 2,
  /// which it reaches after everybody passed gen + 1, i.e. finished reading. So a collective
  /// needs no extra barrier to protect its slots, only the rule "read the slots of instance gen
  /// only before arriving at gen + 1".
  Slot& slot(std::uint64_t gen, int rank) { return slots_[index(gen, rank)]; }
  /// Rank's staging buffer (kStagingBytes, 64-byte aligned) for barrier instance `gen`; same
  /// double-buffering and reading rule as slot().
  std::byte* staging(std::uint64_t gen, int rank) {
    return reinterpret_cast<std::byte*>(staging_.data() + index(gen, rank) * (kStagingBytes / sizeof(Line)));
  }

  /// Work counter of rank `rank`'s share of a chunked collective at barrier instance `gen`: how
  /// many of its chunks were claimed, by the rank itself or by peers that ran out of work (the
  /// direct all_reduce of thread_comm.hpp). The rank resets it before arriving at instance gen;
  /// peers use it only between instances gen and gen + 1: the double-buffering rule of slot().
  std::atomic<std::int64_t>& claimed(std::uint64_t gen, int rank) { return claims_[index(gen, rank)].value; }

  /// Waits until all `size` ranks arrived. Throws AbortedError when another rank failed and
  /// TimeoutError (aborting the whole launch) after the universe's timeout.
  /// abort_grace: how long to keep waiting after an abort was seen before throwing. Zero for
  /// a collective's first barrier; the closing barrier of a collective whose peers read or
  /// write this rank's buffers passes kAbortGrace, because a rank that passed the first barrier
  /// reaches the closing one without blocking: leaving early would hand the buffers back to the
  /// caller (who may free them while unwinding) while peers still use them.
  void arrive_and_wait(int rank, const char* op, std::chrono::milliseconds abort_grace = {}) {
    const std::uint64_t gen = generation_.load(std::memory_order_acquire);
    if ((arrived_.fetch_add(1, std::memory_order_acq_rel) & kCountMask) + 1 == static_cast<std::uint64_t>(size)) {
      arrived_.store(tag(gen + 1), std::memory_order_relaxed);  // published by the generation store below
      generation_.store(gen + 1, std::memory_order_seq_cst);
      // Sleeper handshake: a sleeper increments sleepers_ and then, holding mu_, re-reads the
      // generation (both seq_cst). Either it incremented before our load below (we see it and
      // notify under mu_, after its check or while it waits) or after our store (its re-read
      // sees the new generation). Taking mu_ keeps the notify from falling between its check and
      // its wait.
      if (sleepers_.load(std::memory_order_seq_cst) > 0) {
        { std::lock_guard lk(mu_); }
        cv_.notify_all();
      }
      return;
    }
    auto done = [&] { return generation_.load(std::memory_order_acquire) != gen; };
    auto leave = [&] { return withdraw(gen); };
    // Phase 1: yield.
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    clock::time_point aborted_seen{};  // when this wait first saw the abort (grace period)
    for (int i = 0;; ++i) {
      if (done()) return;
      if (i % kCheckEvery == kCheckEvery - 1) {
        throw_if_aborted(rank, op, abort_grace, aborted_seen, leave);
        if (clock::now() - start > kYieldFor) break;
      }
      std::this_thread::yield();
    }
    // Phase 2: sleep.
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    struct Unsleep {
      std::atomic<int>& n;
      ~Unsleep() { n.fetch_sub(1, std::memory_order_relaxed); }
    } unsleep{sleepers_};
    std::unique_lock lk(mu_);
    wait_until(lk, rank, op, [&] { return generation_.load(std::memory_order_seq_cst) != gen; }, start, abort_grace,
               aborted_seen, leave);
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
    std::chrono::steady_clock::time_point aborted_seen{};
    wait_until(lk, dst, "recv", [&] { return !q.empty(); }, std::chrono::steady_clock::now(), {}, aborted_seen,
               [] { return true; });
    std::vector<std::byte> msg = std::move(q.front());
    q.pop_front();
    DSP_CHECK_AS(CommError, msg.size() == bytes, "recv on rank ", dst, " from rank ", src, " tag ", tag,
                 ": expected ", bytes, " bytes, message has ", msg.size());
    std::copy(msg.begin(), msg.end(), static_cast<std::byte*>(data));
  }

 private:
  struct alignas(64) Line {
    std::byte b[64];
  };
  struct alignas(64) Counter {  // one per cache line: the owner claims while peers read their slots
    std::atomic<std::int64_t> value{0};
  };
  // Tuning of the barrier's waiting phases (see the header comment): poll the abort flag and
  // the clock every kCheckEvery yields (~270 ns each here); sleep after kYieldFor.
  static constexpr int kCheckEvery = 16;
  static constexpr std::chrono::microseconds kYieldFor{500};

  std::size_t index(std::uint64_t gen, int rank) const {
    return static_cast<std::size_t>(gen & 1u) * static_cast<std::size_t>(size) + static_cast<std::size_t>(rank);
  }

  // arrived_ holds the low 32 bits of the barrier instance (tag) above the count of ranks that
  // arrived at it, so that a waiter can take its arrival back only while that very instance is
  // incomplete (withdraw).
  static constexpr std::uint64_t kCountMask = 0xffffffffu;
  static std::uint64_t tag(std::uint64_t gen) { return (gen & kCountMask) << 32; }

  // Takes this rank's arrival at instance gen back, so that the barrier cannot complete without
  // it: true when done (the caller may throw), false when the instance completed (or is being
  // completed by its last arriver) meanwhile: then the caller must carry on as if it had
  // waited normally, since its peers proceed into the collective and use its buffers.
  bool withdraw(std::uint64_t gen) {
    std::uint64_t v = arrived_.load(std::memory_order_acquire);
    for (;;) {
      if ((v & ~kCountMask) != tag(gen) || (v & kCountMask) >= static_cast<std::uint64_t>(size)) return false;
      if (arrived_.compare_exchange_weak(v, v - 1, std::memory_order_acq_rel)) return true;
    }
  }

  // Throws AbortedError once the launch is aborted, the grace period (counted from the first
  // call that saw the abort, `seen`) is over and leave() agrees (see withdraw).
  template <class Leave>
  void throw_if_aborted(int rank, const char* op, std::chrono::milliseconds grace,
                        std::chrono::steady_clock::time_point& seen, Leave leave) const {
    if (!universe->aborted.load()) return;
    const auto now = std::chrono::steady_clock::now();
    if (seen == std::chrono::steady_clock::time_point{}) seen = now;
    if (now - seen >= grace && leave())
      throw AbortedError(concat("rank ", rank, ": ", op, " aborted because ", universe->reason()));
  }

  // Waits (mu_ held) until ready(), with 20 ms wake-ups to check for an abort and the timeout,
  // counted from `start`.
  template <class Pred, class Leave>
  void wait_until(std::unique_lock<std::mutex>& lk, int rank, const char* op, Pred ready,
                  std::chrono::steady_clock::time_point start, std::chrono::milliseconds grace,
                  std::chrono::steady_clock::time_point& aborted_seen, Leave leave) {
    const auto deadline = start + universe->timeout;
    while (!ready()) {
      throw_if_aborted(rank, op, grace, aborted_seen, leave);
      if (std::chrono::steady_clock::now() > deadline && leave()) {
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

  std::vector<Slot> slots_;   // [parity][rank]
  std::vector<Counter> claims_;  // [parity][rank]
  std::vector<Line> staging_;  // [parity][rank][kStagingBytes]
  // Waiters poll generation_ while arrivals update arrived_: separate cache lines, so that the
  // polling does not slow the arrivals down (measured: 2-rank barrier ~2.5 us -> ~0.6 us).
  alignas(64) std::atomic<std::uint64_t> generation_{0};
  alignas(64) std::atomic<std::uint64_t> arrived_{0};  // tag(instance) | count, see withdraw
  std::atomic<int> sleepers_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::tuple<int, int, int>, std::deque<std::vector<std::byte>>> mailbox_;
};

}  // namespace dsp::comm::detail
