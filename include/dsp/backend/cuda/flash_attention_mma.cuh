#pragma once
// Memory-efficient causal attention on the tensor cores: the CUDA flash attention inside a bf16
// or fp16 matmul scope (backend/matmul_precision.hpp), with the arithmetic the Host op has in that
// scope (backend/host/flash_attention.hpp, whose GEMMs are matmul() calls): every input of a
// product is rounded to the 16-bit type (Q, K, V, dO, the probabilities P and dS), products and
// sums are fp32 (WMMA 16 x 16 x 16 fragments, fp32 accumulators), and the softmax statistics
// and dS = P * (dP - D) are computed in fp32 from fp32 scores. FlashAttention-2 (Dao 2023,
// algorithms 1 and 2) multiplies the same 16-bit inputs; it differs in the forward, where it
// rounds the unnormalised exp(S - m_running) and rescales O as the running maximum grows.
//
// Tiling: query and key tiles of 64 rows (kMmaTile), 4 warps per block, each owning 16 rows
// (one WMMA row of fragments) of the block's tile, so that the softmax of a row needs no
// block-wide synchronisation: two lanes per row, 32 columns each.
// - forward: one block per (query tile, q head, batch), two passes over the key tiles up to
//   the tile's last visible key. Pass 1 computes S = Q K^T and the row statistics m (maximum)
//   and l (sum of exp(S - m)) online. Pass 2 computes S again, rounds the normalised
//   P = exp(S - m) / l, exactly the probabilities the Host op rounds, and accumulates O += P V
//   in register fragments (no rescaling is needed). The second S costs one more Q K^T: the
//   forward's attention FLOPs grow by half, a whole step's (backward 2.5x forward) by 1/7.
// - backward (algorithm 2, the split of the fp32 kernels: no atomics, deterministic): dQ by one
//   block per (query tile, q head, batch) over its visible key tiles, S, dP = dO V^T,
//   P = exp(S - lse), dS = P * (dP - D), dQ += dS K; dK and dV by one block per (key tile, kv
//   head, batch) over the q heads of the group and the query tiles that see a key of the tile,
//   S^T = K Q^T and dP^T = V dO^T, dV += P^T dO, dK += dS^T Q. D is the fp32 kernels' kernel.
// Shared memory (dynamic, head_dim rounded up to d16, a multiple of 16, columns past head_dim
// zero): 16-bit tiles [64, d16 + 8] (3 in the forward, 4 in the backward), per warp fp32
// scratch [16, 68] (1 forward, 2 backward) and 16-bit scratch [16, 72] (1 forward and dQ, 2 dK/dV),
// and the tile's row statistics. At head_dim 128 that is 78 KiB (forward), 112 KiB (dQ) and
// 121 KiB (dK/dV): opted in above 48 KiB (sm_80 allows 163 KiB per block, sm_90 227 KiB; a
// device that allows less than the backward needs, such as sm_86 / sm_89 with 99 KiB, runs the
// fp32 kernels instead: flash_attention_mma_fits). The
// strides keep the WMMA rules: 16-bit ldm a multiple of 8, fp32 ldm a multiple of 4, every
// fragment pointer 32-byte aligned.
// head_dim above kMmaMaxHeadDim (128: the dK and dV accumulators, 2 x 8 fragments per warp)
// runs the fp32 kernels, without the 16-bit roundings (flash_attention.cuh says so). Key rows
// past the tile's last visible key are loaded as 0, never read: a non-finite value there
// (an unwritten KV-cache slot, an fp16 overflow) cannot reach a product with P = 0.
// Scores are scaled with __fmul_rn (no FMA contraction), so the row maximum and the exponents
// see the same scaled score.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/flash_attention_mma.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/device.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/flash_attention_common.cuh"
#include "dsp/backend/matmul_precision.hpp"
#include "dsp/core/dtype.hpp"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
// bf16 WMMA fragments exist from sm_80 (A100) on.
#error "dsp/backend/cuda/flash_attention_mma.cuh needs sm_80 or newer: CMAKE_CUDA_ARCHITECTURES 80 and up"
#endif

