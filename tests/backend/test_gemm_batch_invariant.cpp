// The batch-invariant host GEMM (backend/host/gemm_batch_invariant.hpp): every element equals a
// naive loop of std::fma over k bitwise, on each of the kernel's paths (AVX-512, AVX2, portable)
// and for every shape that selects a different kernel; a row of C is the same bitwise whatever
// the number of rows and wherever the row sits, on one thread or several; it agrees with
// OpenBLAS's sgemm within fp32's error bound; linear_forward takes it inside a
// BatchInvariantScope (and OpenBLAS outside, which is not invariant: the reason it exists); in a
// PackedWeightsScope it reads B's panels where they match, with the same bits.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "dsp/backend/batch_invariance.hpp"
#include "dsp/backend/host/gemm.hpp"
#include "dsp/backend/host/gemm_batch_invariant.hpp"
#include "dsp/backend/host/packed_weights.hpp"
#include "dsp/backend/linear.hpp"
#include "dsp/core/threads.hpp"
#include "gradcheck.hpp"

namespace backend_gemm_batch_invariant_test {

using namespace dsp;
using backend::Host;

namespace {

// C [m, n] of A's rows `rows` (indices into a [*, k] matrix) against B [n, k].
std::vector<float> product(const std::vector<float>& a, const std::vector<std::int64_t>& rows, const std::vector<float>& b,
                           std::int64_t n, std::int64_t k) {
  std::vector<float> x;
  for (auto r : rows) x.insert(x.end(), a.begin() + r * k, a.begin() + (r + 1) * k);
  std::vector<float> c(rows.size() * static_cast<std::size_t>(n));
  backend::gemm_nt_batch_invariant(Host{}, static_cast<std::int64_t>(rows.size()), n, k, x.data(), k, b.data(), k,
                                   c.data(), n);
  return c;
}

// The reference order: one std::fma chain over k in increasing order, from +0.
std::vector<float> fma_chain(const float* a, std::int64_t lda, const float* b, std::int64_t ldb, std::int64_t m,
                             std::int64_t n, std::int64_t k) {
  std::vector<float> c(static_cast<std::size_t>(m * n));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (std::int64_t l = 0; l < k; ++l) sum = std::fma(a[i * lda + l], b[j * ldb + l], sum);
      c[static_cast<std::size_t>(i * n + j)] = sum;
    }
  return c;
}

// C by one of the kernel's paths, on this thread (the path need not be this machine's own).
std::vector<float> by_path(backend::detail::BiIsa isa, const float* a, std::int64_t lda, const float* b,
                           std::int64_t ldb, std::int64_t m, std::int64_t n, std::int64_t k) {
  std::vector<float> at, c(static_cast<std::size_t>(m * n));
  const std::int64_t packed = backend::detail::bi_packed_rows(isa, m);
  if (packed > 0) backend::detail::bi_pack_groups(a, lda, packed, k, backend::detail::bi_group_rows(isa), at);
  backend::detail::bi_columns(isa, m, packed, at.data(), 0, n, k, a, lda, b, ldb, c.data(), n);
  return c;
}

bool cpu_has(backend::detail::BiIsa isa) {
  using backend::detail::BiIsa;
  const BiIsa here = backend::detail::bi_isa();
  return isa == BiIsa::Generic || isa == here || (isa == BiIsa::Avx2 && here == BiIsa::Avx512);
}

}  // namespace

