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
    if (bytes) std::memcpy(dst, src, bytes);
    std::lock_guard lock(mu_);
    ++copies;
  }
  void zero(void* p, std::size_t bytes) override { std::memset(p, 0, bytes); }

  /// Whether p points into memory this space allocated and has not freed.
  bool holds(const void* p) const {
    const auto* c = static_cast<const char*>(p);
    std::lock_guard lock(mu_);
    auto it = live_.upper_bound(c);
    if (it == live_.begin()) return false;
    --it;
    return c < it->first + it->second;
  }

  // Read them once the ranks using the space are done.
  memory::Snapshot counters;   ///< bytes of this space's live tensors, per category, and peaks
  std::int64_t allocations = 0, copies = 0;

 private:
  mutable std::mutex mu_;
  std::map<const char*, std::size_t> live_;  // allocation start -> bytes
};

}  // namespace dsp::test
