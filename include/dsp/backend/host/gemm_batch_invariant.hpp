#pragma once
// A batch-invariant GEMM on the host: C[m, n] = sum_k A[m, k] B[n, k] (the linear layer's
// x w^T), where every element of C is computed by the same sequence of operations whatever m
// is and wherever its row sits in A. OpenBLAS is not batch-invariant: its kernels for the
// row remainder and its K blocking depend on the matrix sizes, so one token's logits change in
// the last bits with the number of tokens beside it (measured on OpenBLAS 0.3.21, Zen: 0 of 25
// transformer shapes gave equal rows for m = 1 and m = 2..64). Serving runs its forward
// passes through this kernel (backend/batch_invariance.hpp) so that a request's tokens do not
// depend on the batch it was decoded in (He et al., Thinking Machines Lab 2025, "Defeating
// Nondeterminism in LLM Inference": fixed reduction order, no split-K).
//
// The order: every element of C is one chain of fused multiply-adds in increasing k, from +0:
// c = fma(a[i][0], b[j][0], 0), c = fma(a[i][1], b[j][1], c), ..., c = fma(a[i][k-1], b[j][k-1],
// c). No lanes, no reduction tree, no split-K. Since an fma rounds once (IEEE 754), any code that
// performs that chain gives the same bits: a naive loop of std::fma (the test's reference), this
// kernel on AVX-512, on AVX2 + FMA or its portable path, on any number of threads, and the CUDA
// kernel (backend/cuda/gemm_batch_invariant.cuh). So the kernel takes whichever implementation
// suits the shape, and its results do not depend on the machine's vector width either.
//
// Implementations (x86; the portable path is a loop of std::fma):
// - Whole groups of V rows (V = 16 with AVX-512, 8 with AVX2): vectorised over the group's
//   rows. The group of A is packed transposed ([k, V], once per call), each element of B is
//   broadcast, and a register tile holds V rows x NR columns (NR = 24, or 12 in AVX2's 16
//   registers) of accumulators: the outer-product form, compute-efficient for a step of 16-64
//   decoding tokens.
// - The rows after them (fewer than V: one decoding token, or a few): vectorised over V columns
//   instead, B's V x V blocks transposed in registers, so one token does not pay for V.
// - B packed in panels (packed_weights.hpp: a served model's weights, copied once), AVX-512:
//   tiles of up to 8 rows x 48 columns over one panel, 3 vectors of B and 8 broadcasts of A for
//   24 fmas, B prefetched as one stream. Any m; no packing of A, no transposes (benchmarks/
//   RESULTS.md: the 100 M model's decode step).
// Columns go to the rank's threads in whole units of every tile width (parallel_for); a thread
// never changes an element's chain.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DSP_HOST_X86_KERNELS 1
#endif

#include "dsp/backend/gemm_args.hpp"
#include "dsp/backend/host/host.hpp"
#include "dsp/backend/host/packed_weights.hpp"
#include "dsp/backend/host/parallel_for.hpp"

// Unrolls the register tiles' loops whole (gcc), so that the accumulators stay in registers;
// nvcc's front end, which compiles this header in .cu files for the host, does not know it.
#if defined(__CUDACC__)
#define DSP_BI_UNROLL
#else
#define DSP_BI_UNROLL _Pragma("GCC unroll 32")
#endif

