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
#include <new>

#include "dsp/core/memory_space.hpp"

namespace dsp::test {

class GuardedSpace final : public MemorySpace {
 public:
  std::string_view name() const override { return "guarded test"; }
  void* allocate(std::size_t bytes, memory::Category category) override {
    void* p = std::calloc(bytes, 1);
    if (!p) throw std::bad_alloc();
    memory::detail::add(counters, category, static_cast<std::int64_t>(bytes));
    ++allocations;
    return p;
  }
  void deallocate(void* p, std::size_t bytes, memory::Category category) noexcept override {
    memory::detail::add(counters, category, -static_cast<std::int64_t>(bytes));
    std::free(p);
  }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
    ++copies;
  }
  void zero(void* p, std::size_t bytes) override { std::memset(p, 0, bytes); }

  memory::Snapshot counters;   ///< bytes of this space's live tensors, per category, and peaks
  std::int64_t allocations = 0, copies = 0;
};

}  // namespace dsp::test
