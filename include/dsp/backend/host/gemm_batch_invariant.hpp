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
// The order: each element accumulates its K products in L lanes (lane l takes k = l, l + L,
// l + 2L, ...; the last partial chunk is zero-padded) by fused multiply-adds in increasing k,
// then the lanes are summed by one fixed tree. L = 16 on CPUs with AVX-512, 8 with AVX2 + FMA,
// and 8 lanes of separate multiplies and adds otherwise; a machine always takes the same path.
// Register tiles of up to 4 rows (3 with AVX2) x 4 columns share loads; the tile shape
// changes which elements are computed together, never the operations of one element. Columns
// are split over the rank's threads (parallel_for), so a thread never changes an element's
// order either.
#include <algorithm>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DSP_HOST_X86_KERNELS 1
#endif

#include "dsp/backend/gemm_args.hpp"
#include "dsp/backend/host/host.hpp"
#include "dsp/backend/host/parallel_for.hpp"

// Unrolls the register tiles' loops (gcc); nvcc's front end, which compiles this header in
// .cu files for the host, does not know the pragma.
#if defined(__CUDACC__)
#define DSP_BI_UNROLL
#else
#define DSP_BI_UNROLL _Pragma("GCC unroll 8")
#endif

namespace dsp::backend {

namespace detail {

// Rows of A kept in cache while the column panels sweep over them.
constexpr std::int64_t bi_rows_per_block = 64;
// Below this many multiply-adds a GEMM runs on the calling thread alone: the demo model's
// decode GEMMs (128 x 384 at one token, 5e4) would spend more on waking helpers than on work.
constexpr std::int64_t bi_parallel_macs = 1 << 20;

#ifdef DSP_HOST_X86_KERNELS
// The 16 lanes of an AVX-512 register summed by one fixed tree (lane l with l + 8, then l + 4,
// l + 2, l + 1), through memory: GCC 12's extract intrinsics warn of undefined operands.
__attribute__((target("avx512f"))) inline float bi_sum16(__m512 v) {
  alignas(64) float l[16];
  _mm512_store_ps(l, v);
  float h[8];
  for (int i = 0; i < 8; ++i) h[i] = l[i] + l[i + 8];
  const float q0 = h[0] + h[4], q1 = h[1] + h[5], q2 = h[2] + h[6], q3 = h[3] + h[7];
  return (q0 + q2) + (q1 + q3);
}

template <int MR, int NR>
__attribute__((target("avx512f"))) void bi_tile_avx512(const float* a, std::int64_t lda, const float* b,
                                                        std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t k) {
  __m512 acc[MR][NR];
  DSP_BI_UNROLL for (int i = 0; i < MR; ++i)
    DSP_BI_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  std::int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) {
    __m512 av[MR];
    DSP_BI_UNROLL for (int i = 0; i < MR; ++i) av[i] = _mm512_loadu_ps(a + i * lda + kk);
    DSP_BI_UNROLL for (int j = 0; j < NR; ++j) {
      const __m512 bv = _mm512_loadu_ps(b + j * ldb + kk);
      DSP_BI_UNROLL for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(av[i], bv, acc[i][j]);
    }
  }
  if (kk < k) {  // the zero-padded last chunk
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - kk)) - 1u);
    __m512 av[MR];
    DSP_BI_UNROLL for (int i = 0; i < MR; ++i) av[i] = _mm512_maskz_loadu_ps(mask, a + i * lda + kk);
    DSP_BI_UNROLL for (int j = 0; j < NR; ++j) {
      const __m512 bv = _mm512_maskz_loadu_ps(mask, b + j * ldb + kk);
      DSP_BI_UNROLL for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(av[i], bv, acc[i][j]);
    }
  }
  DSP_BI_UNROLL for (int i = 0; i < MR; ++i)
    DSP_BI_UNROLL for (int j = 0; j < NR; ++j) c[i * ldc + j] = bi_sum16(acc[i][j]);
}

