#pragma once
// GuardedSpace: a MemorySpace for tests on machines without a GPU. Its memory is ordinary host
// memory, so host ops and ThreadComm work on it through data(), but Tensor's host accessors
// refuse it as they refuse GPU memory. A model trained inside a MemorySpaceScope(&space) thus
// shows that no layer, optimizer or trainer loop reads or writes elements through the host
// accessors: everything goes through ops, communicators and explicit copies, which is what
// running on a GPU needs. Its limit: a host loop over a raw data() pointer is not caught (the
// memory is host memory underneath), nor is a host buffer handed to an op; library code keeps
// host loops on span() so that they are. It counts its bytes per category like the device
// counters.
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/core/memory_space.hpp"

namespace dsp::test {

class GuardedSpace final : public MemorySpace {
 public:
  std::string_view name() const override { return "guarded test"; }
  void* allocate(std::size_t bytes, memory::Category category) override {
    void* p = std::calloc(bytes, 1);
    if (!p) throw std::bad_alloc();
    std::lock_guard lock(mu_);  // ranks (threads) may share one space
    memory::detail::add(counters, category, static_cast<std::int64_t>(bytes));
    ++allocations;
    live_[static_cast<const char*>(p)] = bytes;
    return p;
  }
  void deallocate(void* p, std::size_t bytes, memory::Category category) noexcept override {
    {
      std::lock_guard lock(mu_);
      memory::detail::add(counters, category, -static_cast<std::int64_t>(bytes));
      live_.erase(static_cast<const char*>(p));
    }
    std::free(p);
  }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    std::lock_guard lock(mu_);
    land();  // a synchronous copy waits for the copies enqueued before it
    if (bytes) std::memcpy(dst, src, bytes);
    ++copies;
  }
  /// Stream semantics against the `pinned` companion, so that a missing synchronize() shows: a
  /// copy into pinned memory takes the source's bytes now but lands only at the next
  /// synchronize() or copy() (the destination holds NaN meanwhile); a copy out of pinned memory
  /// is checked, at the next stream operation, not to have had its source written by the host
  /// in between (throws Error). Other copies are immediate.
  void copy_async(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    std::lock_guard lock(mu_);
    ++copies;
    check_copies_out();  // they ran before this one on the stream
    const auto* from = static_cast<const std::byte*>(src);
    if (pinned && pinned->holds(dst)) {
      pending_in_.push_back({dst, std::vector<std::byte>(from, from + bytes)});
      std::memset(dst, 0xFF, bytes);  // NaN until the copy lands
      return;
    }
    std::memcpy(dst, src, bytes);
    if (pinned && pinned->holds(src)) pending_out_.push_back({src, std::vector<std::byte>(from, from + bytes)});
  }
  void synchronize() override {
    std::lock_guard lock(mu_);
    land();
  }
  void zero(void* p, std::size_t bytes) override { std::memset(p, 0, bytes); }
  /// `pinned`, standing for a device's page-locked host memory (null: none).
  MemorySpace* pinned_host() override { return pinned; }

  /// Whether p points into memory this space allocated and has not freed.
  bool holds(const void* p) const {
    const auto* c = static_cast<const char*>(p);
    std::lock_guard lock(mu_);
    auto it = live_.upper_bound(c);
    if (it == live_.begin()) return false;
    --it;
    return c < it->first + it->second;
  }

  std::optional<memory::Snapshot> snapshot() const override {
    std::lock_guard lock(mu_);
    return counters;
  }
  void reset_peak() override {
    std::lock_guard lock(mu_);
    memory::detail::reset_peak(counters);
  }

  /// Set before use: another GuardedSpace that outlives this one, or null.
  GuardedSpace* pinned = nullptr;
  // Read them once the ranks using the space are done.
  memory::Snapshot counters;   ///< bytes of this space's live tensors, per category, and peaks
  std::int64_t allocations = 0, copies = 0;

 private:
  struct Pending {
    const void* at;                // the destination (copies in) or the source (copies out)
    std::vector<std::byte> bytes;  // what lands, or what the source must still hold
  };
  void check_copies_out() {
    for (const Pending& p : pending_out_)
      DSP_CHECK(std::memcmp(p.at, p.bytes.data(), p.bytes.size()) == 0,
                "guarded test: host code wrote pinned memory an enqueued copy was still reading (no synchronize())");
    pending_out_.clear();
  }
  void land() {
    check_copies_out();
    for (Pending& p : pending_in_) std::memcpy(const_cast<void*>(p.at), p.bytes.data(), p.bytes.size());
    pending_in_.clear();
  }

  mutable std::mutex mu_;
  std::map<const char*, std::size_t> live_;  // allocation start -> bytes
  std::vector<Pending> pending_in_, pending_out_;
};

}  // namespace dsp::test
