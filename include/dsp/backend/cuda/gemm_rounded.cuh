#pragma once
// The Host gemm_rounded's contract on the GPU (backend/host/gemm_rounded.hpp): the used block
// of A and of B is rounded into a packed 16-bit temporary by one kernel (core/dtype.hpp's
// conversion, the Host's bits) and multiplied by cuBLAS with 16-bit inputs, fp32 accumulation
// and an fp32 C (the tensor cores' path: backend/cuda/gemm.hpp). The temporaries are device
// Workspace, freed in stream order.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/gemm_rounded.cuh uses CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/gemm.hpp"
#include "dsp/backend/cuda/grid_stride.cuh"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/backend/gemm_args.hpp"
#include "dsp/core/dtype.hpp"

namespace dsp::backend {

namespace detail {
// y [rows, cols] (packed) = x [rows, cols] (row stride ld) rounded to T.
template <class T>
__global__ void pack_rounded_kernel(std::int64_t rows, std::int64_t cols, const float* x, std::int64_t ld, T* y) {
  for (const std::int64_t i : grid_stride(rows * cols))
    y[i].bits = T::from_float(x[(i / cols) * ld + i % cols]);
}
template <class T>
DeviceBuffer<T> pack_rounded(Cuda b, const float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  DeviceBuffer<T> out(b, static_cast<std::size_t>(rows * cols), memory::Category::Workspace);
  if (rows * cols == 0) return out;
  pack_rounded_kernel<T>
      <<<elementwise_blocks(rows * cols), kBlockThreads, 0, b.stream>>>(rows, cols, x, ld, out.data());
  DSP_CUDA_CHECK(cudaGetLastError());
  return out;
}
}  // namespace detail

/// C[m, n] = alpha * op(round(A)) * op(round(B)) + beta * C on b.stream, A and B rounded to T
/// (bf16 or fp16) as the Host op rounds them; fp32 accumulation and C. Throws Error for bad
/// sizes or strides, CudaError when cuBLAS refuses or the temporaries cannot be allocated.
template <class T>
void gemm_rounded(Cuda backend, T, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                  float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta,
                  float* c, std::int64_t ldc) {
  if (!detail::check_gemm_args(trans_a, trans_b, m, n, k, lda, ldb, ldc)) return;
  const std::int64_t a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  const DeviceBuffer<T> ra = detail::pack_rounded<T>(backend, a, trans_a ? k : m, a_cols, lda);
  const DeviceBuffer<T> rb = detail::pack_rounded<T>(backend, b, trans_b ? n : k, b_cols, ldb);
  gemm(backend, trans_a, trans_b, m, n, k, alpha, ra.data(), std::max<std::int64_t>(1, a_cols), rb.data(),
       std::max<std::int64_t>(1, b_cols), beta, c, ldc);
}

}  // namespace dsp::backend
