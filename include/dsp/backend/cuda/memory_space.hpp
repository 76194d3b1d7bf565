#pragma once
// The CUDA memory space: tensors (core/tensor.hpp) in a device's memory, allocated
// stream-ordered on one stream and counted in the device counters (backend/cuda/memory.hpp).
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <optional>
#include <mutex>
#include <utility>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/device.hpp"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/core/memory_space.hpp"

namespace dsp::backend {

/// Page-locked host memory (cudaHostAlloc, portable: usable with every device), which devices
/// copy to and from asynchronously at full PCIe / NVLink-C2C speed: where ZeRO-Offload keeps
/// the optimizer state the CPU updates. Counted in the allocating thread's host counters
/// (core/memory.hpp) under the category given, like ordinary host memory (not in its own
/// counters). Its copy() is between host and pinned memory only (a memcpy); copies to and from
/// a device go through the device's space (copy, copy_async), which orders them on its stream.
class CudaPinnedHostSpace final : public MemorySpace {
 public:
  std::string_view name() const override { return "cuda pinned host"; }
  void* allocate(std::size_t bytes, memory::Category category) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    DSP_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
    std::memset(p, 0, bytes);
    memory::detail::add(memory::detail::thread_state().counters, category, static_cast<std::int64_t>(bytes));
    return p;
  }
  void deallocate(void* p, std::size_t bytes, memory::Category category) noexcept override {
    if (!p) return;
    DSP_CUDA_CHECK_NOTHROW(cudaFreeHost(p));
    memory::detail::add(memory::detail::thread_state().counters, category, -static_cast<std::int64_t>(bytes));
  }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    DSP_CHECK(!device_pointer(dst) && !device_pointer(src),
              "cuda pinned host: copies to or from device memory go through the device's memory space");
    std::memcpy(dst, src, bytes);
  }
  void zero(void* p, std::size_t bytes) override {
    if (bytes) std::memset(p, 0, bytes);
  }
};

/// Device memory of one device, ordered on one of its streams: allocation,
/// zeroing and copies are enqueued there, so ops enqueued on the same stream (the backend's)
/// may use a tensor at once. A copy to or from host memory waits for the stream before it
/// returns (host code reads what it copied out); one between two device buffers is only
/// enqueued; one between two host buffers is a memcpy. copy_async to or from pinned_host()
/// memory (CudaPinnedHostSpace, shared by every device) is only enqueued; synchronize() waits
/// for the stream. Every call works on the space's own device whichever is current (and
/// restores that one).
class CudaMemorySpace final : public MemorySpace {
 public:
  /// Memory of `device` ordered on b.stream (a stream of that device).
  CudaMemorySpace(Cuda b, int device) : stream_(b.stream), device_(device) {}
  std::string_view name() const override { return "cuda"; }
  void* allocate(std::size_t bytes, memory::Category category) override {
    const OnDevice on(device_);
    void* p = detail::device_allocate(stream_, bytes, category);
    if (!p) return p;
    try {
      DSP_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    } catch (...) {
      detail::device_free(p, stream_, bytes, category);
      throw;
    }
    return p;
  }
  void deallocate(void* p, std::size_t bytes, memory::Category category) noexcept override {
    int previous = 0;  // OnDevice without throwing: a destructor's path
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
                          cudaSetDevice(device_) == cudaSuccess;
    detail::device_free(p, stream_, bytes, category);
    if (switched) (void)cudaSetDevice(previous);
  }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    const bool dst_device = device_pointer(dst), src_device = device_pointer(src);
    if (!dst_device && !src_device) {  // host to host (StagingComm's host payloads)
      std::memcpy(dst, src, bytes);
      return;
    }
    const OnDevice on(device_);
    DSP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));  // direction from UVA
    if (!dst_device || !src_device) DSP_CUDA_CHECK(cudaStreamSynchronize(stream_));  // host memory involved
  }
  void zero(void* p, std::size_t bytes) override {
    const OnDevice on(device_);
    if (bytes) DSP_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
  }
  MemorySpace* pinned_host() override {
    static auto* pinned = new CudaPinnedHostSpace;  // never destroyed: outlives every device space
    return pinned;
  }
  void copy_async(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    const OnDevice on(device_);
    DSP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
  }
  void synchronize() override {
    const OnDevice on(device_);
    DSP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  /// The calling thread's device counters (backend/cuda/memory.hpp: a thread's device memory,
  /// of whichever device and stream, is counted there).
  std::optional<memory::Snapshot> snapshot() const override { return memory::device_snapshot(); }
  void reset_peak() override { memory::reset_device_peak(); }
  /// The device's total memory (cudaMemGetInfo).
  std::optional<std::int64_t> capacity_bytes() const override {
    const OnDevice on(device_);
    std::size_t free = 0, total = 0;
    DSP_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return static_cast<std::int64_t>(total);
  }
  Cuda backend() const { return Cuda{stream_}; }
  int device() const { return device_; }

 private:
  // Makes `device` current for a scope (tensors may be freed at process exit from another
  // thread than their rank's), restoring the previous one.
  class OnDevice {
   public:
    explicit OnDevice(int device) {
      DSP_CUDA_CHECK(cudaGetDevice(&previous_));
      if (previous_ != device) DSP_CUDA_CHECK(cudaSetDevice(device));
      switched_ = previous_ != device;
    }
    ~OnDevice() {
      if (switched_) (void)cudaSetDevice(previous_);
    }
    OnDevice(const OnDevice&) = delete;
    OnDevice& operator=(const OnDevice&) = delete;

   private:
    int previous_ = 0;
    bool switched_ = false;
  };

  cudaStream_t stream_;
  int device_;
};

/// The memory space of backend `b`: tensors in the calling thread's current device's memory
/// ordered on b.stream. One space per (device, stream), created on first use and never
/// destroyed: tensors that a failing rank keeps for in-flight communication are freed at
/// process exit (comm::detail::keep_until_exit), after the rank's thread has ended.
inline MemorySpace* memory_space(Cuda b) {
  static std::mutex mu;
  static auto* spaces = new std::map<std::pair<int, cudaStream_t>, CudaMemorySpace*>;  // never freed, see above
  const int device = current_device();
  std::lock_guard lock(mu);
  CudaMemorySpace*& s = (*spaces)[{device, b.stream}];
  if (!s) s = new CudaMemorySpace(b, device);
  return s;
}

}  // namespace dsp::backend