namespace dsp::backend {

namespace detail {

// Below this many multiply-adds a GEMM runs on the calling thread alone: the demo model's
// decode GEMMs (128 x 384 at one token, 5e4) would spend more on waking helpers than on work.
constexpr std::int64_t bi_parallel_macs = 1 << 20;
// Columns handed to a thread at a time, and swept by every kernel before the next: a multiple
// of each tile width (24, 16, 12, 8), and B's rows of a unit (48 x k) stay in L2 meanwhile.
constexpr std::int64_t bi_column_unit = packed_panel_width;

#ifdef DSP_HOST_X86_KERNELS
// Rows kernel, AVX-512: C[0..16, 0..NR) of one group of 16 rows, whose A is packed as
// at[k][16].
template <int NR>
__attribute__((target("avx512f"))) void bi_rows_avx512(const float* at, const float* b, std::int64_t ldb, float* c,
                                                        std::int64_t ldc, std::int64_t k) {
  __m512 acc[NR];
  DSP_BI_UNROLL for (int j = 0; j < NR; ++j) acc[j] = _mm512_setzero_ps();
  for (std::int64_t kk = 0; kk < k; ++kk) {
    const __m512 a = _mm512_loadu_ps(at + kk * 16);
    DSP_BI_UNROLL for (int j = 0; j < NR; ++j) acc[j] = _mm512_fmadd_ps(a, _mm512_set1_ps(b[j * ldb + kk]), acc[j]);
  }
  alignas(64) float lanes[16];
  for (int j = 0; j < NR; ++j) {
    _mm512_store_ps(lanes, acc[j]);
    for (int r = 0; r < 16; ++r) c[r * ldc + j] = lanes[r];
  }
}

// r[j] = 16 consecutive k of column j  ->  r[l] = the 16 columns at the l-th of those k. The
// zero-masked forms of the shuffles: GCC 12's plain ones warn of an undefined operand.
__attribute__((target("avx512f"))) inline void bi_transpose16(__m512 r[16]) {
  constexpr __mmask16 all = 0xffff;
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // pairs of columns interleaved
    t[2 * i] = _mm512_maskz_unpacklo_ps(all, r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_maskz_unpackhi_ps(all, r[2 * i], r[2 * i + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // quads: each 128-bit lane holds 4 columns at one k
    const __m512d lo0 = _mm512_castps_pd(t[4 * q]), lo1 = _mm512_castps_pd(t[4 * q + 2]);
    const __m512d hi0 = _mm512_castps_pd(t[4 * q + 1]), hi1 = _mm512_castps_pd(t[4 * q + 3]);
    r[4 * q] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(0xff, lo0, lo1));
    r[4 * q + 1] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(0xff, lo0, lo1));
    r[4 * q + 2] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(0xff, hi0, hi1));
    r[4 * q + 3] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(0xff, hi0, hi1));
  }
  for (int s = 0; s < 4; ++s) {  // gather the four quads' 128-bit lanes
    const __m512 e0 = _mm512_maskz_shuffle_f32x4(all, r[s], r[4 + s], 0x88);
    const __m512 o0 = _mm512_maskz_shuffle_f32x4(all, r[s], r[4 + s], 0xdd);
    const __m512 e1 = _mm512_maskz_shuffle_f32x4(all, r[8 + s], r[12 + s], 0x88);
    const __m512 o1 = _mm512_maskz_shuffle_f32x4(all, r[8 + s], r[12 + s], 0xdd);
    t[s] = _mm512_maskz_shuffle_f32x4(all, e0, e1, 0x88);
    t[8 + s] = _mm512_maskz_shuffle_f32x4(all, e0, e1, 0xdd);
    t[4 + s] = _mm512_maskz_shuffle_f32x4(all, o0, o1, 0x88);
    t[12 + s] = _mm512_maskz_shuffle_f32x4(all, o0, o1, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Few-rows kernel, AVX-512: C[0..M, 0..cols) (cols <= 16) from A's rows and B's rows directly.
template <int M>
__attribute__((target("avx512f"))) void bi_few_avx512(const float* a, std::int64_t lda, const float* b,
                                                       std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t cols,
                                                       std::int64_t k) {
  __m512 acc[M];
  DSP_BI_UNROLL for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
  for (std::int64_t kk = 0; kk < k; kk += 16) {
    const std::int64_t len = std::min<std::int64_t>(16, k - kk);
    const auto kmask = static_cast<__mmask16>((1u << len) - 1u);
    __m512 r[16];
    for (int j = 0; j < 16; ++j) r[j] = j < cols ? _mm512_maskz_loadu_ps(kmask, b + j * ldb + kk) : _mm512_setzero_ps();
    bi_transpose16(r);
    if (len == 16) {
      DSP_BI_UNROLL for (int l = 0; l < 16; ++l)
        DSP_BI_UNROLL for (int i = 0; i < M; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[i * lda + kk + l]), r[l], acc[i]);
    } else {  // only the k that exist: a padded fma could turn a -0 sum into +0
      for (std::int64_t l = 0; l < len; ++l)
        DSP_BI_UNROLL for (int i = 0; i < M; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[i * lda + kk + l]), r[l], acc[i]);
    }
  }
  const auto cmask = static_cast<__mmask16>((1u << cols) - 1u);
  DSP_BI_UNROLL for (int i = 0; i < M; ++i) _mm512_mask_storeu_ps(c + i * ldc, cmask, acc[i]);
}

// Rows kernel, AVX2: one group of 8 rows packed as at[k][8], NR columns (16 registers: NR = 12
// accumulators, A's vector and a broadcast).
template <int NR>
__attribute__((target("avx2,fma"))) void bi_rows_avx2(const float* at, const float* b, std::int64_t ldb, float* c,
                                                       std::int64_t ldc, std::int64_t k) {
  __m256 acc[NR];
  DSP_BI_UNROLL for (int j = 0; j < NR; ++j) acc[j] = _mm256_setzero_ps();
  for (std::int64_t kk = 0; kk < k; ++kk) {
    const __m256 a = _mm256_loadu_ps(at + kk * 8);
    DSP_BI_UNROLL for (int j = 0; j < NR; ++j) acc[j] = _mm256_fmadd_ps(a, _mm256_broadcast_ss(b + j * ldb + kk), acc[j]);
  }
  alignas(32) float lanes[8];
  for (int j = 0; j < NR; ++j) {
    _mm256_store_ps(lanes, acc[j]);
    for (int r = 0; r < 8; ++r) c[r * ldc + j] = lanes[r];
  }
}

// r[j] = 8 consecutive k of column j  ->  r[l] = the 8 columns at the l-th of those k.
__attribute__((target("avx2,fma"))) inline void bi_transpose8(__m256 r[8]) {
  __m256 t[8], q[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {
    q[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    q[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xee);
    q[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    q[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xee);
  }
  for (int s = 0; s < 4; ++s) {
    r[s] = _mm256_permute2f128_ps(q[s], q[4 + s], 0x20);
    r[4 + s] = _mm256_permute2f128_ps(q[s], q[4 + s], 0x31);
  }
}

// Few-rows kernel, AVX2: C[0..M, 0..cols) (cols <= 8).
template <int M>
__attribute__((target("avx2,fma"))) void bi_few_avx2(const float* a, std::int64_t lda, const float* b,
                                                      std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t cols,
                                                      std::int64_t k) {
  __m256 acc[M];
  DSP_BI_UNROLL for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
  alignas(32) std::int32_t kmask_lanes[8], cmask_lanes[8];
  for (int l = 0; l < 8; ++l) cmask_lanes[l] = l < cols ? -1 : 0;
  for (std::int64_t kk = 0; kk < k; kk += 8) {
    const std::int64_t len = std::min<std::int64_t>(8, k - kk);
    __m256 r[8];
    if (len == 8) {
      for (int j = 0; j < 8; ++j) r[j] = j < cols ? _mm256_loadu_ps(b + j * ldb + kk) : _mm256_setzero_ps();
    } else {
      for (int l = 0; l < 8; ++l) kmask_lanes[l] = l < len ? -1 : 0;
      const __m256i kmask = _mm256_load_si256(reinterpret_cast<const __m256i*>(kmask_lanes));
      for (int j = 0; j < 8; ++j) r[j] = j < cols ? _mm256_maskload_ps(b + j * ldb + kk, kmask) : _mm256_setzero_ps();
    }
    bi_transpose8(r);
    for (std::int64_t l = 0; l < len; ++l)
      DSP_BI_UNROLL for (int i = 0; i < M; ++i) acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(a + i * lda + kk + l), r[l], acc[i]);
  }
  const __m256i cmask = _mm256_load_si256(reinterpret_cast<const __m256i*>(cmask_lanes));
  DSP_BI_UNROLL for (int i = 0; i < M; ++i) _mm256_maskstore_ps(c + i * ldc, cmask, acc[i]);
}

// Panel kernel, AVX-512: C[0..M, 0..cols) (M <= 8, cols <= 48) from M rows of A and one panel
// of B ([k][48], packed_weights.hpp). With 24 fmas per 192 bytes of panel the core alone keeps
// too few loads in flight to stream B from DRAM, so it prefetches: the panel 32 k ahead into L1,
// and the `next` panel (nullptr: none) into L2, this pass's share of it when the rows take
// `passes` passes over the panel (so that DRAM keeps streaming while a second pass computes from
// L2). Measured (16 rows over 400 MB of panels, Xeon 2 cores): 38 ms without prefetching, 28 ms
// with the first, 22-24 ms with both; one row 16 -> 14.5-15 ms.
template <int M>
__attribute__((target("avx512f"))) void bi_panel_avx512(const float* a, std::int64_t lda, const float* panel,
                                                         const float* next, std::int64_t pass, std::int64_t passes,
                                                         float* c, std::int64_t ldc, std::int64_t cols, std::int64_t k) {
  constexpr std::int64_t w = packed_panel_width, ahead = 32;
  __m512 acc[M][3];
  DSP_BI_UNROLL for (int i = 0; i < M; ++i) DSP_BI_UNROLL for (int q = 0; q < 3; ++q) acc[i][q] = _mm512_setzero_ps();
  for (std::int64_t kk = 0; kk < k; ++kk) {
    const float* row = panel + kk * w;
    // As an integer: near the end the address lies past the panels (prefetches never fault).
    const std::uintptr_t soon = reinterpret_cast<std::uintptr_t>(row) + ahead * w * sizeof(float);
    DSP_BI_UNROLL for (int q = 0; q < 3; ++q) _mm_prefetch(reinterpret_cast<const char*>(soon + 64 * q), _MM_HINT_T0);
    if (next) {
      const float* later = next + ((pass * k + kk) / passes) * w;
      DSP_BI_UNROLL for (int q = 0; q < 3; ++q) _mm_prefetch(reinterpret_cast<const char*>(later + 16 * q), _MM_HINT_T1);
    }
    const __m512 b0 = _mm512_loadu_ps(row), b1 = _mm512_loadu_ps(row + 16), b2 = _mm512_loadu_ps(row + 32);
    DSP_BI_UNROLL for (int i = 0; i < M; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * lda + kk]);
      acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(x, b2, acc[i][2]);
    }
  }
  __mmask16 mask[3];
  for (int q = 0; q < 3; ++q) {
    const std::int64_t left = std::clamp<std::int64_t>(cols - 16 * q, 0, 16);
    mask[q] = static_cast<__mmask16>((1u << left) - 1u);
  }
  DSP_BI_UNROLL for (int i = 0; i < M; ++i) DSP_BI_UNROLL for (int q = 0; q < 3; ++q)
    _mm512_mask_storeu_ps(c + i * ldc + 16 * q, mask[q], acc[i][q]);
}
#endif

enum class BiIsa { Generic, Avx2, Avx512 };

inline BiIsa bi_isa() {
#ifdef DSP_HOST_X86_KERNELS
  static const BiIsa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return BiIsa::Avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return BiIsa::Avx2;
    return BiIsa::Generic;
  }();
  return isa;
#else
  return BiIsa::Generic;
#endif
}

