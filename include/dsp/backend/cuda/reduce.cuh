#pragma once
// Block-wide reductions for the row kernels (one block per row): warp shuffles, then one
// value per warp through shared memory. Defines device code: include from .cu files (nvcc).
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/reduce.cuh defines device code: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

namespace dsp::backend::detail {

struct SumOp {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};

/// op over `v` of every thread of the block, returned to every thread. blockDim.x must be a
/// multiple of 32, at most 1024; every thread of the block must call it (it synchronises). The
/// order of the combination is fixed by the block size, so results repeat run to run.
template <class T, class Op>
__device__ T block_reduce(T v, Op op) {
  __shared__ T warp_partials[32];
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // a previous call's readers are done with warp_partials
  if (lane == 0) warp_partials[warp] = v;
  __syncthreads();
  T result = warp_partials[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) result = op(result, warp_partials[w]);
  return result;
}

/// Sum over the block (block_reduce's rules).
template <class T>
__device__ T block_sum(T v) {
  return block_reduce(v, SumOp{});
}
/// Maximum over the block (block_reduce's rules).
template <class T>
__device__ T block_max(T v) {
  return block_reduce(v, MaxOp{});
}

}  // namespace dsp::backend::detail