namespace dsp::backend::detail {

/// Rows of a query or key tile of the tensor-core kernels.
inline constexpr int kMmaTile = 64;
/// Edge of a WMMA fragment (m = n = k = 16).
inline constexpr int kMmaEdge = 16;
/// Warps per block, each owning kMmaEdge rows of the tile.
inline constexpr int kMmaWarps = kMmaTile / kMmaEdge;
inline constexpr int kMmaThreads = 32 * kMmaWarps;
/// Largest head_dim of the tensor-core kernels.
inline constexpr std::int64_t kMmaMaxHeadDim = 128;
/// Row strides of the per-warp scratch: fp32 [16, kMmaScoreStride], 16-bit [16, kMmaProbStride].
inline constexpr int kMmaScoreStride = kMmaTile + 4;
inline constexpr int kMmaProbStride = kMmaTile + 8;
inline constexpr std::size_t kMmaScoreBytes = std::size_t(kMmaEdge) * kMmaScoreStride * sizeof(float);
inline constexpr std::size_t kMmaProbBytes = std::size_t(kMmaEdge) * kMmaProbStride * sizeof(std::uint16_t);
/// The row statistics of a tile in shared memory: visible keys (int64), and lse and D (fp32).
inline constexpr std::size_t kMmaStatBytes = std::size_t(kMmaTile) * (sizeof(std::int64_t) + 2 * sizeof(float));

/// The WMMA element type of dsp's bf16 / fp16 (the same bits).
template <class T>
struct MmaElement;
template <>
struct MmaElement<bf16> {
  using type = __nv_bfloat16;
};
template <>
struct MmaElement<fp16> {
  using type = __half;
};

/// The shared-memory geometry at one head_dim: d16 = head_dim rounded up to 16, 16-bit tiles
/// [64, ldh = d16 + 8], fp32 output staging [64, ldo = d16 + 4] (it fits in two 16-bit tiles).
struct MmaLayout {
  int d16, ldh, ldo;
  __host__ __device__ explicit MmaLayout(int head_dim)
      : d16((head_dim + kMmaEdge - 1) / kMmaEdge * kMmaEdge), ldh(d16 + 8), ldo(d16 + 4) {}
  /// Bytes of one 16-bit tile (a multiple of 1024).
  __host__ __device__ std::size_t tile_bytes() const { return std::size_t(kMmaTile) * ldh * sizeof(std::uint16_t); }
};

/// The carve-up of a kernel's dynamic shared memory, in this order: `tiles` 16-bit tiles; per
/// warp `scores` fp32 and then per warp `probs` 16-bit scratch blocks; the row statistics of a
/// tile (visible keys, lse, D). Every region starts 32-byte aligned (file comment).
struct MmaShared {
  MmaLayout layout;
  int tiles, scores, probs;
  unsigned char* base = nullptr;
  /// Bytes of the whole.
  __host__ __device__ std::size_t bytes() const {
    return tiles * layout.tile_bytes() + kMmaWarps * (scores * kMmaScoreBytes + probs * kMmaProbBytes) +
           kMmaStatBytes;
  }
  __device__ std::uint16_t* tile(int i) const {
    return reinterpret_cast<std::uint16_t*>(base + i * layout.tile_bytes());
  }
  /// Scratch block i of `warp`: fp32 [16, kMmaScoreStride], 16-bit [16, kMmaProbStride].
  __device__ float* score(int warp, int i) const {
    return reinterpret_cast<float*>(base + tiles * layout.tile_bytes() + (warp * scores + i) * kMmaScoreBytes);
  }
  __device__ std::uint16_t* prob(int warp, int i) const {
    return reinterpret_cast<std::uint16_t*>(base + tiles * layout.tile_bytes() +
                                            kMmaWarps * scores * kMmaScoreBytes + (warp * probs + i) * kMmaProbBytes);
  }
  __device__ std::int64_t* visible() const {
    return reinterpret_cast<std::int64_t*>(base + bytes() - kMmaStatBytes);
  }
  /// The most keys any row of the tile sees (after its visible keys are written and synchronised).
  __device__ std::int64_t most_visible() const {
    std::int64_t most = 0;
    for (int r = 0; r < kMmaTile; ++r) most = visible()[r] > most ? visible()[r] : most;
    return most;
  }
  __device__ float* row_lse() const { return reinterpret_cast<float*>(visible() + kMmaTile); }
  __device__ float* row_d() const { return row_lse() + kMmaTile; }
};

/// Whether the tensor-core kernels run at head_dim on the current device: head_dim <= 128 and
/// the backward's shared memory (the larger dK/dV kernel's) within the device's opt-in limit
/// per block. Forward and backward choose together, so that a step rounds consistently.
/// Throws CudaError when the device query fails.
inline bool flash_attention_mma_fits(std::int64_t head_dim) {
  if (head_dim > kMmaMaxHeadDim) return false;
  int limit = 0;
  DSP_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, current_device()));
  return MmaShared{MmaLayout(static_cast<int>(head_dim)), 4, 2, 2}.bytes() <= static_cast<std::size_t>(limit);
}