TEST_CASE("batch-invariant gemm: every element is the fma chain over k, on every path and for every kernel's shape") {
  using backend::detail::BiIsa;
  // m 1-40: the few-rows kernel alone for every row count it has (1-15 with AVX-512, 1-7 with
  // AVX2), whole groups, groups then every remainder; n and k: tiles and units whole and cut (k
  // tails of the 16- and 8-wide transposes, k = 0; n tails of the 24/8/1 tiles, of the 48-column
  // unit).
  const std::int64_t lda = 141, ldb = 139;  // strides beyond the rows: a slice of a wider matrix
  const auto a = test::random_vector(static_cast<std::size_t>(40 * lda), 7);
  const auto b = test::random_vector(static_cast<std::size_t>(101 * ldb), 8);
  for (const BiIsa isa : {BiIsa::Avx512, BiIsa::Avx2, BiIsa::Generic}) {
    if (!cpu_has(isa)) continue;
    CAPTURE(static_cast<int>(isa));
    for (std::int64_t m = 1; m <= 40; ++m)
      for (const auto& [n, k] :
           {std::pair<std::int64_t, std::int64_t>{101, 139}, {48, 16}, {33, 8}, {7, 1}, {25, 17}, {20, 0}}) {
        CAPTURE(m);
        CAPTURE(n);
        CAPTURE(k);
        const std::vector<float> c = by_path(isa, a.data(), lda, b.data(), ldb, m, n, k);
        CHECK(std::memcmp(c.data(), fma_chain(a.data(), lda, b.data(), ldb, m, n, k).data(), c.size() * sizeof(float)) == 0);
      }
  }
  // The public entry (this machine's path; the second above bi_parallel_macs, so on every
  // thread of the rank) with strided C as well, whose gaps stay untouched.
  const std::int64_t big_k = 300;
  const auto big_a = test::random_vector(static_cast<std::size_t>(40 * big_k), 9);
  const auto big_b = test::random_vector(static_cast<std::size_t>(101 * big_k), 10);
  for (const auto& [m, n, k] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{3, 101, 139}, {40, 101, big_k}}) {
    CAPTURE(m);
    const bool big = k == big_k;
    const float* pa = big ? big_a.data() : a.data();
    const float* pb = big ? big_b.data() : b.data();
    const std::int64_t la = big ? big_k : lda, lb = big ? big_k : ldb, ldc = n + 5;
    if (big) CHECK(m * n * k >= backend::detail::bi_parallel_macs);
    std::vector<float> c(static_cast<std::size_t>(m * ldc), -1.0f);
    backend::gemm_nt_batch_invariant(Host{}, m, n, k, pa, la, pb, lb, c.data(), ldc);
    const std::vector<float> ref = fma_chain(pa, la, pb, lb, m, n, k);
    for (std::int64_t i = 0; i < m; ++i) {
      CHECK(std::memcmp(c.data() + i * ldc, ref.data() + i * n, static_cast<std::size_t>(n) * sizeof(float)) == 0);
      for (std::int64_t j = n; j < ldc; ++j) CHECK(c[static_cast<std::size_t>(i * ldc + j)] == -1.0f);
    }
  }
}

