#pragma once
// Memory-efficient causal attention on the GPU: the CUDA form of the Host op
// (backend/host/flash_attention.hpp), with its contract exactly (FlashAttention-2, Dao 2023,
// "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning",
// algorithms 1 and 2). The scores never leave the chip: only out and the per-row log-sum-exp
// lse [batch, q_heads, q_len] are written, and the backward recomputes P = exp(S - lse).
//
// Tiling: query and key tiles of kFlashTile = 32 rows; one warp lane per key (forward, dQ) or
// per query row (dK/dV) of a tile, so the softmax statistics of a row are warp reductions.
// - forward: one block of 4 warps per (query tile, q head, batch), 8 query rows per warp. The Q
//   tile stays in shared memory; the loop over key tiles stops at the tile's last visible key
//   (the most keys any of its rows sees), so fully masked tiles are never loaded. Online
//   softmax per row (running max m, running sum l, O rescaled by exp(m_old - m_new)), out = O / l
//   and lse = m + log(l) at the end (algorithm 1).
// - backward (algorithm 2, split in two passes so that nothing is accumulated with atomics):
//   D = rowsum(dO * O) (one warp per row, fp64 sum as on the host); dK and dV by one block of
//   8 warps per (key tile, kv head, batch), 4 keys per warp, looping over the q heads of the
//   group and the query tiles that see any key of the tile; dQ by one block of 4 warps per
//   (query tile, q head, batch) looping over its visible key tiles. Every output element is
//   summed by one thread in a fixed order and written once: the backward is deterministic
//   (bitwise equal from run to run).
// Shared memory (dynamic, sized from head_dim): tiles of 32 rows with a row stride of
// head_dim rounded up to odd (head_dim | 1, so that 32 lanes reading one column of 32 rows hit
// 32 different banks): forward Q, K, V (3 tiles), backward Q, dO, K, V (4 tiles), i.e.
// 3 * 32 * (head_dim | 1) * 4 and 4 * 32 * (head_dim | 1) * 4 bytes: 15.4 / 20.5 KiB at
// head_dim 40, 48.4 / 64.5 KiB at 128, 96.4 / 128.5 KiB at 256. Above 48 KiB the kernel is
// opted in (cudaFuncAttributeMaxDynamicSharedMemorySize; sm_80 allows 163 KiB per block,
// sm_90 227 KiB). The O, dQ, dK and dV accumulators are registers: each lane holds the columns
// lane, lane + 32, ... of its warp's rows (head_dim <= 256: at most 8 columns per row).
// Scores and dot products are fp32 (accumulated over head_dim in fp32), as are the online
// softmax statistics.
//
// Those are the fp32 kernels, on the CUDA cores. Inside a bf16 or fp16 matmul scope
// (backend/matmul_precision.hpp; mixed-precision training opens one) flash_attention_forward and
// _backward run the tensor-core kernels of backend/cuda/flash_attention_mma.cuh instead, for
// head_dim up to 128, with the Host op's arithmetic in that scope (16-bit GEMM inputs). Above
// head_dim 128, or on a device with too little shared memory per block for them
// (flash_attention_mma_fits), a 16-bit scope still runs the fp32 kernels: they do not round, so
// their results then differ from the Host's in that scope by about the 16-bit type's rounding
// (bf16 2^-9 relative per input).
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/flash_attention.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "dsp/backend/attention.hpp"
#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/flash_attention_common.cuh"
#include "dsp/backend/cuda/flash_attention_mma.cuh"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/backend/cuda/memory.hpp"

