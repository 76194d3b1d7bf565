#pragma once
// MemorySpace: where a Tensor's elements live when not in ordinary host memory (a GPU's
// memory: backend/cuda/memory_space.hpp), and the calling thread's current space, the one new
// tensors are allocated in (as Kokkos chooses a memory space, and as torch.set_default_device
// sets where new tensors go). Host memory is the null space: no object, plain counted vectors.
//
// A tensor in a space other than the host's is reached through its pointer (Tensor::data(),
// raw_span()) by the ops of a backend that can read that memory, and copied to and from the
// host only explicitly (Tensor::to_host(), Tensor::to(), copy_to_host()). Tensor's host
// accessors (span(), values(), operator[], fill) throw for it, so host code that loops over
// elements through them is caught; a loop over the raw pointer is not (host loops in library
// code use span() for that reason).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "dsp/core/memory.hpp"
#include "dsp/core/thread_scope.hpp"

namespace dsp {

/// A kind of memory tensors can live in, other than ordinary host memory. Implementations
/// count what they allocate in their own counters under the category given (a pinned host
/// space, being host memory, in the host counters). A space must
/// outlive its tensors, including those a failing rank keeps for in-flight communication until
/// process exit (comm::detail::keep_until_exit).
class MemorySpace {
 public:
  virtual ~MemorySpace() = default;
  /// "cuda", for messages.
  virtual std::string_view name() const = 0;
  /// `bytes` of zeroed memory counted under `category`. Throws dsp::Error (or a subclass) when
  /// the space cannot provide them.
  virtual void* allocate(std::size_t bytes, memory::Category category) = 0;
  /// Returns memory from allocate (same bytes and category).
  virtual void deallocate(void* p, std::size_t bytes, memory::Category category) noexcept = 0;
  /// Copies `bytes` from src to dst where each is this space's memory or host memory. When it
  /// returns, host memory written may be read and host memory read may be reused.
  virtual void copy(void* dst, const void* src, std::size_t bytes) = 0;
  /// Sets `bytes` at p (this space's memory) to zero.
  virtual void zero(void* p, std::size_t bytes) = 0;

  /// The space of host memory this space copies to and from asynchronously (page-locked memory
  /// for CUDA: cudaHostAlloc), or null when it has none and ordinary host memory serves. Its
  /// memory is host-addressable: host code (the CPU optimizer of ZeRO-Offload) may use its
  /// raw pointers, though Tensor's host accessors refuse it as any space's. Never destroyed
  /// before this space.
  virtual MemorySpace* pinned_host() { return nullptr; }
  /// Enqueues a copy of `bytes` from src to dst, each this space's memory or pinned_host()'s,
  /// ordered with the space's other work; host code may read (or reuse) the host side only
  /// after synchronize(). Default: copy(), which completes at once.
  virtual void copy_async(void* dst, const void* src, std::size_t bytes) { copy(dst, src, bytes); }
  /// Waits until everything enqueued on the space so far (copies, and for CUDA the stream's
  /// ops) has completed. Default: nothing to wait for.
  virtual void synchronize() {}

  /// The counters this space's memory is counted in for the calling thread (bytes per
  /// category, live and peak; for CUDA the thread's device counters), or nullopt when it counts
  /// in the host counters (core/memory.hpp), as a pinned host space does. Default: nullopt.
  virtual std::optional<memory::Snapshot> snapshot() const { return std::nullopt; }
  /// Starts a new peak measurement (every category and the total) in those counters at the
  /// live bytes; nothing for a space without counters of its own.
  virtual void reset_peak() {}
  /// Bytes of memory the space has in all (a device's total memory), or nullopt when unknown.
  /// serve::Engine sizes its KV cache from it (--gpu-memory-utilization). Default: nullopt.
  virtual std::optional<std::int64_t> capacity_bytes() const { return std::nullopt; }
};

/// Makes `space` (null: host memory) the calling thread's current memory space until the scope
/// ends, then restores the previous one (scopes nest). Belongs to one thread's stack.
class MemorySpaceScope : public ThreadScope<MemorySpaceScope, MemorySpace*> {
 public:
  explicit MemorySpaceScope(MemorySpace* space) : ThreadScope(space) {}
};

/// The calling thread's current memory space: the innermost MemorySpaceScope's; null (host
/// memory) outside any.
inline MemorySpace* current_memory_space() { return MemorySpaceScope::current(); }

/// The calling thread's counters of the memory tensors go to in `space` (default: the current
/// one): the space's own (a device's) when it has them, else the host counters.
inline memory::Snapshot space_snapshot(const MemorySpace* space = current_memory_space()) {
  if (space)
    if (auto s = space->snapshot()) return *s;
  return memory::snapshot();
}
/// Starts a new peak measurement in the counters space_snapshot(space) reads.
inline void reset_space_peak(MemorySpace* space = current_memory_space()) {
  if (space && space->snapshot()) space->reset_peak();
  else memory::reset_peak();
}

/// Memory in a MemorySpace: owning, move-only; freed through the space.
class SpaceAllocation {
 public:
  SpaceAllocation() = default;
  /// `bytes` of zeroed memory of `space` (not null) counted under `category`.
  SpaceAllocation(MemorySpace* space, std::size_t bytes, memory::Category category)
      : space_(space), bytes_(bytes), category_(category) {
    if (bytes > 0) data_ = space->allocate(bytes, category);
  }
  ~SpaceAllocation() {
    if (data_) space_->deallocate(data_, bytes_, category_);
  }
  SpaceAllocation(SpaceAllocation&& o) noexcept { swap(o); }
  SpaceAllocation& operator=(SpaceAllocation&& o) noexcept {
    SpaceAllocation(std::move(o)).swap(*this);
    return *this;
  }
  void swap(SpaceAllocation& o) noexcept {
    std::swap(space_, o.space_);
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(category_, o.category_);
  }
  /// Null for a default-constructed (or moved-from) allocation.
  MemorySpace* space() const { return space_; }
  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  MemorySpace* space_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  memory::Category category_ = memory::Category::Workspace;
};

/// A copy of host values (token ids, targets, positions, weights) in a memory space, for the
/// ops that read such arrays next to tensors in that space: counted there under `category`
/// (Workspace unless given: per-call arrays). With no space (host memory) an uncounted host
/// copy, like the std::vector it replaces.
template <class T>
class SpaceArray {
 public:
  SpaceArray() = default;
  explicit SpaceArray(std::span<const T> host, MemorySpace* space = current_memory_space(),
                      memory::Category category = memory::Category::Workspace)
      : size_(host.size()) {
    if (!space) {
      host_.assign(host.begin(), host.end());
      return;
    }
    block_ = SpaceAllocation(space, host.size_bytes(), category);
    if (!host.empty()) space->copy(block_.data(), host.data(), host.size_bytes());
  }
  /// The elements in the space (pass to ops only).
  const T* data() const { return block_.space() ? static_cast<const T*>(block_.data()) : host_.data(); }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  std::size_t size_ = 0;
  std::vector<T> host_;
  SpaceAllocation block_;
};

}  // namespace dsp