TEST_CASE("batch-invariant gemm over packed weights: the fma chain of B's panels, read only where they match") {
  if (!backend::reads_packed_weights()) {
    MESSAGE("no AVX-512 here: the GEMM reads B in place, packed or not");
    return;
  }
  // m 1-40: one tile of the panel kernel for every row count 1-8, then whole and cut tiles; n:
  // one panel cut and whole, two panels and a cut one; k: 1, odd, and above bi_parallel_macs
  // with m = 40 (the rank's threads split the panels). Strided A and C (C's gaps untouched).
  for (const auto& [n, k] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {47, 13}, {48, 33}, {101, 139}, {130, 300}}) {
    const std::int64_t lda = k + 3, ldc = n + 5;
    const auto a = test::random_vector(static_cast<std::size_t>(40 * lda), 11);
    auto b = test::random_vector(static_cast<std::size_t>(n * k), 12);
    backend::PackedWeights packed;
    packed.add(Host{}, b.data(), n, k);
    CHECK(packed.bytes() == ((n + 47) / 48) * 48 * k * static_cast<std::int64_t>(sizeof(float)));
    const backend::PackedWeightsScope scope(&packed);
    for (std::int64_t m = 1; m <= 40; ++m) {
      CAPTURE(n);
      CAPTURE(k);
      CAPTURE(m);
      std::vector<float> c(static_cast<std::size_t>(m * ldc), -1.0f);
      backend::gemm_nt_batch_invariant(Host{}, m, n, k, a.data(), lda, b.data(), k, c.data(), ldc);
      const std::vector<float> ref = fma_chain(a.data(), lda, b.data(), k, m, n, k);
      for (std::int64_t i = 0; i < m; ++i) {
        CHECK(std::memcmp(c.data() + i * ldc, ref.data() + i * n, static_cast<std::size_t>(n) * sizeof(float)) == 0);
        for (std::int64_t j = n; j < ldc; ++j) CHECK(c[static_cast<std::size_t>(i * ldc + j)] == -1.0f);
      }
    }
  }
  // The panels are what it reads: after B changes, the product is still the packed B's ...
  const std::int64_t n = 50, k = 20, m = 3;
  const auto a = test::random_vector(static_cast<std::size_t>(m * k), 13);
  auto b = test::random_vector(static_cast<std::size_t>(n * k), 14);
  const std::vector<float> before = fma_chain(a.data(), k, b.data(), k, m, n, k);
  backend::PackedWeights packed;
  packed.add(Host{}, b.data(), n, k);
  for (auto& x : b) x += 1.0f;
  const std::vector<float> after = fma_chain(a.data(), k, b.data(), k, m, n, k);
  REQUIRE(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)) != 0);
  std::vector<float> c(static_cast<std::size_t>(m * n));
  const auto gemm = [&](std::int64_t rows, std::int64_t cols, std::int64_t ldb) {
    backend::gemm_nt_batch_invariant(Host{}, rows, cols, k, a.data(), k, b.data(), ldb, c.data(), cols);
    return std::vector<float>(c.begin(), c.begin() + rows * cols);
  };
  {
    const backend::PackedWeightsScope scope(&packed);
    CHECK(gemm(m, n, k) == before);
    CHECK(packed.reads() == 1);
    // ... but not where the address matches with another shape or stride (B in place), nor
    // outside the scope; scopes nest and restore.
    const std::vector<float> other_n = gemm(m, n - 1, k);
    CHECK(std::memcmp(other_n.data(), fma_chain(a.data(), k, b.data(), k, m, n - 1, k).data(),
                      other_n.size() * sizeof(float)) == 0);
    const std::vector<float> other_ld = gemm(m, n / 2, 2 * k);  // every other row of B
    CHECK(std::memcmp(other_ld.data(), fma_chain(a.data(), k, b.data(), 2 * k, m, n / 2, k).data(),
                      other_ld.size() * sizeof(float)) == 0);
    {
      const backend::PackedWeightsScope none(nullptr);
      CHECK(gemm(m, n, k) == after);
    }
    CHECK(backend::packed_weights() == &packed);
    CHECK(packed.reads() == 1);  // only the read that matched
  }
  CHECK(backend::packed_weights() == nullptr);
  CHECK(gemm(m, n, k) == after);
}

TEST_CASE("batch-invariant gemm: a row is bitwise the same for every m and position, on one thread or more") {
  for (const auto& [n, k] : {std::pair<std::int64_t, std::int64_t>{5, 7}, {33, 16}, {128, 129}, {67, 300}, {1100, 64}}) {
    CAPTURE(n);
    CAPTURE(k);
    const auto a = test::random_vector(static_cast<std::size_t>(80 * k), 1);
    const auto b = test::random_vector(static_cast<std::size_t>(n * k), 2);
    const std::vector<float> alone = product(a, {0}, b, n, k);
    for (std::int64_t m : {2, 3, 4, 5, 8, 17, 63, 64, 65, 79}) {
      for (std::int64_t at : {std::int64_t{0}, m / 2, m - 1}) {
        CAPTURE(m);
        CAPTURE(at);
        std::vector<std::int64_t> rows;
        for (std::int64_t i = 0; i < m; ++i) rows.push_back(i == at ? 0 : 1 + i);
        const std::vector<float> c = product(a, rows, b, n, k);
        CHECK(std::memcmp(c.data() + at * n, alone.data(), static_cast<std::size_t>(n) * sizeof(float)) == 0);
      }
    }
    // One thread (two ranks in this process leave each one core or less) gives the same bits.
    std::vector<std::int64_t> rows(40);
    for (std::int64_t i = 0; i < 40; ++i) rows[static_cast<std::size_t>(i)] = i;
    const std::vector<float> threaded = product(a, rows, b, n, k);
    const RanksPerProcess many(64);
    CHECK(threads_per_rank() == 1);
    CHECK(product(a, rows, b, n, k) == threaded);
  }
}