namespace dsp::backend {

namespace detail {

/// Rows of a query or key tile: one per lane of a warp.
inline constexpr int kFlashTile = 32;
/// Query rows per warp of the forward and dQ kernels (4 warps, 128 threads per block).
inline constexpr int kFlashQueryRowsPerWarp = 8;
/// Keys per warp of the dK/dV kernel (8 warps, 256 threads per block: its two register
/// accumulators per key would spill at 8 keys per warp and head_dim 256).
inline constexpr int kFlashKeyRowsPerWarp = 4;
inline constexpr int kFlashQueryThreads = 32 * (kFlashTile / kFlashQueryRowsPerWarp);
inline constexpr int kFlashKeyThreads = 32 * (kFlashTile / kFlashKeyRowsPerWarp);

/// Rows first .. first + 31 of a [rows, ld] matrix (columns 0 .. head_dim - 1 from `src`) into
/// the shared tile dst [32, stride]; rows at or past `rows` are zero. Warp w copies rows w,
/// w + warps, ...; its lanes read consecutive columns (coalesced). All threads of the block call it.
__device__ __forceinline__ void flash_load_tile(float* dst, const float* src, std::int64_t first, std::int64_t rows,
                                                std::int64_t ld, int head_dim, int stride) {
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int r = threadIdx.x / 32; r < kFlashTile; r += warps) {
    if (first + r < rows) {
      const float* s = src + (first + r) * ld;
      for (int c = lane; c < head_dim; c += 32) dst[r * stride + c] = s[c];
    } else {
      for (int c = lane; c < head_dim; c += 32) dst[r * stride + c] = 0.0f;
    }
  }
}

/// acc[rr][c] += sum_j w_j[rr] * tile[j][lane + 32 c] over the first min(keys, 32) tile rows j,
/// where w_j[rr] is what lane j of the warp holds in w[rr]: the forward's O += P V and the dQ
/// kernel's dQ += dS K, each lane weighting its own key.
template <int R, int Chunks>
__device__ __forceinline__ void flash_accumulate(float (&acc)[R][Chunks], const float (&w)[R], const float* tile,
                                                 std::int64_t keys, int lane, int stride, int head_dim) {
  const int n = static_cast<int>(keys < kFlashTile ? keys : kFlashTile);
  for (int j = 0; j < n; ++j) {
    float wj[R];
#pragma unroll
    for (int rr = 0; rr < R; ++rr) wj[rr] = __shfl_sync(0xffffffffu, w[rr], j);
#pragma unroll
    for (int c = 0; c < Chunks; ++c) {
      const int col = lane + 32 * c;
      if (col < head_dim) {
        const float t = tile[j * stride + col];
#pragma unroll
        for (int rr = 0; rr < R; ++rr) acc[rr][c] += wj[rr] * t;
      }
    }
  }
}

/// Forward (FlashAttention-2 algorithm 1). Block (query tile blockIdx.x, q head blockIdx.y,
/// batch blockIdx.z), kFlashQueryThreads threads; warp w owns tile rows w * 8 .. w * 8 + 7, lane
/// j the key j0 + j of the current key tile for the scores and the columns lane + 32 c of O.
/// Dynamic shared memory: Q, K, V tiles [32, head_dim | 1].
template <int Chunks>
__global__ void __launch_bounds__(kFlashQueryThreads)
    flash_attention_forward_kernel(const float* q, const float* k, const float* v, const std::int32_t* positions,
                                   std::int64_t q_len, std::int64_t kv_len, std::int64_t q_heads,
                                   std::int64_t kv_heads, int head_dim, float scale, float* out, float* lse) {
  constexpr int R = kFlashQueryRowsPerWarp;
  extern __shared__ float flash_shared[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, stride = head_dim | 1;
  const std::int64_t b = blockIdx.z, h = blockIdx.y, i0 = std::int64_t(blockIdx.x) * kFlashTile;
  const std::int64_t g = h / (q_heads / kv_heads), ldq = q_heads * head_dim, ldk = kv_heads * head_dim;
  float* qs = flash_shared;
  float* ks = qs + kFlashTile * stride;
  float* vs = ks + kFlashTile * stride;
  const float* qb = q + b * q_len * ldq + h * head_dim;  // row i at qb + i * ldq
  const float* kb = k + b * kv_len * ldk + g * head_dim;
  const float* vb = v + b * kv_len * ldk + g * head_dim;
  const std::int32_t* pos = positions + b * q_len;

  // Lane r holds the visible keys of tile row r; the tile's key range is their maximum.
  const std::int64_t lane_visible = flash_visible_keys(pos, i0 + lane, q_len, kv_len);
  const std::int64_t tile_keys = flash_warp_max(lane_visible);
  std::int64_t visible[R];
  float m[R], l[R], o[R][Chunks];
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    visible[rr] = __shfl_sync(0xffffffffu, lane_visible, warp * R + rr);
    m[rr] = -INFINITY;
    l[rr] = 0.0f;
#pragma unroll
    for (int c = 0; c < Chunks; ++c) o[rr][c] = 0.0f;
  }
  flash_load_tile(qs, qb, i0, q_len, ldq, head_dim, stride);

  for (std::int64_t j0 = 0; j0 < tile_keys; j0 += kFlashTile) {
    __syncthreads();  // every warp is done with the previous K and V tiles
    flash_load_tile(ks, kb, j0, kv_len, ldk, head_dim, stride);
    flash_load_tile(vs, vb, j0, kv_len, ldk, head_dim, stride);
    __syncthreads();  // the K and V tiles (and, the first time, the Q tile) are in place
    // s[rr] = q_row . k_{j0 + lane}: the Q element is a broadcast, K rows at odd stride are
    // conflict-free.
    float s[R];
#pragma unroll
    for (int rr = 0; rr < R; ++rr) s[rr] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < head_dim; ++d) {
      const float kd = ks[lane * stride + d];
#pragma unroll
      for (int rr = 0; rr < R; ++rr) s[rr] += qs[(warp * R + rr) * stride + d] * kd;
    }
    const std::int64_t key = j0 + lane;
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      const float x = key < visible[rr] ? s[rr] * scale : -INFINITY;
      const float m_new = fmaxf(m[rr], flash_warp_max(x));
      // A row that has seen no key yet (m_new = -inf) keeps p = 0 and O = 0, l = 0.
      const float p = m_new == -INFINITY ? 0.0f : expf(x - m_new);
      const float alpha = m_new == -INFINITY ? 1.0f : expf(m[rr] - m_new);
      l[rr] = l[rr] * alpha + flash_warp_sum(p);
      m[rr] = m_new;
#pragma unroll
      for (int c = 0; c < Chunks; ++c) o[rr][c] *= alpha;
      s[rr] = p;
    }
    // O += P V over the tile's keys (past tile_keys every p is 0).
    flash_accumulate(o, s, vs, tile_keys - j0, lane, stride, head_dim);
  }

