#pragma once
// Attention over a paged KV cache on the GPU, the Host ops' contract (backend/host/
// paged_attention.hpp; the pool layout in backend/paged_kv.hpp): a ragged batch of tokens, each
// of its own sequence and position, reading its sequence's keys 0..position through the block
// table.
//
// One warp per (token, query head), keys in increasing order as on the host: the maximum score
// first, then the exponentials, their sum and sum_j e_j v_j, divided at the end. A score q . k
// is summed over head_dim by each lane over its dims (lane l takes d = l, l + 32, ...) and then
// by a fixed butterfly of warp shuffles, so a query's result depends on its own sequence alone:
// bitwise the same in a decode batch of 64, alone, or in a prefill chunk of any size. The
// scores are computed twice (once for the maximum) rather than kept, so a context of any length
// needs no scratch memory. A first kernel: no tiling over keys, no tensor cores.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/paged_attention.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/grid_stride.cuh"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/backend/paged_kv.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/error.hpp"

namespace dsp::backend {

namespace detail {

/// Most head dims per lane the warp kernel keeps in registers: head_dim <= 32 x 8 = 256.
inline constexpr int kPagedDimsPerLane = 8;

__device__ inline float paged_widen(float v) { return v; }
__device__ inline float paged_widen(bf16 v) { return bf16::to_float(v.bits); }
__device__ inline float paged_widen(fp16 v) { return fp16::to_float(v.bits); }
__device__ inline void paged_narrow(float v, float& out) { out = v; }
__device__ inline void paged_narrow(float v, bf16& out) { out.bits = bf16::from_float(v); }
__device__ inline void paged_narrow(float v, fp16& out) { out.bits = fp16::from_float(v); }

template <class T>
__global__ void paged_kv_write_kernel(PagedKvLayer kv, const float* k, const float* v, std::int64_t tokens,
                                      std::int64_t width) {
  T* pool = static_cast<T*>(kv.pool);
  for (const std::int64_t e : grid_stride(tokens * width)) {
    const std::int64_t t = e / width, i = e % width;
    T* row = pool + static_cast<std::int64_t>(kv.slots[t]) * 2 * width;
    paged_narrow(k[e], row[i]);
    paged_narrow(v[e], row[width + i]);
  }
}

// The sum of one value per lane by a fixed butterfly: every lane ends with the same bits.
__device__ inline float paged_warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

template <class T>
__global__ void paged_attention_kernel(PagedKvLayer kv, const float* q, const std::int32_t* positions,
                                       std::int64_t tokens, std::int64_t q_heads, std::int64_t kv_heads,
                                       std::int64_t head_dim, float* out) {
  const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (warp >= tokens * q_heads) return;
  const std::int64_t t = warp / q_heads, h = warp % q_heads, g = h / (q_heads / kv_heads);
  const T* pool = static_cast<const T*>(kv.pool);
  const std::int64_t row = 2 * kv_heads * head_dim, keys = static_cast<std::int64_t>(positions[t]) + 1;
  const std::int32_t* table = kv.block_tables + static_cast<std::int64_t>(kv.token_seq[t]) * kv.max_blocks;
  const float scale = 1.0f / sqrtf(static_cast<float>(head_dim));
  float qd[kPagedDimsPerLane], acc[kPagedDimsPerLane];
  for (int s = 0; s < kPagedDimsPerLane; ++s) {
    const std::int64_t d = lane + 32 * s;
    qd[s] = d < head_dim ? q[(t * q_heads + h) * head_dim + d] : 0.0f;
    acc[s] = 0.0f;
  }
  const auto key_row = [&](std::int64_t j) {
    return pool + (static_cast<std::int64_t>(table[j / kv.block_size]) * kv.block_size + j % kv.block_size) * row;
  };
  const auto score = [&](const T* r) {
    float partial = 0.0f;
    for (int s = 0; s < kPagedDimsPerLane; ++s) {
      const std::int64_t d = lane + 32 * s;
      if (d < head_dim) partial += qd[s] * paged_widen(r[g * head_dim + d]);
    }
    return paged_warp_sum(partial) * scale;
  };
  float top = -INFINITY;
  for (std::int64_t j = 0; j < keys; ++j) top = fmaxf(top, score(key_row(j)));
  float sum = 0.0f;
  for (std::int64_t j = 0; j < keys; ++j) {
    const T* r = key_row(j);
    const float e = expf(score(r) - top);
    sum += e;
    for (int s = 0; s < kPagedDimsPerLane; ++s) {
      const std::int64_t d = lane + 32 * s;
      if (d < head_dim) acc[s] += e * paged_widen(r[(kv_heads + g) * head_dim + d]);
    }
  }
  for (int s = 0; s < kPagedDimsPerLane; ++s) {
    const std::int64_t d = lane + 32 * s;
    if (d < head_dim) out[(t * q_heads + h) * head_dim + d] = acc[s] / sum;
  }
}

}  // namespace detail

/// The Host paged_kv_write on b.stream: k and v [tokens, kv_heads, head_dim] (device memory)
/// into their pool rows kv.slots[t], rounded to the pool's dtype to nearest even (the Host
/// op's bits). Throws CudaError when the launch fails.
inline void paged_kv_write(Cuda b, const PagedKvLayer& kv, const float* k, const float* v, std::int64_t tokens,
                           std::int64_t kv_heads, std::int64_t head_dim) {
  const std::int64_t width = kv_heads * head_dim;
  if (tokens * width == 0) return;
  with_kv_cache_type(kv.dtype, [&]<class T>(T) {
    detail::paged_kv_write_kernel<T>
        <<<detail::elementwise_blocks(tokens * width), detail::kBlockThreads, 0, b.stream>>>(kv, k, v, tokens, width);
  });
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host paged_attention_forward on b.stream: out [tokens, q_heads, head_dim] = causal
/// attention of each query q [tokens, q_heads, head_dim] over its own sequence's keys 0..
/// positions[t] in the pool (every pointer, kv's included, in device memory). Batch-invariant
/// (see the header comment); equal to the Host op within float rounding (the lane order of the
/// dot products differs). Throws Error for a q_heads that is not a multiple of kv_heads or a
/// head_dim over 256, CudaError when the launch fails. Positions are not checked (device memory).
inline void paged_attention_forward(Cuda b, const PagedKvLayer& kv, const float* q, const std::int32_t* positions,
                                    std::int64_t tokens, std::int64_t q_heads, std::int64_t kv_heads,
                                    std::int64_t head_dim, float* out) {
  DSP_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "paged attention: q_heads=", q_heads,
            " is not a multiple of kv_heads=", kv_heads);
  DSP_CHECK(head_dim > 0 && head_dim <= 32 * detail::kPagedDimsPerLane, "paged attention: head_dim=", head_dim,
            " is over the CUDA kernel's ", 32 * detail::kPagedDimsPerLane);
  const std::int64_t warps = tokens * q_heads;
  if (warps == 0) return;
  const std::int64_t per_block = detail::kBlockThreads / 32;
  const auto blocks = static_cast<unsigned>((warps + per_block - 1) / per_block);
  with_kv_cache_type(kv.dtype, [&]<class T>(T) {
    detail::paged_attention_kernel<T>
        <<<blocks, detail::kBlockThreads, 0, b.stream>>>(kv, q, positions, tokens, q_heads, kv_heads, head_dim, out);
  });
  DSP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsp::backend
