#pragma once
// The CUDA memory space: tensors (core/tensor.hpp) in the current device's memory, allocated
// stream-ordered on one stream and counted in the device counters (backend/cuda/memory.hpp).
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/device.hpp"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/core/memory_space.hpp"

namespace dsp::backend {

/// Device memory of the calling thread's current device, ordered on one stream: allocation,
/// zeroing and copies are enqueued there, so ops enqueued on the same stream (the backend's)
/// may use a tensor at once. A copy to or from host memory waits for the stream before it
/// returns (host code reads what it copied out; pageable host memory is not pinned).
class CudaMemorySpace final : public MemorySpace {
 public:
  explicit CudaMemorySpace(Cuda b) : stream_(b.stream) {}
  std::string_view name() const override { return "cuda"; }
  void* allocate(std::size_t bytes, memory::Category category) override {
    void* p = detail::device_allocate(stream_, bytes, category);
    if (p) DSP_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    return p;
  }
  void deallocate(void* p, std::size_t bytes, memory::Category category) noexcept override {
    detail::device_free(p, stream_, bytes, category);
  }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    DSP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));  // direction from UVA
    DSP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void zero(void* p, std::size_t bytes) override {
    if (bytes) DSP_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
  }
  Cuda backend() const { return Cuda{stream_}; }

 private:
  cudaStream_t stream_;
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
  if (!s) s = new CudaMemorySpace(b);
  return s;
}

}  // namespace dsp::backend