#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    const std::int64_t i = i0 + warp * R + rr;
    if (i >= q_len) continue;
    float* orow = out + (b * q_len + i) * ldq + h * head_dim;
#pragma unroll
    for (int c = 0; c < Chunks; ++c) {
      const int col = lane + 32 * c;
      if (col < head_dim) orow[col] = l[rr] > 0.0f ? o[rr][c] / l[rr] : 0.0f;
    }
    if (lse && lane == 0) lse[(b * q_heads + h) * q_len + i] = l[rr] > 0.0f ? m[rr] + logf(l[rr]) : -INFINITY;
  }
}

/// dQ (the query half of FlashAttention-2 algorithm 2). Block (query tile blockIdx.x, q head
/// blockIdx.y, batch blockIdx.z) of kFlashQueryThreads; warp w owns tile rows w * 8 .. w * 8 + 7,
/// lane j the key j0 + j for P and dS and the columns lane + 32 c of dQ. Per visible key tile:
/// S = scale Q K^T, P = exp(S - lse) (0 where masked), dP = dO V^T, dS = P * (dP - D),
/// dQ += dS K; dq = scale dQ written once. Dynamic shared memory: Q, dO, K, V tiles.
template <int Chunks>
__global__ void __launch_bounds__(kFlashQueryThreads)
    flash_attention_backward_dq_kernel(const float* q, const float* k, const float* v, const float* dout,
                                       const float* lse, const float* dvec, const std::int32_t* positions,
                                       std::int64_t q_len, std::int64_t kv_len, std::int64_t q_heads,
                                       std::int64_t kv_heads, int head_dim, float scale, float* dq) {
  constexpr int R = kFlashQueryRowsPerWarp;
  extern __shared__ float flash_shared[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, stride = head_dim | 1;
  const std::int64_t b = blockIdx.z, h = blockIdx.y, i0 = std::int64_t(blockIdx.x) * kFlashTile;
  const std::int64_t g = h / (q_heads / kv_heads), ldq = q_heads * head_dim, ldk = kv_heads * head_dim;
  float* qs = flash_shared;
  float* dos = qs + kFlashTile * stride;
  float* ks = dos + kFlashTile * stride;
  float* vs = ks + kFlashTile * stride;
  const std::int64_t qoff = b * q_len * ldq + h * head_dim;  // row i at qoff + i * ldq
  const float* kb = k + b * kv_len * ldk + g * head_dim;
  const float* vb = v + b * kv_len * ldk + g * head_dim;
  const std::int32_t* pos = positions + b * q_len;

  const std::int64_t lane_row = i0 + lane;
  const std::int64_t lane_visible = flash_visible_keys(pos, lane_row, q_len, kv_len);
  const std::int64_t tile_keys = flash_warp_max(lane_visible);
  const std::int64_t stat = (b * q_heads + h) * q_len + lane_row;  // lse and D of the lane's row
  const float lane_lse = lane_row < q_len ? lse[stat] : -INFINITY;
  const float lane_d = lane_row < q_len ? dvec[stat] : 0.0f;
  std::int64_t visible[R];
  float row_lse[R], row_d[R], acc[R][Chunks];
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    visible[rr] = __shfl_sync(0xffffffffu, lane_visible, warp * R + rr);
    row_lse[rr] = __shfl_sync(0xffffffffu, lane_lse, warp * R + rr);
    row_d[rr] = __shfl_sync(0xffffffffu, lane_d, warp * R + rr);
#pragma unroll
    for (int c = 0; c < Chunks; ++c) acc[rr][c] = 0.0f;
  }
  flash_load_tile(qs, q + qoff, i0, q_len, ldq, head_dim, stride);
  flash_load_tile(dos, dout + qoff, i0, q_len, ldq, head_dim, stride);

  for (std::int64_t j0 = 0; j0 < tile_keys; j0 += kFlashTile) {
    __syncthreads();  // every warp is done with the previous K and V tiles
    flash_load_tile(ks, kb, j0, kv_len, ldk, head_dim, stride);
    flash_load_tile(vs, vb, j0, kv_len, ldk, head_dim, stride);
    __syncthreads();
    float s[R], dp[R];
#pragma unroll
    for (int rr = 0; rr < R; ++rr) s[rr] = dp[rr] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < head_dim; ++d) {
      const float kd = ks[lane * stride + d], vd = vs[lane * stride + d];
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        s[rr] += qs[(warp * R + rr) * stride + d] * kd;
        dp[rr] += dos[(warp * R + rr) * stride + d] * vd;
      }
    }
    const std::int64_t key = j0 + lane;
    float ds[R];
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      const bool seen = key < visible[rr] && row_lse[rr] != -INFINITY;
      const float p = seen ? expf(s[rr] * scale - row_lse[rr]) : 0.0f;
      ds[rr] = p * (dp[rr] - row_d[rr]);
    }
    flash_accumulate(acc, ds, ks, tile_keys - j0, lane, stride, head_dim);  // dQ += dS K
  }