// The 8 lanes of an AVX register summed by one fixed tree: (l + l+4), then pairs, then the two.
__attribute__((target("avx2,fma"))) inline float bi_sum_avx2(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

template <int MR, int NR>
__attribute__((target("avx2,fma"))) void bi_tile_avx2(const float* a, std::int64_t lda, const float* b,
                                                       std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t k) {
  __m256 acc[MR][NR];
  DSP_BI_UNROLL for (int i = 0; i < MR; ++i)
    DSP_BI_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  std::int64_t kk = 0;
  for (; kk + 8 <= k; kk += 8) {
    __m256 av[MR];
    DSP_BI_UNROLL for (int i = 0; i < MR; ++i) av[i] = _mm256_loadu_ps(a + i * lda + kk);
    DSP_BI_UNROLL for (int j = 0; j < NR; ++j) {
      const __m256 bv = _mm256_loadu_ps(b + j * ldb + kk);
      DSP_BI_UNROLL for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(av[i], bv, acc[i][j]);
    }
  }
  if (kk < k) {  // the zero-padded last chunk
    alignas(32) std::int32_t lanes[8];
    DSP_BI_UNROLL for (int l = 0; l < 8; ++l) lanes[l] = kk + l < k ? -1 : 0;
    const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    __m256 av[MR];
    DSP_BI_UNROLL for (int i = 0; i < MR; ++i) av[i] = _mm256_maskload_ps(a + i * lda + kk, mask);
    DSP_BI_UNROLL for (int j = 0; j < NR; ++j) {
      const __m256 bv = _mm256_maskload_ps(b + j * ldb + kk, mask);
      DSP_BI_UNROLL for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(av[i], bv, acc[i][j]);
    }
  }
  DSP_BI_UNROLL for (int i = 0; i < MR; ++i)
    DSP_BI_UNROLL for (int j = 0; j < NR; ++j) c[i * ldc + j] = bi_sum_avx2(acc[i][j]);
}
#endif

// The portable path: 8 lanes of separate multiplies and adds, summed by the same tree as AVX2.
template <int MR, int NR>
void bi_tile_generic(const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc,
                     std::int64_t k) {
  float acc[MR][NR][8] = {};
  for (std::int64_t kk = 0; kk < k; kk += 8) {
    DSP_BI_UNROLL for (int l = 0; l < 8; ++l) {
      if (kk + l >= k) break;
      DSP_BI_UNROLL for (int i = 0; i < MR; ++i)
        DSP_BI_UNROLL for (int j = 0; j < NR; ++j) {
          const float product = a[i * lda + kk + l] * b[j * ldb + kk + l];
          acc[i][j][l] = acc[i][j][l] + product;
        }
    }
  }
  DSP_BI_UNROLL for (int i = 0; i < MR; ++i)
    DSP_BI_UNROLL for (int j = 0; j < NR; ++j) {
      const float* v = acc[i][j];
      const float h0 = v[0] + v[4], h1 = v[1] + v[5], h2 = v[2] + v[6], h3 = v[3] + v[7];
      c[i * ldc + j] = (h0 + h2) + (h1 + h3);
    }
}

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

using BiTile = void (*)(const float*, std::int64_t, const float*, std::int64_t, float*, std::int64_t, std::int64_t);

// The tile kernel of `mr` rows x `nr` columns (1..4 each) for this machine.
template <int MR>
BiTile bi_tile_of_rows(BiIsa isa, std::int64_t nr) {
  switch (isa) {
#ifdef DSP_HOST_X86_KERNELS
    case BiIsa::Avx512: {
      constexpr BiTile t[] = {bi_tile_avx512<MR, 1>, bi_tile_avx512<MR, 2>, bi_tile_avx512<MR, 3>, bi_tile_avx512<MR, 4>};
      return t[nr - 1];
    }
    case BiIsa::Avx2: {
      constexpr BiTile t[] = {bi_tile_avx2<MR, 1>, bi_tile_avx2<MR, 2>, bi_tile_avx2<MR, 3>, bi_tile_avx2<MR, 4>};
      return t[nr - 1];
    }
#endif
    default: {
      constexpr BiTile t[] = {bi_tile_generic<MR, 1>, bi_tile_generic<MR, 2>, bi_tile_generic<MR, 3>,
                              bi_tile_generic<MR, 4>};
      return t[nr - 1];
    }
  }
}
inline BiTile bi_tile(BiIsa isa, std::int64_t mr, std::int64_t nr) {
  switch (mr) {
    case 1: return bi_tile_of_rows<1>(isa, nr);
    case 2: return bi_tile_of_rows<2>(isa, nr);
    case 3: return bi_tile_of_rows<3>(isa, nr);
    default: return bi_tile_of_rows<4>(isa, nr);
  }
}

// Columns [n0, n1) of C, every row.
inline void bi_columns(BiIsa isa, std::int64_t m, std::int64_t n0, std::int64_t n1, std::int64_t k, const float* a,
                       std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
  // AVX2's 16 registers hold a 3 x 4 tile's 12 accumulators, 3 rows of A and a row of B; a
  // 4 x 4 tile would spill accumulators to the stack (measured: half the speed).
  const std::int64_t max_rows = isa == BiIsa::Avx2 ? 3 : 4;
  for (std::int64_t r0 = 0; r0 < m; r0 += bi_rows_per_block) {
    const std::int64_t r1 = std::min(m, r0 + bi_rows_per_block);
    for (std::int64_t j = n0; j < n1; j += 4) {
      const std::int64_t nr = std::min<std::int64_t>(4, n1 - j);
      for (std::int64_t i = r0; i < r1; i += max_rows) {
        const std::int64_t mr = std::min<std::int64_t>(max_rows, r1 - i);
        bi_tile(isa, mr, nr)(a + i * lda, lda, b + j * ldb, ldb, c + i * ldc + j, ldc, k);
      }
    }
  }
}

}  // namespace detail

/// C[m, n] = A[m, k] B[n, k]^T, every matrix row-major with row strides lda, ldb, ldc
/// (A [tokens, in] activations, B [out, in] a linear layer's weight). Overwrites C. Each
/// element of C is computed by the same operations whatever m is and wherever its row is in
/// A (the order is in the header comment), so a row of C depends on its row of A and on B
/// alone, bitwise. Within ~K ulp of an fp32 GEMM. Throws Error for negative sizes or strides
/// shorter than a row (as gemm).
inline void gemm_nt_batch_invariant(Host h, std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
                                    std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
  if (!detail::check_gemm_args(false, true, m, n, k, lda, ldb, ldc)) return;
  const detail::BiIsa isa = detail::bi_isa();
  const std::int64_t threads = m * n * k < detail::bi_parallel_macs ? 1 : host_threads(h);
  // Column ranges of whole 4-column panels, one per thread.
  const std::int64_t panels = (n + 3) / 4, per = (panels + threads - 1) / threads;
  const std::int64_t tasks = (panels + per - 1) / per;
  parallel_for(h, tasks, [&](std::int64_t t) {
    const std::int64_t n0 = t * per * 4, n1 = std::min(n, (t + 1) * per * 4);
    detail::bi_columns(isa, m, n0, n1, k, a, lda, b, ldb, c, ldc);
  });
}

}  // namespace dsp::backend

#undef DSP_BI_UNROLL
