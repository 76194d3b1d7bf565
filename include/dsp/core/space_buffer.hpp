#pragma once
// SpaceBuffer<T>: a flat, typed, zeroed buffer where the tensors live (the current memory space,
// core/memory_space.hpp, or host memory), counted under a memory category: the payloads of the
// gradient buckets, ZeRO's parameter slices and all-gather buffers, packed 16-bit activations.
// Communicators and ops take its raw_span(); host code copies its elements out (copy_elements)
// when it may be in another space.
#include <cstddef>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "dsp/core/memory.hpp"
#include "dsp/core/memory_space.hpp"

namespace dsp {

template <class T>
class SpaceBuffer {
 public:
  SpaceBuffer() = default;
  /// Moves keep the storage where it is; the moved-from buffer is empty.
  SpaceBuffer(SpaceBuffer&& o) noexcept
      : size_(std::exchange(o.size_, 0)), host_(std::move(o.host_)), block_(std::move(o.block_)) {}
  SpaceBuffer& operator=(SpaceBuffer&& o) noexcept {
    size_ = std::exchange(o.size_, 0);
    host_ = std::move(o.host_);
    block_ = std::move(o.block_);
    return *this;
  }
  /// n zeroed elements counted under `category`, in `space` (null: host memory, counted by
  /// memory::CountingAllocator). Throws what the space throws when it cannot provide them.
  SpaceBuffer(std::size_t n, memory::Category category, MemorySpace* space = current_memory_space())
      : size_(n), host_(memory::CountingAllocator<T>(category)) {
    if (space) block_ = SpaceAllocation(space, n * sizeof(T), category);
    else host_.resize(n, T{});
  }

  /// The elements wherever they live (pass to ops and communicators).
  T* data() { return block_.space() ? static_cast<T*>(block_.data()) : host_.data(); }
  const T* data() const { return block_.space() ? static_cast<const T*>(block_.data()) : host_.data(); }
  std::span<T> raw_span() { return {data(), size_}; }
  std::span<const T> raw_span() const { return {data(), size_}; }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  /// The memory space the elements are in; null for host memory.
  MemorySpace* space() const { return block_.space(); }

 private:
  std::size_t size_ = 0;
  std::vector<T, memory::CountingAllocator<T>> host_;
  SpaceAllocation block_;
};

/// Copies n elements from src to dst, each in `space`'s memory or host memory (null space: both
/// in host memory). With a space it is MemorySpace::copy: a copy between two device addresses
/// may only be enqueued on the space's stream.
template <class T>
void copy_elements(MemorySpace* space, T* dst, const T* src, std::size_t n) {
  if (n == 0) return;
  if (space) space->copy(dst, src, n * sizeof(T));
  else std::memcpy(dst, src, n * sizeof(T));
}

}  // namespace dsp