#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    const std::int64_t i = i0 + warp * R + rr;
    if (i >= q_len) continue;
    float* row = dq + qoff + i * ldq;
#pragma unroll
    for (int c = 0; c < Chunks; ++c) {
      const int col = lane + 32 * c;
      if (col < head_dim) row[col] = scale * acc[rr][c];
    }
  }
}

/// dK and dV (the key half of FlashAttention-2 algorithm 2). Block (key tile blockIdx.x, kv
/// head blockIdx.y, batch blockIdx.z) of kFlashKeyThreads; warp w owns keys j0 + w * 4 ..
/// j0 + w * 4 + 3, lane i the query row i0 + i for P and dS and the columns lane + 32 c of dK
/// and dV. For each q head of the kv head's group, in order, and each query tile with a row
/// that sees key j0 (the others see none of the tile): S, P, dP, dS as in the dQ kernel,
/// dV += P^T dO, dK += dS^T Q. dk = scale dK and dv = dV are written once (0 for keys no query
/// sees). Dynamic shared memory: K, V, Q, dO tiles.
template <int Chunks>
__global__ void __launch_bounds__(kFlashKeyThreads)
    flash_attention_backward_dkdv_kernel(const float* q, const float* k, const float* v, const float* dout,
                                         const float* lse, const float* dvec, const std::int32_t* positions,
                                         std::int64_t q_len, std::int64_t kv_len, std::int64_t q_heads,
                                         std::int64_t kv_heads, int head_dim, float scale, float* dk, float* dv) {
  constexpr int R = kFlashKeyRowsPerWarp;
  extern __shared__ float flash_shared[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, stride = head_dim | 1;
  const std::int64_t b = blockIdx.z, g = blockIdx.y, j0 = std::int64_t(blockIdx.x) * kFlashTile;
  const std::int64_t group = q_heads / kv_heads, ldq = q_heads * head_dim, ldk = kv_heads * head_dim;
  float* ks = flash_shared;
  float* vs = ks + kFlashTile * stride;
  float* qs = vs + kFlashTile * stride;
  float* dos = qs + kFlashTile * stride;
  const std::int64_t koff = b * kv_len * ldk + g * head_dim;  // key j at koff + j * ldk
  const std::int32_t* pos = positions + b * q_len;

  float acc_k[R][Chunks], acc_v[R][Chunks];
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
#pragma unroll
    for (int c = 0; c < Chunks; ++c) acc_k[rr][c] = acc_v[rr][c] = 0.0f;
  }
  flash_load_tile(ks, k + koff, j0, kv_len, ldk, head_dim, stride);
  flash_load_tile(vs, v + koff, j0, kv_len, ldk, head_dim, stride);

  for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
    const std::int64_t qoff = b * q_len * ldq + h * head_dim;  // row i at qoff + i * ldq
    for (std::int64_t i0 = 0; i0 < q_len; i0 += kFlashTile) {
      const std::int64_t lane_row = i0 + lane;
      const std::int64_t lane_visible = flash_visible_keys(pos, lane_row, q_len, kv_len);
      // Every warp computes the same maximum: the skip is uniform over the block, so the
      // __syncthreads below are reached by all threads or none.
      if (flash_warp_max(lane_visible) <= j0) continue;  // no row of this tile sees key j0
      const std::int64_t stat = (b * q_heads + h) * q_len + lane_row;
      const float lane_lse = lane_row < q_len ? lse[stat] : -INFINITY;
      const float lane_d = lane_row < q_len ? dvec[stat] : 0.0f;
      __syncthreads();  // every warp is done with the previous Q and dO tiles
      flash_load_tile(qs, q + qoff, i0, q_len, ldq, head_dim, stride);
      flash_load_tile(dos, dout + qoff, i0, q_len, ldq, head_dim, stride);
      __syncthreads();  // the Q and dO tiles (and, the first time, K and V) are in place
      // s[rr] = q_{i0 + lane} . k_{key rr}, dp[rr] = do_{i0 + lane} . v_{key rr}: Q and dO rows
      // at odd stride are conflict-free, the K and V elements are broadcasts.
      float s[R], dp[R];
#pragma unroll
      for (int rr = 0; rr < R; ++rr) s[rr] = dp[rr] = 0.0f;
#pragma unroll 4
      for (int d = 0; d < head_dim; ++d) {
        const float qd = qs[lane * stride + d], dod = dos[lane * stride + d];
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
          s[rr] += qd * ks[(warp * R + rr) * stride + d];
          dp[rr] += dod * vs[(warp * R + rr) * stride + d];
        }
      }
      float p[R], ds[R];
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        const std::int64_t key = j0 + warp * R + rr;
        const bool seen = key < lane_visible && lane_lse != -INFINITY;
        p[rr] = seen ? expf(s[rr] * scale - lane_lse) : 0.0f;
        ds[rr] = p[rr] * (dp[rr] - lane_d);
      }
      // dV += P^T dO, dK += dS^T Q over the tile's rows (rows past q_len have p = ds = 0).
      const int rows = static_cast<int>(q_len - i0 < kFlashTile ? q_len - i0 : kFlashTile);
      for (int i = 0; i < rows; ++i) {
        float pi[R], dsi[R];
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
          pi[rr] = __shfl_sync(0xffffffffu, p[rr], i);
          dsi[rr] = __shfl_sync(0xffffffffu, ds[rr], i);
        }
