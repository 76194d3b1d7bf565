#pragma once
// Owned CUDA streams and events (RAII): a Stream gives ops their own queue (Cuda{stream}), an
// Event orders one stream after another's work and times work on the GPU.
#include <cuda_runtime.h>

#include <utility>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"

namespace dsp::backend {

/// A CUDA stream of the current device, non-blocking (it does not order against the legacy
/// default stream). Move-only; destroyed with the object (work already enqueued still runs).
/// Throws CudaError when it cannot be created.
class Stream {
 public:
  Stream() { DSP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() {
    if (stream_) DSP_CUDA_CHECK_NOTHROW(cudaStreamDestroy(stream_));
  }
  Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  Stream& operator=(Stream&& other) noexcept {
    std::swap(stream_, other.stream_);
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const { return stream_; }
  /// The backend tag whose ops enqueue on this stream.
  Cuda backend() const { return Cuda{stream_}; }

 private:
  cudaStream_t stream_ = nullptr;
};

/// A CUDA event. record() marks the point reached by a stream's work so far; wait() makes
/// another stream's later work wait for it; elapsed_ms() times between two (timing events only:
/// an event only for ordering, timing = false, is cheaper to record). Move-only. Throws
/// CudaError on failure.
class Event {
 public:
  explicit Event(bool timing = true) {
    DSP_CUDA_CHECK(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  ~Event() {
    if (event_) DSP_CUDA_CHECK_NOTHROW(cudaEventDestroy(event_));
  }
  Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  Event& operator=(Event&& other) noexcept {
    std::swap(event_, other.event_);
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  /// Marks everything enqueued on `b.stream` so far.
  void record(Cuda b) { DSP_CUDA_CHECK(cudaEventRecord(event_, b.stream)); }
  /// Work enqueued on `b.stream` after this call starts only after the recorded work finished.
  /// Does not block the host.
  void wait(Cuda b) const { DSP_CUDA_CHECK(cudaStreamWaitEvent(b.stream, event_, 0)); }
  /// Blocks the host until the recorded work finished.
  void synchronize() const { DSP_CUDA_CHECK(cudaEventSynchronize(event_)); }
  /// True once the recorded work finished (never blocks).
  bool query() const {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    DSP_CUDA_CHECK(e);
    return true;
  }
  /// Milliseconds of GPU time from `start` to this event (both recorded and finished; the
  /// resolution is about 0.5 us, cudaEventElapsedTime).
  float elapsed_ms(const Event& start) const {
    float ms = 0.0f;
    DSP_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, event_));
    return ms;
  }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace dsp::backend
