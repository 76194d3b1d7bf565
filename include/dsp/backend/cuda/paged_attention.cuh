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

/// Dims per lane the warp kernel keeps in registers: 8 (a head_dim up to 256: GQA), or 20 (up
/// to 640: MLA's latent, DeepSeek-V3's 512 + 64).
inline constexpr int kPagedDimsPerLane = 8, kPagedLatentDimsPerLane = 20;

__device__ inline float paged_widen(float v) { return v; }
__device__ inline float paged_widen(bf16 v) { return bf16::to_float(v.bits); }
__device__ inline float paged_widen(fp16 v) { return fp16::to_float(v.bits); }
__device__ inline void paged_narrow(float v, float& out) { out = v; }
__device__ inline void paged_narrow(float v, bf16& out) { out.bits = bf16::from_float(v); }
__device__ inline void paged_narrow(float v, fp16& out) { out.bits = fp16::from_float(v); }

template <class T>
__global__ void paged_rows_write_kernel(PagedKvLayer kv, const float* src, std::int64_t tokens, std::int64_t width,
                                        std::int64_t row, std::int64_t offset) {
  T* pool = static_cast<T*>(kv.pool);
  for (const std::int64_t e : grid_stride(tokens * width)) {
    const std::int64_t t = e / width, i = e % width;
    paged_narrow(src[e], pool[static_cast<std::int64_t>(kv.slots[t]) * row + offset + i]);
  }
}

// The sum of one value per lane by a fixed butterfly: every lane ends with the same bits.
__device__ inline float paged_warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// One warp per (token, query head) over the rows of layout l (backend/paged_kv.hpp).
template <class T, int kDims>
__global__ void paged_attention_kernel(PagedKvLayer kv, PagedRowLayout l, const float* q,
                                       const std::int32_t* positions, std::int64_t tokens, std::int64_t q_heads,
                                       float* out) {
  const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (warp >= tokens * q_heads) return;
  const std::int64_t t = warp / q_heads, h = warp % q_heads, g = h / (q_heads / l.kv_heads);
  const T* pool = static_cast<const T*>(kv.pool);
  const std::int64_t keys = static_cast<std::int64_t>(positions[t]) + 1;
  const std::int32_t* table = kv.block_tables + static_cast<std::int64_t>(kv.token_seq[t]) * kv.max_blocks;
  float qd[kDims], acc[kDims];
  for (int s = 0; s < kDims; ++s) {
    const std::int64_t d = lane + 32 * s;
    qd[s] = d < l.key_dim ? q[(t * q_heads + h) * l.key_dim + d] : 0.0f;
    acc[s] = 0.0f;
  }
  const auto key_row = [&](std::int64_t j) {
    return pool + (static_cast<std::int64_t>(table[j / kv.block_size]) * kv.block_size + j % kv.block_size) * l.row;
  };
  const auto score = [&](const T* r) {
    float partial = 0.0f;
    for (int s = 0; s < kDims; ++s) {
      const std::int64_t d = lane + 32 * s;
      if (d < l.key_dim) partial += qd[s] * paged_widen(r[g * l.key_dim + d]);
    }
    return paged_warp_sum(partial) * l.scale;
  };
  float top = -INFINITY;
  for (std::int64_t j = 0; j < keys; ++j) top = fmaxf(top, score(key_row(j)));
  float sum = 0.0f;
  for (std::int64_t j = 0; j < keys; ++j) {
    const T* r = key_row(j);
    const float e = expf(score(r) - top);
    sum += e;
    for (int s = 0; s < kDims; ++s) {
      const std::int64_t d = lane + 32 * s;
      if (d < l.value_dim) acc[s] += e * paged_widen(r[l.value_base + g * l.value_dim + d]);
    }
  }
  for (int s = 0; s < kDims; ++s) {
    const std::int64_t d = lane + 32 * s;
    if (d < l.value_dim) out[(t * q_heads + h) * l.value_dim + d] = acc[s] / sum;
  }
}

