#pragma once
// GEMM with inputs rounded to 16 bits and fp32 accumulation on the host (matmul() inside a
// MatmulPrecisionScope: backend/matmul_precision.hpp): A and B are rounded (round_to: to
// nearest, ties to even) into packed copies, only their used [rows, cols] (a per-head block of
// attention's strided Q, K, V is rounded alone), and multiplied by the fp32 sgemm. The product
// of two 16-bit numbers is exact in fp32 (short of fp32's overflow and underflow range), so this
// is a 16-bit-input GEMM up to the order of its fp32 sums.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "dsp/backend/gemm_args.hpp"
#include "dsp/backend/host/convert.hpp"
#include "dsp/backend/host/copy_columns.hpp"
#include "dsp/backend/host/gemm.hpp"
#include "dsp/backend/host/host.hpp"
#include "dsp/core/memory.hpp"

namespace dsp::backend {

namespace detail {
// A row-major matrix stored [rows, cols] with row stride ld, packed (row stride cols) and
// rounded to T, in a copy counted as Workspace.
template <class T>
std::vector<float, memory::CountingAllocator<float>> rounded_copy(const float* x, std::int64_t rows,
                                                                  std::int64_t cols, std::int64_t ld) {
  std::vector<float, memory::CountingAllocator<float>> out(
      static_cast<std::size_t>(rows * cols), memory::CountingAllocator<float>(memory::Category::Workspace));
  copy_columns(Host{}, x, ld, 0, out.data(), cols, 0, rows, cols);
  round_to(Host{}, rows * cols, out.data(), T{});
  return out;
}
}  // namespace detail

/// gemm's contract (backend/host/gemm.hpp) with A and B rounded to T (bf16 or fp16) first:
/// C[m, n] = alpha * op(round(A)) * op(round(B)) + beta * C, fp32 accumulation and C. A and B
/// are not modified; fp16 rounds values past 65504 to infinity. Throws Error for bad sizes or
/// strides.
template <class T>
void gemm_rounded(Host h, T, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                  const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                  std::int64_t ldc) {
  if (!detail::check_gemm_args(trans_a, trans_b, m, n, k, lda, ldb, ldc)) return;
  const std::int64_t a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  const auto ra = detail::rounded_copy<T>(a, trans_a ? k : m, a_cols, lda);
  const auto rb = detail::rounded_copy<T>(b, trans_b ? n : k, b_cols, ldb);
  gemm(h, trans_a, trans_b, m, n, k, alpha, ra.data(), std::max<std::int64_t>(1, a_cols), rb.data(),
       std::max<std::int64_t>(1, b_cols), beta, c, ldc);
}

}  // namespace dsp::backend
