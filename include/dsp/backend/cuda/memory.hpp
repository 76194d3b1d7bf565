#pragma once
// Device memory: stream-ordered allocation from the device's default memory pool
// (cudaMallocAsync / cudaFreeAsync, CUDA Programming Guide "Stream Ordered Memory Allocator"),
// counted per allocating thread and per category exactly as host memory is (core/memory.hpp:
// the memory ledger's categories), in counters of its own so that host and device bytes are
// never mixed. With one GPU per rank thread, a thread's device counters are its rank's.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/device.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/core/memory.hpp"

namespace dsp::memory {

namespace detail {
inline Snapshot& device_counters() {
  thread_local Snapshot s;
  return s;
}
}  // namespace detail

/// The calling thread's device-memory counters now (bytes of live DeviceBuffers it allocated,
/// per category, and their peaks).
inline Snapshot device_snapshot() { return detail::device_counters(); }
/// Bytes of device memory the calling thread holds now through DeviceBuffers.
inline std::int64_t device_live_bytes() { return detail::device_counters().total.live; }
/// Most device bytes the calling thread held at once since it started or reset_device_peak().
inline std::int64_t device_peak_bytes() { return detail::device_counters().total.peak; }
/// Starts a new device peak measurement (every category and the total) at the live bytes.
inline void reset_device_peak() { detail::reset_peak(detail::device_counters()); }

}  // namespace dsp::memory

namespace dsp::backend {

/// Whether p is device (or managed) memory, where kernels and NCCL may read it; host memory,
/// pageable (cudaMemoryTypeUnregistered) or pinned (cudaMemoryTypeHost), and null are not.
inline bool device_pointer(const void* p) {
  if (!p) return false;
  cudaPointerAttributes a{};
  DSP_CUDA_CHECK(cudaPointerGetAttributes(&a, p));
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

namespace detail {
/// `bytes` of device memory allocated on `stream` (null for 0 bytes), counted in the calling
/// thread's device counters under `category`; throws CudaError naming the bytes when the pool
/// cannot provide them. Uninitialised.
inline void* device_allocate(cudaStream_t stream, std::size_t bytes, memory::Category category) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  const cudaError_t e = cudaMallocAsync(&p, bytes, stream);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw CudaError(dsp::detail::concat("cannot allocate ", bytes, " bytes of device memory (", cudaGetErrorName(e), ")"));
  }
  DSP_CUDA_CHECK(e);
  memory::detail::add(memory::detail::device_counters(), category, static_cast<std::int64_t>(bytes));
  return p;
}
/// Frees (in the order of `stream`) and uncounts what device_allocate returned.
inline void device_free(void* p, cudaStream_t stream, std::size_t bytes, memory::Category category) noexcept {
  if (!p) return;
  DSP_CUDA_CHECK_NOTHROW(cudaFreeAsync(p, stream));
  memory::detail::add(memory::detail::device_counters(), category, -static_cast<std::int64_t>(bytes));
}
}  // namespace detail

/// `size` elements of T in device memory, allocated on and freed on one stream (stream-ordered:
/// work enqueued on that stream may use it at once). Contents are uninitialised. Counted in the
/// device counters of the allocating thread under its category (the current category unless
/// given). Move-only. Throws CudaError when the allocation fails (the message names
/// cudaErrorMemoryAllocation and the bytes asked for).
/// Rules for other streams: work on another stream may use the buffer only after waiting for an
/// event recorded on the buffer's stream after the allocation; and the destructor frees it in
/// the order of the buffer's stream only, so before the buffer is destroyed its stream must wait
/// for an event recorded after the other streams' last use (or those streams are synchronised).
/// The stream must outlive the buffer.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Cuda b, std::size_t size, memory::Category category = memory::current_category())
      : data_(static_cast<T*>(detail::device_allocate(b.stream, size * sizeof(T), category))),
        stream_(b.stream),
        size_(size),
        category_(category) {}
  ~DeviceBuffer() { release(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept { swap(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    DeviceBuffer(std::move(other)).swap(*this);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::size_t bytes() const { return size_ * sizeof(T); }
  memory::Category category() const { return category_; }
  /// The stream it was allocated on (and will be freed on).
  Cuda backend() const { return Cuda{stream_}; }

 private:
  void swap(DeviceBuffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(stream_, other.stream_);
    std::swap(size_, other.size_);
    std::swap(category_, other.category_);
  }
  void release() noexcept {
    detail::device_free(data_, stream_, bytes(), category_);
    data_ = nullptr;
  }

  T* data_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::size_t size_ = 0;
  memory::Category category_ = memory::Category::Workspace;
};

/// n floats of per-call device scratch for an op written for every backend (attention's score
/// matrix, say), on b.stream, counted as Workspace; contents uninitialised.
inline DeviceBuffer<float> scratch(Cuda b, std::int64_t n) {
  return DeviceBuffer<float>(b, static_cast<std::size_t>(n), memory::Category::Workspace);
}

/// A new device buffer holding a copy of `host` (enqueued on b.stream; `host` may be reused
/// once this returns: pageable memory is staged before cudaMemcpyAsync returns).
template <class T>
DeviceBuffer<T> to_device(Cuda b, std::span<const T> host, memory::Category category = memory::current_category()) {
  DeviceBuffer<T> d(b, host.size(), category);
  if (!host.empty())
    DSP_CUDA_CHECK(cudaMemcpyAsync(d.data(), host.data(), d.bytes(), cudaMemcpyHostToDevice, b.stream));
  return d;
}

/// The contents of `n` elements at device pointer `d`, after everything enqueued on b.stream so
/// far (waits for the stream).
template <class T>
std::vector<T> to_host(Cuda b, const T* d, std::size_t n) {
  std::vector<T> host(n);
  if (n) DSP_CUDA_CHECK(cudaMemcpyAsync(host.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost, b.stream));
  synchronize(b);
  return host;
}

}  // namespace dsp::backend