/// In a bf16 / fp16 matmul scope where flash_attention_mma_fits(head_dim): f(bf16{}) or
/// f(fp16{}), returning true; otherwise false (the caller runs the fp32 kernels). Throws what f
/// throws, and CudaError when the device query fails.
template <class F>
bool with_mma_type(std::int64_t head_dim, F&& f) {
  const MatmulPrecision p = matmul_precision();
  if (p == MatmulPrecision::Fp32 || !flash_attention_mma_fits(head_dim)) return false;
  if (p == MatmulPrecision::Bf16)
    f(bf16{});
  else
    f(fp16{});
  return true;
}

/// Rows first .. first + 63 of a [rows, ld] fp32 matrix (columns 0 .. head_dim - 1 of `src`)
/// rounded to T (the bits of T::from_float, as the Host's round_to) into the 16-bit tile dst
/// [64, ldh]; columns head_dim .. d16 - 1 and rows at or past `rows` are 0, so the padding adds
/// nothing to a product. All threads of the block call it; consecutive threads read
/// consecutive columns.
template <class T>
__device__ __forceinline__ void mma_load_tile(std::uint16_t* dst, const float* src, std::int64_t first,
                                              std::int64_t rows, std::int64_t ld, int head_dim,
                                              const MmaLayout& layout) {
  for (int e = threadIdx.x; e < kMmaTile * layout.d16; e += blockDim.x) {
    const int r = e / layout.d16, c = e % layout.d16;
    const float x = first + r < rows && c < head_dim ? src[(first + r) * ld + c] : 0.0f;
    dst[r * layout.ldh + c] = T::from_float(x);
  }
}

/// One warp: s [16, 64] fp32 (row stride kMmaScoreStride) = a b^T, with a the 16 rows of a
/// 16-bit tile at `a` and b the 64 rows of the 16-bit tile at `b` (both [., d16], stride ldh):
/// the warp's block of Q K^T, dO V^T, K Q^T or V dO^T.
template <class T>
__device__ __forceinline__ void mma_a_bt(float* s, const std::uint16_t* a, const std::uint16_t* b,
                                         const MmaLayout& layout) {
  using namespace nvcuda;
  using E = typename MmaElement<T>::type;
  const E* ae = reinterpret_cast<const E*>(a);
  const E* be = reinterpret_cast<const E*>(b);
  constexpr int kBlocks = kMmaTile / kMmaEdge;
  wmma::fragment<wmma::accumulator, kMmaEdge, kMmaEdge, kMmaEdge, float> acc[kBlocks];
#pragma unroll
  for (int n = 0; n < kBlocks; ++n) wmma::fill_fragment(acc[n], 0.0f);
  for (int kk = 0; kk < layout.d16; kk += kMmaEdge) {
    wmma::fragment<wmma::matrix_a, kMmaEdge, kMmaEdge, kMmaEdge, E, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, ae + kk, layout.ldh);
#pragma unroll
    for (int n = 0; n < kBlocks; ++n) {
      // b^T as a column-major [d16, 64] matrix: element (k, n) is b[n][k].
      wmma::fragment<wmma::matrix_b, kMmaEdge, kMmaEdge, kMmaEdge, E, wmma::col_major> fb;
      wmma::load_matrix_sync(fb, be + n * kMmaEdge * layout.ldh + kk, layout.ldh);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
#pragma unroll
  for (int n = 0; n < kBlocks; ++n)
    wmma::store_matrix_sync(s + n * kMmaEdge, acc[n], kMmaScoreStride, wmma::mem_row_major);
}

/// One warp: acc[c] (columns 16 c .. 16 c + 15 of a [16, d16] fp32 block) += p t, with p the
/// 16-bit [16, 64] scratch (stride kMmaProbStride) and t the 64-row 16-bit tile (stride ldh):
/// O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q.
template <class T, int Frags>
__device__ __forceinline__ void mma_accumulate(
    nvcuda::wmma::fragment<nvcuda::wmma::accumulator, kMmaEdge, kMmaEdge, kMmaEdge, float> (&acc)[Frags],
    const std::uint16_t* p, const std::uint16_t* t, const MmaLayout& layout) {
  using namespace nvcuda;
  using E = typename MmaElement<T>::type;
  const E* pe = reinterpret_cast<const E*>(p);
  const E* te = reinterpret_cast<const E*>(t);
#pragma unroll
  for (int kk = 0; kk < kMmaTile; kk += kMmaEdge) {
    wmma::fragment<wmma::matrix_a, kMmaEdge, kMmaEdge, kMmaEdge, E, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, pe + kk, kMmaProbStride);
#pragma unroll
    for (int c = 0; c < Frags; ++c) {
      if (c * kMmaEdge >= layout.d16) break;
      wmma::fragment<wmma::matrix_b, kMmaEdge, kMmaEdge, kMmaEdge, E, wmma::row_major> fb;
      wmma::load_matrix_sync(fb, te + kk * layout.ldh + c * kMmaEdge, layout.ldh);
      wmma::mma_sync(acc[c], fa, fb, acc[c]);
    }
  }
}

