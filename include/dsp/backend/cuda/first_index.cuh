#pragma once
// The lowest index a kernel reports, for the ops that name the first bad input in order as
// the Host ops do (a NaN score, an expert out of range): kernels report with report_index, the
// host reads the result afterwards. Device code: include from .cu files.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/first_index.cuh defines device code: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/memory.hpp"

namespace dsp::backend::detail {

/// One device word on b.stream holding the lowest index reported so far (all ones: none).
class FirstIndex {
 public:
  explicit FirstIndex(Cuda b) : at_(b, 1, memory::Category::Workspace) {
    DSP_CUDA_CHECK(cudaMemsetAsync(at_.data(), 0xff, at_.bytes(), b.stream));
  }
  /// Where kernels report (report_index).
  unsigned long long* data() { return at_.data(); }
  /// The lowest index reported, or -1 when none; waits for the stream.
  std::int64_t read() const {
    const unsigned long long at = to_host(at_.backend(), at_.data(), 1)[0];
    return at == ~0ull ? -1 : static_cast<std::int64_t>(at);
  }

 private:
  DeviceBuffer<unsigned long long> at_;
};

/// Reports index i to a FirstIndex's word (the lowest report wins).
__device__ inline void report_index(unsigned long long* first, std::int64_t i) {
  atomicMin(first, static_cast<unsigned long long>(i));
}

}  // namespace dsp::backend::detail
