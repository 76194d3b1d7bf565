#pragma once
// What the two families of CUDA flash attention kernels share: the fp32 kernels on the CUDA
// cores (backend/cuda/flash_attention.cuh) and the 16-bit ones on the tensor cores
// (backend/cuda/flash_attention_mma.cuh). Warp reductions, the causal mask's visible keys per
// query row, the backward's D = rowsum(dO * O) kernel, the shape checks and the opt-in to more
// than 48 KiB of shared memory per block.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/flash_attention_common.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "dsp/backend/attention.hpp"
#include "dsp/backend/cuda/device.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/core/error.hpp"

namespace dsp::backend::detail {

/// Largest head_dim: the fp32 kernels' 8 register columns per lane and row.
inline constexpr std::int64_t kFlashMaxHeadDim = 256;
/// Shared memory a kernel gets without opting in.
inline constexpr std::size_t kFlashDefaultSharedBytes = 48 * 1024;

/// Maximum of v over the 32 lanes of the warp, returned to every lane (xor butterfly: every
/// lane combines the same values in the same tree, so all get the same bits).
template <class T>
__device__ __forceinline__ T flash_warp_max(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = other > v ? other : v;
  }
  return v;
}
/// Sum of v over the 32 lanes of the warp, returned to every lane, bitwise the same in each.
template <class T>
__device__ __forceinline__ T flash_warp_sum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

/// Keys query row i (of a batch's positions) sees: clamp(positions[i] + 1, 0, kv_len); 0 for a
/// row past q_len (the padding of a partial tile).
__device__ __forceinline__ std::int64_t flash_visible_keys(const std::int32_t* positions, std::int64_t i,
                                                           std::int64_t q_len, std::int64_t kv_len) {
  if (i >= q_len) return 0;
  const std::int64_t v = std::int64_t(positions[i]) + 1;
  return v < 0 ? 0 : (v > kv_len ? kv_len : v);
}

/// D [batch, q_heads, q_len] = rowsum(dout * out) over head_dim (fp64 sum as on the host), one
/// warp per row t = (b * q_len + i) * q_heads + h of out and dout [batch, q_len, q_heads,
/// head_dim]; a grid-stride loop over the rows.
template <int = 0>
__global__ void flash_attention_dout_dot_kernel(const float* out, const float* dout, std::int64_t rows,
                                                std::int64_t q_len, std::int64_t q_heads, int head_dim,
                                                float* dvec) {
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (std::int64_t t = std::int64_t(blockIdx.x) * warps + threadIdx.x / 32; t < rows;
       t += std::int64_t(gridDim.x) * warps) {
    double acc = 0.0;
    for (int c = lane; c < head_dim; c += 32) acc += double(dout[t * head_dim + c]) * out[t * head_dim + c];
    acc = flash_warp_sum(acc);
    if (lane == 0) {
      const std::int64_t h = t % q_heads, bi = t / q_heads, i = bi % q_len, b = bi / q_len;
      dvec[(b * q_heads + h) * q_len + i] = static_cast<float>(acc);
    }
  }
}

/// Lets `kernel` take `bytes` of dynamic shared memory on the current device: above the default
/// 48 KiB it opts in (cudaFuncAttributeMaxDynamicSharedMemorySize). Throws Error naming head_dim
/// when the device's opt-in limit per block is smaller, CudaError when a call fails.
template <class Kernel>
void flash_allow_shared_memory(Kernel* kernel, std::size_t bytes, std::int64_t head_dim) {
  if (bytes <= kFlashDefaultSharedBytes) return;
  int limit = 0;
  DSP_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, current_device()));
  DSP_CHECK(bytes <= static_cast<std::size_t>(limit), "flash_attention: head_dim=", head_dim, " needs ", bytes,
            " bytes of shared memory per block, the device allows ", limit);
  DSP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

/// check_attention_shape, head_dim <= kFlashMaxHeadDim, and the grid limits (y and z at most
/// 65535 blocks: heads and batch; x at most 2^31 - 1 tiles).
inline void check_flash_attention_shape(std::int64_t batch, std::int64_t q_len, std::int64_t kv_len,
                                        std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim) {
  check_attention_shape(q_heads, kv_heads, head_dim);
  DSP_CHECK(head_dim <= kFlashMaxHeadDim, "flash_attention: head_dim=", head_dim, " exceeds the CUDA kernels' ",
            kFlashMaxHeadDim);
  DSP_CHECK(batch >= 0 && q_len >= 0 && kv_len >= 0, "flash_attention: negative size (batch=", batch,
            ", q_len=", q_len, ", kv_len=", kv_len, ")");
  DSP_CHECK(batch <= 65535 && q_heads <= 65535 && kv_heads <= 65535, "flash_attention: batch=", batch,
            ", q_heads=", q_heads, " or kv_heads=", kv_heads, " exceeds the grid's 65535 blocks");
  // Counted in tiles of 32 rows, the smaller of the two kernel families' tiles.
  const std::int64_t tiles = (std::max(q_len, kv_len) + 31) / 32;
  DSP_CHECK(tiles <= std::numeric_limits<std::int32_t>::max(), "flash_attention: q_len=", q_len,
            " or kv_len=", kv_len, " exceeds the grid's 2^31 - 1 tiles");
}

}  // namespace dsp::backend::detail