// Every (token, query head) of a ragged batch through the warp kernel, with registers for the
// layout's widest key or value.
inline void paged_attention_batch(Cuda b, const PagedKvLayer& kv, const PagedRowLayout& l, const float* q,
                                  const std::int32_t* positions, std::int64_t tokens, std::int64_t q_heads,
                                  float* out) {
  DSP_CHECK(l.kv_heads > 0 && q_heads % l.kv_heads == 0, "paged attention: q_heads=", q_heads,
            " is not a multiple of kv_heads=", l.kv_heads);
  const std::int64_t widest = l.key_dim > l.value_dim ? l.key_dim : l.value_dim;
  DSP_CHECK(widest > 0 && widest <= 32 * kPagedLatentDimsPerLane, "paged attention: a key or value of ", widest,
            " values is over the CUDA kernel's ", 32 * kPagedLatentDimsPerLane);
  const std::int64_t warps = tokens * q_heads;
  if (warps == 0) return;
  const std::int64_t per_block = kBlockThreads / 32;
  const auto blocks = static_cast<unsigned>((warps + per_block - 1) / per_block);
  with_kv_cache_type(kv.dtype, [&]<class T>(T) {
    if (widest <= 32 * kPagedDimsPerLane)
      paged_attention_kernel<T, kPagedDimsPerLane><<<blocks, kBlockThreads, 0, b.stream>>>(kv, l, q, positions, tokens,
                                                                                           q_heads, out);
    else
      paged_attention_kernel<T, kPagedLatentDimsPerLane>
          <<<blocks, kBlockThreads, 0, b.stream>>>(kv, l, q, positions, tokens, q_heads, out);
  });
  DSP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace detail

/// The Host paged_rows_write on b.stream: `width` values of each token, src [tokens, width]
/// (device memory), into its pool row kv.slots[t] (rows of `row` values) from value `offset`
/// on, rounded to the pool's dtype to nearest even (the Host op's bits). Throws CudaError when
/// the launch fails.
inline void paged_rows_write(Cuda b, const PagedKvLayer& kv, const float* src, std::int64_t tokens, std::int64_t width,
                             std::int64_t row, std::int64_t offset) {
  if (tokens * width == 0) return;
  with_kv_cache_type(kv.dtype, [&]<class T>(T) {
    detail::paged_rows_write_kernel<T><<<detail::elementwise_blocks(tokens * width), detail::kBlockThreads, 0,
                                         b.stream>>>(kv, src, tokens, width, row, offset);
  });
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host paged_kv_write on b.stream: k and v [tokens, kv_heads, head_dim] (device memory)
/// into their pool rows kv.slots[t], rounded to the pool's dtype to nearest even (the Host
/// op's bits). Throws CudaError when the launch fails.
inline void paged_kv_write(Cuda b, const PagedKvLayer& kv, const float* k, const float* v, std::int64_t tokens,
                           std::int64_t kv_heads, std::int64_t head_dim) {
  const std::int64_t width = kv_heads * head_dim;
  paged_rows_write(b, kv, k, tokens, width, 2 * width, 0);
  paged_rows_write(b, kv, v, tokens, width, 2 * width, width);
}

/// The Host paged_attention_forward on b.stream: out [tokens, q_heads, head_dim] = causal
/// attention of each query q [tokens, q_heads, head_dim] over its own sequence's keys 0..
/// positions[t] in the pool (every pointer, kv's included, in device memory). Batch-invariant
/// (see the header comment); equal to the Host op within float rounding (the lane order of the
/// dot products differs). Throws Error for a q_heads that is not a multiple of kv_heads or a
/// head_dim over 640, CudaError when the launch fails. Positions are not checked (device memory).
inline void paged_attention_forward(Cuda b, const PagedKvLayer& kv, const float* q, const std::int32_t* positions,
                                    std::int64_t tokens, std::int64_t q_heads, std::int64_t kv_heads,
                                    std::int64_t head_dim, float* out) {
  const detail::PagedRowLayout l{2 * kv_heads * head_dim, kv_heads, head_dim, head_dim, kv_heads * head_dim,
                                 1.0f / sqrtf(static_cast<float>(head_dim))};
  detail::paged_attention_batch(b, kv, l, q, positions, tokens, q_heads, out);
}

/// The Host paged_latent_attention_forward on b.stream (MLA's absorbed form): query head h of
/// token t, q [tokens, q_heads, width], scores row j of its sequence ([width] latents) by q .
/// row_j x scale and reads the row's first value_dim values as its value: out [tokens,
/// q_heads, value_dim]. Causal, batch-invariant and within float rounding of the Host op as
/// paged_attention_forward. Throws Error for value_dim > width or a width over 640, CudaError
/// when the launch fails.
inline void paged_latent_attention_forward(Cuda b, const PagedKvLayer& kv, const float* q,
                                           const std::int32_t* positions, std::int64_t tokens, std::int64_t q_heads,
                                           std::int64_t width, std::int64_t value_dim, float scale, float* out) {
  DSP_CHECK(value_dim > 0 && value_dim <= width, "paged latent attention: value_dim ", value_dim,
            " outside (0, width ", width, "]");
  detail::paged_attention_batch(b, kv, {width, 1, width, value_dim, 0, scale}, q, positions, tokens, q_heads, out);
}

}  // namespace dsp::backend