// Rows in a group of the rows kernel: its vector width (the portable path packs none).
inline std::int64_t bi_group_rows(BiIsa isa) { return isa == BiIsa::Avx512 ? 16 : isa == BiIsa::Avx2 ? 8 : 0; }

// Rows of A that go to the rows kernel: its whole groups (the rest to the few-rows kernel).
inline std::int64_t bi_packed_rows(BiIsa isa, std::int64_t m) {
  const std::int64_t v = bi_group_rows(isa);
  return v == 0 ? 0 : m - m % v;
}

// A's rows [0, rows) (whole groups of v) packed per group as at[group][k][v].
inline void bi_pack_groups(const float* a, std::int64_t lda, std::int64_t rows, std::int64_t k, std::int64_t v,
                           std::vector<float>& at) {
  at.resize(static_cast<std::size_t>(rows * k));
  for (std::int64_t i = 0; i < rows; ++i) {
    float* dst = at.data() + (i / v) * k * v + i % v;
    const float* src = a + i * lda;
    for (std::int64_t kk = 0; kk < k; ++kk) dst[kk * v] = src[kk];
  }
}

using BiRows = void (*)(const float*, const float*, std::int64_t, float*, std::int64_t, std::int64_t);
using BiFew = void (*)(const float*, std::int64_t, const float*, std::int64_t, float*, std::int64_t, std::int64_t,
                       std::int64_t);