#pragma unroll
        for (int c = 0; c < Chunks; ++c) {
          const int col = lane + 32 * c;
          if (col < head_dim) {
            const float qv = qs[i * stride + col], dov = dos[i * stride + col];
#pragma unroll
            for (int rr = 0; rr < R; ++rr) {
              acc_v[rr][c] += pi[rr] * dov;
              acc_k[rr][c] += dsi[rr] * qv;
            }
          }
        }
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    const std::int64_t key = j0 + warp * R + rr;
    if (key >= kv_len) continue;
#pragma unroll
    for (int c = 0; c < Chunks; ++c) {
      const int col = lane + 32 * c;
      if (col < head_dim) {
        dk[koff + key * ldk + col] = scale * acc_k[rr][c];
        dv[koff + key * ldk + col] = acc_v[rr][c];
      }
    }
  }
}

/// Bytes of dynamic shared memory for `tiles` tiles of kFlashTile rows at head_dim.
inline std::size_t flash_shared_bytes(int tiles, std::int64_t head_dim) {
  return std::size_t(tiles) * kFlashTile * std::size_t(head_dim | 1) * sizeof(float);
}

/// f(std::integral_constant<int, C>{}) with C = register columns per lane and row: 2 up to
/// head_dim 64, 4 up to 128, 8 up to 256 (three instantiations of each kernel).
template <class F>
void with_flash_chunks(std::int64_t head_dim, F&& f) {
  if (head_dim <= 64)
    f(std::integral_constant<int, 2>{});
  else if (head_dim <= 128)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}

}  // namespace detail

