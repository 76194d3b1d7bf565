#pragma once
// Which CUDA devices there are, and waiting for a stream.
#include <cuda_runtime.h>

#include <string>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"

namespace dsp::backend {

/// Number of CUDA devices this process can use: 0, with the runtime's reason in `*why` when
/// `why` is given, when there is no device or no driver (cudaGetDeviceCount fails, e.g. with
/// cudaErrorNoDevice or cudaErrorInsufficientDriver). Never throws: "no GPU" is an answer.
inline int device_count(std::string* why = nullptr) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess) return n;
  (void)cudaGetLastError();  // clears the error, so that it does not surface in a later call
  if (why) *why = dsp::detail::concat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
  return 0;
}

/// The calling thread's current device (cudaSetDevice; 0 until set).
inline int current_device() {
  int d = 0;
  DSP_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

/// Blocks until everything enqueued on `b.stream` has finished. Throws CudaError when an
/// enqueued operation failed without poisoning the context; aborts when it did.
inline void synchronize(Cuda b) { DSP_CUDA_CHECK(cudaStreamSynchronize(b.stream)); }

}  // namespace dsp::backend