TEST_CASE("batch-invariant gemm: within fp32's error bound of sgemm") {
  // |c - c_exact| <= gamma_k sum_k |a||b| with gamma_k = k u / (1 - k u), u = 2^-24 (Higham,
  // "Accuracy and Stability of Numerical Algorithms", 3.5), for both; so they differ by at
  // most twice that.
  const std::int64_t m = 9, n = 70, k = 515;
  const auto a = test::random_vector(static_cast<std::size_t>(m * k), 3);
  const auto b = test::random_vector(static_cast<std::size_t>(n * k), 4);
  std::vector<float> c(static_cast<std::size_t>(m * n)), ref(c.size());
  backend::gemm_nt_batch_invariant(Host{}, m, n, k, a.data(), k, b.data(), k, c.data(), n);
  backend::gemm(Host{}, false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, ref.data(), n);
  const double u = std::ldexp(1.0, -24), gamma = k * u / (1 - k * u);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double abs_sum = 0;
      for (std::int64_t l = 0; l < k; ++l) abs_sum += std::abs(double(a[i * k + l]) * b[j * k + l]);
      CHECK(std::abs(double(c[i * n + j]) - ref[i * n + j]) <= 2 * gamma * abs_sum);
    }
  CHECK_THROWS_AS(backend::gemm_nt_batch_invariant(Host{}, -1, n, k, a.data(), k, b.data(), k, c.data(), n), Error);
  CHECK_THROWS_AS(backend::gemm_nt_batch_invariant(Host{}, m, n, k, a.data(), k - 1, b.data(), k, c.data(), n), Error);
}

TEST_CASE("batch-invariant gemm: linear_forward takes it inside a BatchInvariantScope only") {
  const std::int64_t m = 6, in = 40, out = 24;
  const auto x = test::random_vector(static_cast<std::size_t>(m * in), 5);
  const auto w = test::random_vector(static_cast<std::size_t>(out * in), 6);
  std::vector<float> direct(static_cast<std::size_t>(m * out)), scoped(direct.size()), outside(direct.size());
  backend::gemm_nt_batch_invariant(Host{}, m, out, in, x.data(), in, w.data(), in, direct.data(), out);
  CHECK_FALSE(backend::batch_invariant());
  {
    const backend::BatchInvariantScope scope;
    CHECK(backend::batch_invariant());
    backend::linear_forward(Host{}, x.data(), w.data(), scoped.data(), m, in, out);
    {
      const backend::MatmulPrecisionScope bf16(backend::MatmulPrecision::Bf16);
      CHECK_THROWS_AS(backend::linear_forward(Host{}, x.data(), w.data(), scoped.data(), m, in, out), Error);
    }
    const backend::BatchInvariantScope off(false);
    CHECK_FALSE(backend::batch_invariant());
  }
  CHECK(backend::batch_invariant() == false);
  backend::linear_forward(Host{}, x.data(), w.data(), outside.data(), m, in, out);
  CHECK(scoped == direct);
  CHECK(test::max_rel_diff(outside, std::vector<double>(direct.begin(), direct.end())) <= 1e-5);
}

}  // namespace backend_gemm_batch_invariant_test