/// The Host flash_attention_forward (backend/host/flash_attention.hpp) on b.stream, every
/// pointer in device memory: out [batch, q_len, q_heads, head_dim] = softmax(q k^T /
/// sqrt(head_dim), causal mask) v with q [batch, q_len, q_heads, head_dim], k, v [batch, kv_len,
/// kv_heads, head_dim], q_positions [batch * q_len] (query (b, i) sees keys
/// j <= q_positions[b * q_len + i], j < kv_len; q head h reads kv head h / (q_heads /
/// kv_heads)), and lse [batch, q_heads, q_len] = log sum_j exp(s_ij) over the visible keys
/// (-inf for a query that sees no key, whose out row is 0). lse may be nullptr (inference).
/// FlashAttention-2 algorithm 1 (Dao 2023): 32-row query tiles against 32-key tiles up to the
/// tile's last visible key, online softmax in registers; 3 * 32 * (head_dim | 1) floats of
/// shared memory per block (file comment). In a bf16 / fp16 matmul scope at head_dim <= 128,
/// the tensor-core kernel (flash_attention_mma.cuh). Throws Error when q_heads is not a multiple of
/// kv_heads, head_dim is outside [1, 256], a size is negative or exceeds the grid, or the
/// device's shared memory per block is too small for head_dim; CudaError when a launch fails.
/// The document mask (q_key_begin, the Host op's --reset-attention-mask) is not implemented in
/// these kernels yet: a non-null q_key_begin throws Error (the materialising
/// attention_forward has it on CUDA: run without --use-flash-attn).
inline void flash_attention_forward(Cuda b, const float* q, const float* k, const float* v,
                                    const std::int32_t* q_positions, std::int64_t batch, std::int64_t q_len,
                                    std::int64_t kv_len, std::int64_t q_heads, std::int64_t kv_heads,
                                    std::int64_t head_dim, float* out, float* lse,
                                    const std::int32_t* q_key_begin = nullptr) {
  DSP_CHECK(q_key_begin == nullptr,
            "flash attention on CUDA has no document mask (--reset-attention-mask) yet: run without "
            "--use-flash-attn, or on the host backend");
  detail::check_flash_attention_shape(batch, q_len, kv_len, q_heads, kv_heads, head_dim);
  // kv_len == 0 still launches: every row sees no key and gets out 0, lse -inf.
  if (batch == 0 || q_len == 0 || q_heads == 0) return;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  if (detail::with_mma_type(head_dim, [&](auto type) {
        detail::flash_attention_forward_mma<decltype(type)>(b, q, k, v, q_positions, batch, q_len, kv_len, q_heads,
                                                            kv_heads, head_dim, scale, out, lse);
      }))
    return;
  const dim3 grid(static_cast<unsigned>((q_len + detail::kFlashTile - 1) / detail::kFlashTile),
                  static_cast<unsigned>(q_heads), static_cast<unsigned>(batch));
  const std::size_t bytes = detail::flash_shared_bytes(3, head_dim);
  detail::with_flash_chunks(head_dim, [&](auto chunks) {
    constexpr int C = decltype(chunks)::value;
    detail::flash_allow_shared_memory(detail::flash_attention_forward_kernel<C>, bytes, head_dim);
    detail::flash_attention_forward_kernel<C><<<grid, detail::kFlashQueryThreads, bytes, b.stream>>>(
        q, k, v, q_positions, q_len, kv_len, q_heads, kv_heads, static_cast<int>(head_dim), scale, out, lse);
    DSP_CUDA_CHECK(cudaGetLastError());
  });
}