/// One warp: its 16 rows of `acc` (times `scale`) into rows row0 .. row0 + 15 of a [rows, ld]
/// fp32 matrix at dst (columns 0 .. head_dim - 1; rows at or past `rows` are not written),
/// through its 16 rows of the fp32 staging block `stage` [64, ldo].
template <int Frags>
__device__ __forceinline__ void mma_store_rows(
    const nvcuda::wmma::fragment<nvcuda::wmma::accumulator, kMmaEdge, kMmaEdge, kMmaEdge, float> (&acc)[Frags],
    float* stage, float scale, float* dst, std::int64_t row0, std::int64_t rows, std::int64_t ld, int head_dim,
    const MmaLayout& layout) {
  using namespace nvcuda;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* mine = stage + warp * kMmaEdge * layout.ldo;
#pragma unroll
  for (int c = 0; c < Frags; ++c) {
    if (c * kMmaEdge >= layout.d16) break;
    wmma::store_matrix_sync(mine + c * kMmaEdge, acc[c], layout.ldo, wmma::mem_row_major);
  }
  __syncwarp();
  for (int e = lane; e < kMmaEdge * head_dim; e += 32) {
    const int r = e / head_dim, c = e % head_dim;
    if (row0 + r < rows) dst[(row0 + r) * ld + c] = scale * mine[r * layout.ldo + c];
  }
  __syncwarp();
}

/// What a query-tile block (query tile blockIdx.x, q head blockIdx.y, batch blockIdx.z) works on:
/// batch b, q head h, first row i0, kv head g, and the row strides of q and of k / v.
struct MmaQueryBlock {
  std::int64_t b, h, i0, g, ldq, ldk;
};
__device__ __forceinline__ MmaQueryBlock mma_query_block(std::int64_t q_heads, std::int64_t kv_heads, int head_dim) {
  const std::int64_t h = blockIdx.y;
  return {blockIdx.z, h, std::int64_t(blockIdx.x) * kMmaTile, h / (q_heads / kv_heads), q_heads * head_dim,
          kv_heads * head_dim};
}

/// The backward's statistics of query rows i0 .. i0 + 63 of q head h, batch b, into shared
/// memory: visible keys, lse (-inf past q_len) and D (0 past q_len). Threads 0-63 each write one
/// row; the caller synchronises.
__device__ __forceinline__ void mma_load_stats(const MmaShared& sh, const std::int32_t* pos, const float* lse,
                                               const float* dvec, std::int64_t b, std::int64_t h, std::int64_t i0,
                                               std::int64_t q_len, std::int64_t kv_len, std::int64_t q_heads) {
  if (threadIdx.x >= kMmaTile) return;
  const std::int64_t i = i0 + threadIdx.x, stat = (b * q_heads + h) * q_len + i;
  sh.visible()[threadIdx.x] = flash_visible_keys(pos, i, q_len, kv_len);
  sh.row_lse()[threadIdx.x] = i < q_len ? lse[stat] : -INFINITY;
  sh.row_d()[threadIdx.x] = i < q_len ? dvec[stat] : 0.0f;
}