using BiPanel = void (*)(const float*, std::int64_t, const float*, const float*, std::int64_t, std::int64_t, float*,
                        std::int64_t, std::int64_t, std::int64_t);

// The rows kernel of this machine for tiles of nr columns (its widest, a third of it, or 1).
inline BiRows bi_rows_kernel(BiIsa isa, std::int64_t nr) {
#ifdef DSP_HOST_X86_KERNELS
  if (isa == BiIsa::Avx512) return nr == 24 ? bi_rows_avx512<24> : nr == 8 ? bi_rows_avx512<8> : bi_rows_avx512<1>;
  if (isa == BiIsa::Avx2) return nr == 12 ? bi_rows_avx2<12> : nr == 4 ? bi_rows_avx2<4> : bi_rows_avx2<1>;
#endif
  (void)isa, (void)nr;
  return nullptr;
}

// The few-rows kernel of this machine for m rows (1 <= m < bi_group_rows).
inline BiFew bi_few_kernel(BiIsa isa, std::int64_t m) {
#ifdef DSP_HOST_X86_KERNELS
  if (isa == BiIsa::Avx512) {
    constexpr BiFew k[] = {bi_few_avx512<1>,  bi_few_avx512<2>,  bi_few_avx512<3>,  bi_few_avx512<4>,  bi_few_avx512<5>,
                           bi_few_avx512<6>,  bi_few_avx512<7>,  bi_few_avx512<8>,  bi_few_avx512<9>,  bi_few_avx512<10>,
                           bi_few_avx512<11>, bi_few_avx512<12>, bi_few_avx512<13>, bi_few_avx512<14>, bi_few_avx512<15>};
    return k[m - 1];
  }
  if (isa == BiIsa::Avx2) {
    constexpr BiFew k[] = {bi_few_avx2<1>, bi_few_avx2<2>, bi_few_avx2<3>, bi_few_avx2<4>,
                           bi_few_avx2<5>, bi_few_avx2<6>, bi_few_avx2<7>};
    return k[m - 1];
  }
#endif
  (void)isa, (void)m;
  return nullptr;
}

