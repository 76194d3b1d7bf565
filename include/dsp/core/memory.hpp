#pragma once
// Host memory accounting: live and peak bytes of tensor storage, per allocating thread (with
// ranks as threads, per rank). Tensor storage allocates through CountingAllocator, so every
// activation, gradient and temporary a rank's thread creates is counted. Storage freed by
// another thread than the one that allocated it is subtracted from the freeing thread's count
// (tensors here stay on their rank's thread and the communication threads allocate none; the
// exception is the failure path, where buffers kept for in-flight communication are freed at
// process exit).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace dsp::memory {

/// Live and peak bytes of tensor storage of one thread.
struct Counter {
  std::int64_t live = 0;  ///< bytes allocated and not yet freed
  std::int64_t peak = 0;  ///< largest `live` since the thread started or reset_peak()
};

/// The calling thread's counter.
inline Counter& thread_counter() {
  thread_local Counter c;
  return c;
}
/// Bytes of tensor storage the calling thread holds now.
inline std::int64_t live_bytes() { return thread_counter().live; }
/// Most bytes the calling thread held at once since it started or the last reset_peak().
inline std::int64_t peak_bytes() { return thread_counter().peak; }
/// Starts a new peak measurement at the current live bytes.
inline void reset_peak() { thread_counter().peak = thread_counter().live; }

/// std::allocator that counts bytes in the calling thread's Counter.
template <class T>
struct CountingAllocator {
  using value_type = T;
  CountingAllocator() = default;
  template <class U>
  CountingAllocator(const CountingAllocator<U>&) noexcept {}

  T* allocate(std::size_t n) {
    T* p = std::allocator<T>{}.allocate(n);
    Counter& c = thread_counter();
    c.live += static_cast<std::int64_t>(n * sizeof(T));
    c.peak = std::max(c.peak, c.live);
    return p;
  }
  void deallocate(T* p, std::size_t n) noexcept {
    thread_counter().live -= static_cast<std::int64_t>(n * sizeof(T));
    std::allocator<T>{}.deallocate(p, n);
  }
  template <class U>
  bool operator==(const CountingAllocator<U>&) const noexcept {
    return true;
  }
};

}  // namespace dsp::memory