/// Forward. Block (query tile blockIdx.x, q head blockIdx.y, batch blockIdx.z), kMmaThreads
/// threads; warp w owns tile rows 16 w .. 16 w + 15, lanes 2 r and 2 r + 1 row r of them for the
/// softmax (keys 0-31 and 32-63 of the key tile). Two passes (file comment); out = O, lse =
/// m + log(l) (-inf and a zero row for a query that sees no key).
template <class T, int Frags>
__global__ void __launch_bounds__(kMmaThreads)
    flash_attention_forward_mma_kernel(const float* q, const float* k, const float* v,
                                       const std::int32_t* positions, std::int64_t q_len, std::int64_t kv_len,
                                       std::int64_t q_heads, std::int64_t kv_heads, int head_dim, float scale,
                                       float* out, float* lse) {
  using namespace nvcuda;
  extern __shared__ __align__(128) unsigned char flash_mma_shared[];
  const MmaLayout layout(head_dim);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, row = lane / 2, half = lane % 2;
  const auto [b, h, i0, g, ldq, ldk] = mma_query_block(q_heads, kv_heads, head_dim);
  const MmaShared sh{layout, 3, 1, 1, flash_mma_shared};
  std::uint16_t *qs = sh.tile(0), *ks = sh.tile(1), *vs = sh.tile(2), *ps = sh.prob(warp, 0);
  float* ss = sh.score(warp, 0);
  std::int64_t* visible = sh.visible();
  const float* qb = q + b * q_len * ldq + h * head_dim;  // row i at qb + i * ldq
  const float* kb = k + b * kv_len * ldk + g * head_dim;
  const float* vb = v + b * kv_len * ldk + g * head_dim;
  const std::int32_t* pos = positions + b * q_len;

  if (threadIdx.x < kMmaTile) visible[threadIdx.x] = flash_visible_keys(pos, i0 + threadIdx.x, q_len, kv_len);
  mma_load_tile<T>(qs, qb, i0, q_len, ldq, head_dim, layout);
  __syncthreads();
  const std::int64_t tile_keys = sh.most_visible();
  const std::int64_t row_visible = visible[warp * kMmaEdge + row];
  const std::uint16_t* qw = qs + warp * kMmaEdge * layout.ldh;

  float m = -INFINITY, l = 0.0f;
  wmma::fragment<wmma::accumulator, kMmaEdge, kMmaEdge, kMmaEdge, float> o[Frags];
#pragma unroll
  for (int c = 0; c < Frags; ++c) wmma::fill_fragment(o[c], 0.0f);

  for (int pass = 0; pass < 2; ++pass) {
    const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;  // pass 2's normalisation
    for (std::int64_t j0 = 0; j0 < tile_keys; j0 += kMmaTile) {
      __syncthreads();  // every warp is done with the previous K and V tiles
      mma_load_tile<T>(ks, kb, j0, tile_keys, ldk, head_dim, layout);
      if (pass == 1) mma_load_tile<T>(vs, vb, j0, tile_keys, ldk, head_dim, layout);
      __syncthreads();
      mma_a_bt<T>(ss, qw, ks, layout);  // the warp's S / scale [16, 64]
      __syncwarp();
      const float* srow = ss + row * kMmaScoreStride + half * 32;
      const std::int64_t key0 = j0 + half * 32;
      if (pass == 0) {
        float mx = -INFINITY;
        for (int j = 0; j < 32; ++j)
          if (key0 + j < row_visible) mx = fmaxf(mx, __fmul_rn(srow[j], scale));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_new = fmaxf(m, mx);
        float sum = 0.0f;  // a row that has seen no key yet (m_new = -inf) keeps l = 0
        if (m_new != -INFINITY) {
          for (int j = 0; j < 32; ++j)
            if (key0 + j < row_visible) sum += expf(__fmul_rn(srow[j], scale) - m_new);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // both lanes of the row: the same bits
        l = m_new == -INFINITY ? 0.0f : l * expf(m - m_new) + sum;
        m = m_new;
      } else {
        std::uint16_t* prow = ps + row * kMmaProbStride + half * 32;
        for (int j = 0; j < 32; ++j) {
          const float p = key0 + j < row_visible && l > 0.0f ? expf(__fmul_rn(srow[j], scale) - m) * inv_l : 0.0f;
          prow[j] = T::from_float(p);
        }
        __syncwarp();
        mma_accumulate<T>(o, ps, vs, layout);  // O += P V
      }
    }
  }

  __syncthreads();  // every warp is done with K and V: their space stages O
  float* stage = reinterpret_cast<float*>(ks);
  mma_store_rows(o, stage, 1.0f, out + b * q_len * ldq + h * head_dim, i0 + warp * kMmaEdge, q_len, ldq, head_dim,
                 layout);
  const std::int64_t i = i0 + warp * kMmaEdge + row;
  if (lse && half == 0 && i < q_len) lse[(b * q_heads + h) * q_len + i] = l > 0.0f ? m + logf(l) : -INFINITY;
}

/// dQ. Block (query tile blockIdx.x, q head blockIdx.y, batch blockIdx.z), kMmaThreads threads;
/// warp w owns tile rows 16 w .. 16 w + 15, lanes 2 r and 2 r + 1 row r of them for P and dS.
/// Per visible key tile: S, dP = dO V^T, P = exp(S - lse) (0 where masked), dS = P * (dP - D)
/// rounded to T, dQ += dS K; dq = scale dQ written once.
template <class T, int Frags>
__global__ void __launch_bounds__(kMmaThreads)
    flash_attention_backward_dq_mma_kernel(const float* q, const float* k, const float* v, const float* dout,
                                           const float* lse, const float* dvec, const std::int32_t* positions,
                                           std::int64_t q_len, std::int64_t kv_len, std::int64_t q_heads,
                                           std::int64_t kv_heads, int head_dim, float scale, float* dq) {
  using namespace nvcuda;
  extern __shared__ __align__(128) unsigned char flash_mma_shared[];
  const MmaLayout layout(head_dim);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, row = lane / 2, half = lane % 2;
  const auto [b, h, i0, g, ldq, ldk] = mma_query_block(q_heads, kv_heads, head_dim);
  const MmaShared sh{layout, 4, 2, 1, flash_mma_shared};
  std::uint16_t *qs = sh.tile(0), *dos = sh.tile(1), *ks = sh.tile(2), *vs = sh.tile(3), *dss = sh.prob(warp, 0);
  float *ss = sh.score(warp, 0), *dps = sh.score(warp, 1);
  const std::int64_t qoff = b * q_len * ldq + h * head_dim;  // row i at qoff + i * ldq
  const float* kb = k + b * kv_len * ldk + g * head_dim;
  const float* vb = v + b * kv_len * ldk + g * head_dim;
  const std::int32_t* pos = positions + b * q_len;

  mma_load_stats(sh, pos, lse, dvec, b, h, i0, q_len, kv_len, q_heads);
  mma_load_tile<T>(qs, q + qoff, i0, q_len, ldq, head_dim, layout);
  mma_load_tile<T>(dos, dout + qoff, i0, q_len, ldq, head_dim, layout);
  __syncthreads();
  const std::int64_t tile_keys = sh.most_visible();
  const int r_tile = warp * kMmaEdge + row;
  const std::int64_t rv = sh.visible()[r_tile];
  const float rl = sh.row_lse()[r_tile], rd = sh.row_d()[r_tile];

  wmma::fragment<wmma::accumulator, kMmaEdge, kMmaEdge, kMmaEdge, float> acc[Frags];
#pragma unroll
  for (int c = 0; c < Frags; ++c) wmma::fill_fragment(acc[c], 0.0f);

  for (std::int64_t j0 = 0; j0 < tile_keys; j0 += kMmaTile) {
    __syncthreads();  // every warp is done with the previous K and V tiles
    mma_load_tile<T>(ks, kb, j0, tile_keys, ldk, head_dim, layout);
    mma_load_tile<T>(vs, vb, j0, tile_keys, ldk, head_dim, layout);
    __syncthreads();
    mma_a_bt<T>(ss, qs + warp * kMmaEdge * layout.ldh, ks, layout);   // S / scale
    mma_a_bt<T>(dps, dos + warp * kMmaEdge * layout.ldh, vs, layout);  // dP
    __syncwarp();
    const float* srow = ss + row * kMmaScoreStride + half * 32;
    const float* dprow = dps + row * kMmaScoreStride + half * 32;
    std::uint16_t* dsrow = dss + row * kMmaProbStride + half * 32;
    const std::int64_t key0 = j0 + half * 32;
    for (int j = 0; j < 32; ++j) {
      const bool seen = key0 + j < rv && rl != -INFINITY;
      // Masked: exactly 0, whatever dP holds (a key row past the tile's last visible key is 0).
      dsrow[j] = T::from_float(seen ? expf(__fmul_rn(srow[j], scale) - rl) * (dprow[j] - rd) : 0.0f);
    }
    __syncwarp();
    mma_accumulate<T>(acc, dss, ks, layout);  // dQ += dS K
  }

  __syncthreads();  // every warp is done with K and V: their space stages dQ
  mma_store_rows(acc, reinterpret_cast<float*>(ks), scale, dq + qoff, i0 + warp * kMmaEdge, q_len, ldq, head_dim,
                 layout);
}

/// dK and dV. Block (key tile blockIdx.x, kv head blockIdx.y, batch blockIdx.z), kMmaThreads
/// threads; warp w owns keys j0 + 16 w .. j0 + 16 w + 15, lanes 2 r and 2 r + 1 key r of them
/// for P^T and dS^T (query rows 0-31 and 32-63 of the query tile). For each q head of the kv
/// head's group, in order, and each query tile with a row that sees key j0: S^T = K Q^T,
/// dP^T = V dO^T, P^T, dS^T rounded to T, dV += P^T dO, dK += dS^T Q. dk = scale dK and dv = dV
/// are written once (0 for keys no query sees).
template <class T, int Frags>
__global__ void __launch_bounds__(kMmaThreads)
    flash_attention_backward_dkdv_mma_kernel(const float* q, const float* k, const float* v, const float* dout,
                                             const float* lse, const float* dvec, const std::int32_t* positions,
                                             std::int64_t q_len, std::int64_t kv_len, std::int64_t q_heads,
                                             std::int64_t kv_heads, int head_dim, float scale, float* dk,
                                             float* dv) {
  using namespace nvcuda;
  extern __shared__ __align__(128) unsigned char flash_mma_shared[];
  const MmaLayout layout(head_dim);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, row = lane / 2, half = lane % 2;
  const std::int64_t b = blockIdx.z, g = blockIdx.y, j0 = std::int64_t(blockIdx.x) * kMmaTile;
  const std::int64_t group = q_heads / kv_heads, ldq = q_heads * head_dim, ldk = kv_heads * head_dim;
  const MmaShared sh{layout, 4, 2, 2, flash_mma_shared};
  std::uint16_t *ks = sh.tile(0), *vs = sh.tile(1), *qs = sh.tile(2), *dos = sh.tile(3);
  std::uint16_t *pts = sh.prob(warp, 0), *dsts = sh.prob(warp, 1);
  float *sts = sh.score(warp, 0), *dpts = sh.score(warp, 1);
  const std::int64_t* visible = sh.visible();
  const float *row_lse = sh.row_lse(), *row_d = sh.row_d();
  const std::int64_t koff = b * kv_len * ldk + g * head_dim;  // key j at koff + j * ldk
  const std::int32_t* pos = positions + b * q_len;
  const std::int64_t key = j0 + warp * kMmaEdge + row;  // the key of this lane's P^T and dS^T row

  wmma::fragment<wmma::accumulator, kMmaEdge, kMmaEdge, kMmaEdge, float> acc_k[Frags], acc_v[Frags];
#pragma unroll
  for (int c = 0; c < Frags; ++c) {
    wmma::fill_fragment(acc_k[c], 0.0f);
    wmma::fill_fragment(acc_v[c], 0.0f);
  }
  mma_load_tile<T>(ks, k + koff, j0, kv_len, ldk, head_dim, layout);
  mma_load_tile<T>(vs, v + koff, j0, kv_len, ldk, head_dim, layout);

  for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
    const std::int64_t qoff = b * q_len * ldq + h * head_dim;  // row i at qoff + i * ldq
    for (std::int64_t i0 = 0; i0 < q_len; i0 += kMmaTile) {
      __syncthreads();  // every warp is done with the previous query tile's rows and statistics
      mma_load_stats(sh, pos, lse, dvec, b, h, i0, q_len, kv_len, q_heads);
      __syncthreads();
      // Every thread reads the same maximum: the skip is uniform over the block, so the
      // __syncthreads are reached by all threads or none.
      if (sh.most_visible() <= j0) continue;  // no row of this tile sees key j0
      mma_load_tile<T>(qs, q + qoff, i0, q_len, ldq, head_dim, layout);
      mma_load_tile<T>(dos, dout + qoff, i0, q_len, ldq, head_dim, layout);
      __syncthreads();  // the Q and dO tiles (and, the first time, K and V) are in place
      mma_a_bt<T>(sts, ks + warp * kMmaEdge * layout.ldh, qs, layout);    // S^T / scale [16 keys, 64 rows]
      mma_a_bt<T>(dpts, vs + warp * kMmaEdge * layout.ldh, dos, layout);  // dP^T
      __syncwarp();
      const float* srow = sts + row * kMmaScoreStride + half * 32;
      const float* dprow = dpts + row * kMmaScoreStride + half * 32;
      std::uint16_t* prow = pts + row * kMmaProbStride + half * 32;
      std::uint16_t* dsrow = dsts + row * kMmaProbStride + half * 32;
      for (int n = 0; n < 32; ++n) {
        const int r = half * 32 + n;  // the query row within the tile
        const bool seen = key < visible[r] && row_lse[r] != -INFINITY;
        const float p = seen ? expf(__fmul_rn(srow[n], scale) - row_lse[r]) : 0.0f;
        prow[n] = T::from_float(p);
        dsrow[n] = T::from_float(seen ? p * (dprow[n] - row_d[r]) : 0.0f);
      }
      __syncwarp();
      mma_accumulate<T>(acc_v, pts, dos, layout);  // dV += P^T dO
      mma_accumulate<T>(acc_k, dsts, qs, layout);  // dK += dS^T Q
    }
  }

  __syncthreads();  // every warp is done with Q and dO: their space stages dK and dV
  auto* stage = reinterpret_cast<float*>(qs);
  const std::int64_t key0 = j0 + warp * kMmaEdge;
  mma_store_rows(acc_k, stage, scale, dk + koff, key0, kv_len, ldk, head_dim, layout);
  mma_store_rows(acc_v, stage, 1.0f, dv + koff, key0, kv_len, ldk, head_dim, layout);
}