// Rows of A in one tile of the panel kernel.
constexpr std::int64_t bi_panel_rows = 8;

// The panel kernel for m rows (1 <= m <= bi_panel_rows); AVX-512 only.
inline BiPanel bi_panel_kernel(std::int64_t m) {
#ifdef DSP_HOST_X86_KERNELS
  constexpr BiPanel k[] = {bi_panel_avx512<1>, bi_panel_avx512<2>, bi_panel_avx512<3>, bi_panel_avx512<4>,
                              bi_panel_avx512<5>, bi_panel_avx512<6>, bi_panel_avx512<7>, bi_panel_avx512<8>};
  return k[m - 1];
#else
  (void)m;
  return nullptr;
#endif
}

// Columns [n0, n1) of C (n0 a multiple of the panel width), every row, from B's panels.
inline void bi_panel_columns(std::int64_t m, const float* panels, std::int64_t n0, std::int64_t n1, std::int64_t k,
                             const float* a, std::int64_t lda, float* c, std::int64_t ldc) {
  const std::int64_t passes = (m + bi_panel_rows - 1) / bi_panel_rows;
  for (std::int64_t j = n0; j < n1; j += packed_panel_width) {
    const float* panel = panels + (j / packed_panel_width) * k * packed_panel_width;
    const float* next = j + packed_panel_width < n1 ? panel + k * packed_panel_width : nullptr;
    const std::int64_t cols = std::min(packed_panel_width, n1 - j);
    for (std::int64_t pass = 0; pass < passes; ++pass) {
      const std::int64_t r0 = pass * bi_panel_rows, rows = std::min(bi_panel_rows, m - r0);
      bi_panel_kernel(rows)(a + r0 * lda, lda, panel, next, pass, passes, c + r0 * ldc + j, ldc, cols, k);
    }
  }
}

