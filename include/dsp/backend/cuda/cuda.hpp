#pragma once
// The CUDA backend tag.
#include <cuda_runtime.h>

namespace dsp::backend {

/// Tag of the CUDA backend. Every CUDA op takes `Cuda` as its first argument, as host ops take
/// `Host` (tag dispatch), and enqueues its work on `stream` of the calling thread's current
/// device (cudaSetDevice): an op returns without waiting for its result. Pointers are device
/// memory (DeviceBuffer), row-major and contiguous unless a leading dimension says otherwise.
/// The default `stream` (nullptr) is the legacy default stream, which orders against every
/// other blocking stream of the device.
struct Cuda {
  cudaStream_t stream = nullptr;
};

}  // namespace dsp::backend