/// f(std::integral_constant<int, F>{}) with F = the fragments per row of 16: 4 up to head_dim
/// 64, 8 up to 128 (two instantiations of each kernel).
template <class F>
void with_mma_frags(std::int64_t head_dim, F&& f) {
  if (head_dim <= 64)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}

/// The forward on the tensor cores, T = bf16 or fp16 (flash_attention_forward's contract, the
/// Host op's arithmetic in a T matmul scope). Shapes checked by the caller; head_dim <= 128.
template <class T>
void flash_attention_forward_mma(Cuda b, const float* q, const float* k, const float* v,
                                 const std::int32_t* q_positions, std::int64_t batch, std::int64_t q_len,
                                 std::int64_t kv_len, std::int64_t q_heads, std::int64_t kv_heads,
                                 std::int64_t head_dim, float scale, float* out, float* lse) {
  const MmaLayout layout(static_cast<int>(head_dim));
  const std::size_t bytes = MmaShared{layout, 3, 1, 1}.bytes();
  const dim3 grid(static_cast<unsigned>((q_len + kMmaTile - 1) / kMmaTile), static_cast<unsigned>(q_heads),
                  static_cast<unsigned>(batch));
  with_mma_frags(head_dim, [&](auto frags) {
    constexpr int F = decltype(frags)::value;
    flash_allow_shared_memory(flash_attention_forward_mma_kernel<T, F>, bytes, head_dim);
    flash_attention_forward_mma_kernel<T, F><<<grid, kMmaThreads, bytes, b.stream>>>(
        q, k, v, q_positions, q_len, kv_len, q_heads, kv_heads, static_cast<int>(head_dim), scale, out, lse);
    DSP_CUDA_CHECK(cudaGetLastError());
  });
}