// Columns [n0, n1) of C, every row; `at` holds A's first `packed` rows (bi_pack_groups).
inline void bi_columns(BiIsa isa, std::int64_t m, std::int64_t packed, const float* at, std::int64_t n0,
                       std::int64_t n1, std::int64_t k, const float* a, std::int64_t lda, const float* b,
                       std::int64_t ldb, float* c, std::int64_t ldc) {
  if (isa == BiIsa::Generic) {
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = n0; j < n1; ++j) {
        float sum = 0.0f;
        for (std::int64_t kk = 0; kk < k; ++kk) sum = std::fma(a[i * lda + kk], b[j * ldb + kk], sum);
        c[i * ldc + j] = sum;
      }
    return;
  }
  const std::int64_t v = bi_group_rows(isa), widest = isa == BiIsa::Avx512 ? 24 : 12;
  const BiFew few = m > packed ? bi_few_kernel(isa, m - packed) : nullptr;
  for (std::int64_t u0 = n0; u0 < n1; u0 += bi_column_unit) {
    const std::int64_t u1 = std::min(n1, u0 + bi_column_unit);
    for (std::int64_t j = u0; j < u1;) {
      const std::int64_t nr = u1 - j >= widest ? widest : u1 - j >= widest / 3 ? widest / 3 : 1;
      const BiRows rows = bi_rows_kernel(isa, nr);
      for (std::int64_t r0 = 0; r0 < packed; r0 += v) rows(at + r0 * k, b + j * ldb, ldb, c + r0 * ldc + j, ldc, k);
      j += nr;
    }
    if (few)
      for (std::int64_t j = u0; j < u1; j += v)
        few(a + packed * lda, lda, b + j * ldb, ldb, c + packed * ldc + j, ldc, std::min(v, u1 - j), k);
  }
}

}  // namespace detail

/// True where gemm_nt_batch_invariant reads the panels of a PackedWeightsScope's weights (its
/// panel kernel needs AVX-512); elsewhere it reads B in place and packing would only cost memory.
inline bool reads_packed_weights() { return detail::bi_isa() == detail::BiIsa::Avx512; }

/// C[m, n] = A[m, k] B[n, k]^T, every matrix row-major with row strides lda, ldb, ldc
/// (A [tokens, in] activations, B [out, in] a linear layer's weight). Overwrites C. Each
/// element of C is one chain of fused multiply-adds over k in increasing order (header
/// comment), whatever m is, wherever its row is in A and on whichever machine or thread count,
/// so a row of C depends on its row of A and on B alone, bitwise, and equals a loop of std::fma
/// (within fp32's error bound of any other fp32 GEMM: both are k-term sums in some order). In
/// a PackedWeightsScope whose weights hold B (same address, n, k, ldb == k) it reads B's
/// panels instead, where reads_packed_weights(): the same bits, faster. Throws Error for
/// negative sizes or strides shorter than a row (as gemm).
inline void gemm_nt_batch_invariant(Host h, std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
                                    std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
  if (!detail::check_gemm_args(false, true, m, n, k, lda, ldb, ldc)) return;
  const detail::BiIsa isa = detail::bi_isa();
  const std::int64_t threads = m * n * k < detail::bi_parallel_macs ? 1 : host_threads(h);
  // Column ranges of whole units, one per thread.
  const std::int64_t units = (n + detail::bi_column_unit - 1) / detail::bi_column_unit;
  const std::int64_t per = (units + threads - 1) / threads, tasks = (units + per - 1) / per;
  const PackedWeights* packed_b = packed_weights();
  if (const float* panels = packed_b && reads_packed_weights() ? packed_b->find(b, n, k, ldb) : nullptr) {
    packed_b->count_read();
    parallel_for(h, tasks, [&](std::int64_t t) {
      detail::bi_panel_columns(m, panels, t * per * detail::bi_column_unit,
                               std::min(n, (t + 1) * per * detail::bi_column_unit), k, a, lda, c, ldc);
    });
    return;
  }
  const std::int64_t v = detail::bi_group_rows(isa), packed = detail::bi_packed_rows(isa, m);
  thread_local std::vector<float> groups;  // A's packed groups (this thread's buffer)
  if (packed > 0) detail::bi_pack_groups(a, lda, packed, k, v, groups);
  const float* at = groups.data();  // read by every thread of the call: by pointer, not by name
  parallel_for(h, tasks, [&](std::int64_t t) {
    const std::int64_t n0 = t * per * detail::bi_column_unit;
    const std::int64_t n1 = std::min(n, (t + 1) * per * detail::bi_column_unit);
    detail::bi_columns(isa, m, packed, at, n0, n1, k, a, lda, b, ldb, c, ldc);
  });
  // Kept for the next call (a decode step's GEMMs pack the same sizes), unless a long prefill
  // chunk made it large.
  if (groups.capacity() > (std::size_t{1} << 20)) std::vector<float>().swap(groups);
}

}  // namespace dsp::backend

#undef DSP_BI_UNROLL