/// The Host flash_attention_backward (backend/host/flash_attention.hpp) on b.stream, every
/// pointer in device memory: from q, k, v, the forward's out and lse [batch, q_heads, q_len]
/// and dout [batch, q_len, q_heads, head_dim] (shapes and mask as flash_attention_forward),
/// overwrites dq [batch, q_len, q_heads, head_dim], dk and dv [batch, kv_len, kv_heads,
/// head_dim] with P = exp(S - lse) recomputed, dP = dO V^T, D = rowsum(dO * O),
/// dS = P * (dP - D), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO (dK, dV summed over the
/// q heads of a kv head's group). FlashAttention-2 algorithm 2 (Dao 2023) in three kernels: D
/// into a [batch, q_heads, q_len] scratch buffer, then dK/dV per key tile and dQ per query tile
/// (4 * 32 * (head_dim | 1) floats of shared memory per block), each output written once by one
/// thread: deterministic, bitwise equal from run to run (no atomics). In a bf16 / fp16 matmul
/// scope at head_dim <= 128, the tensor-core dK/dV and dQ kernels (flash_attention_mma.cuh),
/// deterministic as well. Throws as flash_attention_forward (a non-null q_key_begin included).
inline void flash_attention_backward(Cuda b, const float* q, const float* k, const float* v, const float* out,
                                     const float* dout, const float* lse, const std::int32_t* q_positions,
                                     std::int64_t batch, std::int64_t q_len, std::int64_t kv_len,
                                     std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim, float* dq,
                                     float* dk, float* dv, const std::int32_t* q_key_begin = nullptr) {
  DSP_CHECK(q_key_begin == nullptr,
            "flash attention on CUDA has no document mask (--reset-attention-mask) yet: run without "
            "--use-flash-attn, or on the host backend");
  detail::check_flash_attention_shape(batch, q_len, kv_len, q_heads, kv_heads, head_dim);
  if (batch == 0) return;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int hd = static_cast<int>(head_dim);
  const std::size_t bytes = detail::flash_shared_bytes(4, head_dim);
  const std::int64_t rows = batch * q_len * q_heads;  // rows of out: D's entries
  auto dvec = scratch(b, rows);
  if (rows > 0) {
    constexpr int warps = detail::kBlockThreads / 32;
    const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((rows + warps - 1) / warps, 65535));
    detail::flash_attention_dout_dot_kernel<<<blocks, detail::kBlockThreads, 0, b.stream>>>(out, dout, rows, q_len,
                                                                                           q_heads, hd, dvec.data());
    DSP_CUDA_CHECK(cudaGetLastError());
  }
  if (detail::with_mma_type(head_dim, [&](auto type) {
        detail::flash_attention_backward_mma<decltype(type)>(b, q, k, v, dout, lse, dvec.data(), q_positions, batch,
                                                             q_len, kv_len, q_heads, kv_heads, head_dim, scale, dq,
                                                             dk, dv);
      }))
    return;
  detail::with_flash_chunks(head_dim, [&](auto chunks) {
    constexpr int C = decltype(chunks)::value;
    // q_len == 0 (or q_heads == 0) still launches: dk and dv are overwritten with 0.
    if (kv_len > 0) {
      const dim3 grid(static_cast<unsigned>((kv_len + detail::kFlashTile - 1) / detail::kFlashTile),
                      static_cast<unsigned>(kv_heads), static_cast<unsigned>(batch));
      detail::flash_allow_shared_memory(detail::flash_attention_backward_dkdv_kernel<C>, bytes, head_dim);
      detail::flash_attention_backward_dkdv_kernel<C><<<grid, detail::kFlashKeyThreads, bytes, b.stream>>>(
          q, k, v, dout, lse, dvec.data(), q_positions, q_len, kv_len, q_heads, kv_heads, hd, scale, dk, dv);
      DSP_CUDA_CHECK(cudaGetLastError());
    }
    // kv_len == 0 still launches: dq is overwritten with 0.
    if (rows > 0) {
      const dim3 grid(static_cast<unsigned>((q_len + detail::kFlashTile - 1) / detail::kFlashTile),
                      static_cast<unsigned>(q_heads), static_cast<unsigned>(batch));
      detail::flash_allow_shared_memory(detail::flash_attention_backward_dq_kernel<C>, bytes, head_dim);
      detail::flash_attention_backward_dq_kernel<C><<<grid, detail::kFlashQueryThreads, bytes, b.stream>>>(
          q, k, v, dout, lse, dvec.data(), q_positions, q_len, kv_len, q_heads, kv_heads, hd, scale, dq);
      DSP_CUDA_CHECK(cudaGetLastError());
    }
  });
}

}  // namespace dsp::backend
