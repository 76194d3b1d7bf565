#pragma once
// The cuBLAS handles the CUDA ops share: one per thread, device and stream.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <map>
#include <utility>

#include "dsp/backend/cuda/error.hpp"

namespace dsp::backend::detail {

/// A cuBLAS handle bound to `stream` of the calling thread's current device: one per (thread,
/// device, stream), created on first use and destroyed when the thread ends. Per stream because
/// a handle's workspace is used by whatever its calls run on (cublasSetStream resets it to the
/// default pool): two streams sharing one handle could run GEMMs over the same scratch at once.
/// Per thread because a handle is not safe to share between host threads (cuBLAS
/// documentation, "Thread Safety").
inline cublasHandle_t cublas_handle(cudaStream_t stream) {
  struct Handles {
    std::map<std::pair<int, cudaStream_t>, cublasHandle_t> by_device_stream;
    ~Handles() {
      for (auto& [key, h] : by_device_stream) (void)cublasDestroy(h);  // at exit: nothing left to report to
    }
  };
  thread_local Handles handles;
  int device = 0;
  DSP_CUDA_CHECK(cudaGetDevice(&device));
  auto it = handles.by_device_stream.find({device, stream});
  if (it == handles.by_device_stream.end()) {
    cublasHandle_t h = nullptr;
    DSP_CUBLAS_CHECK(cublasCreate(&h));
    try {
      DSP_CUBLAS_CHECK(cublasSetStream(h, stream));
    } catch (...) {
      (void)cublasDestroy(h);
      throw;
    }
    it = handles.by_device_stream.emplace(std::pair{device, stream}, h).first;
  }
  return it->second;
}

}  // namespace dsp::backend::detail