/// The dK/dV and dQ kernels on the tensor cores, T = bf16 or fp16, from D = rowsum(dO * O)
/// (dvec, computed by the caller). Shapes checked by the caller; head_dim <= 128.
template <class T>
void flash_attention_backward_mma(Cuda b, const float* q, const float* k, const float* v, const float* dout,
                                  const float* lse, const float* dvec, const std::int32_t* q_positions,
                                  std::int64_t batch, std::int64_t q_len, std::int64_t kv_len, std::int64_t q_heads,
                                  std::int64_t kv_heads, std::int64_t head_dim, float scale, float* dq, float* dk,
                                  float* dv) {
  const MmaLayout layout(static_cast<int>(head_dim));
  const int hd = static_cast<int>(head_dim);
  with_mma_frags(head_dim, [&](auto frags) {
    constexpr int F = decltype(frags)::value;
    // q_len == 0 (or q_heads == 0) still launches: dk and dv are overwritten with 0.
    if (kv_len > 0) {
      const std::size_t bytes = MmaShared{layout, 4, 2, 2}.bytes();
      const dim3 grid(static_cast<unsigned>((kv_len + kMmaTile - 1) / kMmaTile), static_cast<unsigned>(kv_heads),
                      static_cast<unsigned>(batch));
      flash_allow_shared_memory(flash_attention_backward_dkdv_mma_kernel<T, F>, bytes, head_dim);
      flash_attention_backward_dkdv_mma_kernel<T, F><<<grid, kMmaThreads, bytes, b.stream>>>(
          q, k, v, dout, lse, dvec, q_positions, q_len, kv_len, q_heads, kv_heads, hd, scale, dk, dv);
      DSP_CUDA_CHECK(cudaGetLastError());
    }
    // kv_len == 0 still launches: dq is overwritten with 0.
    if (batch * q_len * q_heads > 0) {
      const std::size_t bytes = MmaShared{layout, 4, 2, 1}.bytes();
      const dim3 grid(static_cast<unsigned>((q_len + kMmaTile - 1) / kMmaTile), static_cast<unsigned>(q_heads),
                      static_cast<unsigned>(batch));
      flash_allow_shared_memory(flash_attention_backward_dq_mma_kernel<T, F>, bytes, head_dim);
      flash_attention_backward_dq_mma_kernel<T, F><<<grid, kMmaThreads, bytes, b.stream>>>(
          q, k, v, dout, lse, dvec, q_positions, q_len, kv_len, q_heads, kv_heads, hd, scale, dq);
      DSP_CUDA_CHECK(cudaGetLastError());
    }
  });
}

}  // namespace dsp::backend::detail
