#pragma once
// The grid-stride loop of the elementwise kernels as a range: `for (std::int64_t i :
// grid_stride(n))` visits every i in [0, n) once across the whole grid, thread t of the grid
// taking t, t + (threads in the grid), ... (64-bit indices). Device code: include from .cu files.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/grid_stride.cuh defines device code: include it from a .cu file compiled by nvcc"
#endif
#include <cstdint>

namespace dsp::backend::detail {

/// The indices this thread visits of [0, n) (see the top of this file).
class GridStride {
 public:
  struct Iterator {
    std::int64_t i, step;
    __device__ std::int64_t operator*() const { return i; }
    __device__ Iterator& operator++() {
      i += step;
      return *this;
    }
    __device__ bool operator!=(const Iterator& end) const { return i < end.i; }
  };
  __device__ explicit GridStride(std::int64_t n) : n_(n) {}
  __device__ Iterator begin() const {
    return {std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x, std::int64_t(gridDim.x) * blockDim.x};
  }
  __device__ Iterator end() const { return {n_, 0}; }

 private:
  std::int64_t n_;
};

__device__ inline GridStride grid_stride(std::int64_t n) { return GridStride(n); }

}  // namespace dsp::backend::detail
