// Host gemm, linear and elementwise ops against naive loops; linear gradients against finite
// differences; gemm_rounded and the matmul precision scope against gemm on rounded inputs.
#include <cblas.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "dsp/backend/host/elementwise.hpp"
#include "dsp/backend/host/convert.hpp"
#include "dsp/backend/host/gemm.hpp"
#include "dsp/backend/host/gemm_rounded.hpp"
#include "dsp/backend/linear.hpp"
#include "dsp/backend/matmul_precision.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/threads.hpp"
#include "gradcheck.hpp"

namespace backend_gemm_test {

using dsp::backend::Host;
using dsp::test::kGradTol;
using dsp::test::max_grad_error;
using dsp::test::max_rel_diff;
using dsp::test::random_vector;
using dsp::test::weighted_sum;

// fp32 products of O(1) values summed over k <= 16 terms: rounding error ~ k * 6e-8 < 1e-6.
constexpr double kForwardTol = 1e-5;

TEST_CASE("gemm matches a triple loop for all transpose combinations, strides, alpha and beta") {
  const std::int64_t m = 5, n = 4, k = 6;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      CAPTURE(ta);
      CAPTURE(tb);
      // Stored shapes with padded row strides (ld > row length) to exercise lda/ldb/ldc.
      const std::int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, lda = a_cols + 2;
      const std::int64_t b_rows = tb ? n : k, b_cols = tb ? k : n, ldb = b_cols + 1;
      const std::int64_t ldc = n + 3;
      const auto a = random_vector(a_rows * lda, 1);
      const auto b = random_vector(b_rows * ldb, 2);
      auto c = random_vector(m * ldc, 3);
      const float alpha = 0.7f, beta = -1.3f;
      std::vector<double> want(c.begin(), c.end());
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          double s = 0.0;
          for (std::int64_t p = 0; p < k; ++p)
            s += double(ta ? a[p * lda + i] : a[i * lda + p]) * (tb ? b[j * ldb + p] : b[p * ldb + j]);
          want[i * ldc + j] = alpha * s + beta * double(c[i * ldc + j]);
        }
      gemm(Host{}, ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
      CHECK(max_rel_diff(c, want) < kForwardTol);  // includes the padding columns, left untouched
    }
  }
}

TEST_CASE("gemm with beta = 0 ignores NaN in C, and k = 0 gives beta * C") {
  const auto a = random_vector(6, 4), b = random_vector(6, 5);
  std::vector<float> c(4, std::numeric_limits<float>::quiet_NaN());
  gemm(Host{}, false, false, 2, 2, 3, 1.0f, a.data(), 3, b.data(), 2, 0.0f, c.data(), 2);
  for (float x : c) CHECK(std::isfinite(x));
  std::vector<float> d = {1, 2, 3, 4};
  gemm(Host{}, false, false, 2, 2, 0, 1.0f, a.data(), 1, b.data(), 2, 2.0f, d.data(), 2);
  CHECK(d == std::vector<float>{2, 4, 6, 8});
  CHECK_THROWS_AS(gemm(Host{}, false, false, 2, 2, 3, 1.0f, a.data(), 2, b.data(), 2, 0.0f, c.data(), 2),
                  dsp::Error);  // lda < k
}

TEST_CASE("gemm sets OpenBLAS to threads_per_rank() threads, capped by OPENBLAS_NUM_THREADS, and follows changes") {
  // The expected count from the environment, computed here independently of blas_threads().
  const char* env = std::getenv("OPENBLAS_NUM_THREADS");
  const int cap = env != nullptr && std::atoi(env) > 0 ? std::atoi(env) : 0;
  auto expected = [&] { return cap > 0 ? std::min(dsp::threads_per_rank(), cap) : dsp::threads_per_rank(); };
  const auto a = random_vector(4, 6);
  std::vector<float> c(4);
  gemm(Host{}, false, false, 2, 2, 2, 1.0f, a.data(), 2, a.data(), 2, 0.0f, c.data(), 2);
  CHECK(openblas_get_num_threads() == expected());
  {
    const dsp::RanksPerProcess many(1024);  // more ranks than cores: one thread each
    gemm(Host{}, false, false, 2, 2, 2, 1.0f, a.data(), 2, a.data(), 2, 0.0f, c.data(), 2);
    CHECK(openblas_get_num_threads() == 1);
  }
  gemm(Host{}, false, false, 2, 2, 2, 1.0f, a.data(), 2, a.data(), 2, 0.0f, c.data(), 2);
  CHECK(openblas_get_num_threads() == expected());
  // The cap's parsing: unset, zero, negative and non-numbers mean no cap.
  using dsp::backend::detail::blas_threads_cap;
  CHECK(blas_threads_cap(nullptr) == 0);
  CHECK(blas_threads_cap("3") == 3);
  CHECK(blas_threads_cap("0") == 0);
  CHECK(blas_threads_cap("-2") == 0);
  CHECK(blas_threads_cap("many") == 0);
}

TEST_CASE("linear forward is x w^T and its gradients match finite differences") {
  const std::int64_t tokens = 3, in = 5, out = 4;
  auto x = random_vector(tokens * in, 7);
  auto w = random_vector(out * in, 8);
  const auto r = random_vector(tokens * out, 9);
  std::vector<float> y(tokens * out);
  linear_forward(Host{}, x.data(), w.data(), y.data(), tokens, in, out);
  std::vector<double> want(tokens * out);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t o = 0; o < out; ++o)
      for (std::int64_t i = 0; i < in; ++i) want[t * out + o] += double(x[t * in + i]) * w[o * in + i];
  CHECK(max_rel_diff(y, want) < kForwardTol);

  const auto loss = [&] {
    linear_forward(Host{}, x.data(), w.data(), y.data(), tokens, in, out);
    return weighted_sum(y, r);
  };
  std::vector<float> dx(tokens * in, 99.0f);  // overwritten
  linear_backward_input(Host{}, r.data(), w.data(), dx.data(), tokens, in, out);
  CHECK(max_grad_error(x, dx, loss) < kGradTol);

  // backward_weight accumulates: start from a known dw0 and subtract it.
  const auto dw0 = random_vector(out * in, 10);
  auto dw = dw0;
  linear_backward_weight(Host{}, r.data(), x.data(), dw.data(), tokens, in, out);
  for (std::size_t i = 0; i < dw.size(); ++i) dw[i] -= dw0[i];
  CHECK(max_grad_error(w, dw, loss) < kGradTol);
}

TEST_CASE("the finite-difference check detects a wrong gradient") {
  // A transposed-weight bug (dx = dy w^T reinterpreted) must fail the same check that passes above.
  const std::int64_t tokens = 2, n = 4;
  auto x = random_vector(tokens * n, 11);
  const auto w = random_vector(n * n, 12);
  const auto r = random_vector(tokens * n, 13);
  std::vector<float> y(tokens * n), dx(tokens * n);
  const auto loss = [&] {
    linear_forward(Host{}, x.data(), w.data(), y.data(), tokens, n, n);
    return weighted_sum(y, r);
  };
  linear_forward(Host{}, r.data(), w.data(), dx.data(), tokens, n, n);  // wrong: dy w^T
  CHECK(max_grad_error(x, dx, loss) > 10 * kGradTol);
  linear_backward_input(Host{}, r.data(), w.data(), dx.data(), tokens, n, n);  // right: dy w
  CHECK(max_grad_error(x, dx, loss) < kGradTol);
}

TEST_CASE("elementwise ops and reductions") {
  const std::int64_t n = 37;
  const auto x = random_vector(n, 14);
  const auto y0 = random_vector(n, 15);
  auto y = y0;
  add(Host{}, n, x.data(), y.data());
  for (std::int64_t i = 0; i < n; ++i) CHECK(y[i] == doctest::Approx(x[i] + y0[i]).epsilon(1e-6));
  y = y0;
  axpy(Host{}, n, -2.5f, x.data(), y.data());
  for (std::int64_t i = 0; i < n; ++i) CHECK(y[i] == doctest::Approx(y0[i] - 2.5f * x[i]).epsilon(1e-6));
  y = y0;
  scale(Host{}, n, 3.0f, y.data());
  for (std::int64_t i = 0; i < n; ++i) CHECK(y[i] == doctest::Approx(3.0f * y0[i]).epsilon(1e-6));
  copy(Host{}, n, x.data(), y.data());
  CHECK(y == x);
  fill(Host{}, n, 0.25f, y.data());
  CHECK(std::all_of(y.begin(), y.end(), [](float v) { return v == 0.25f; }));

  double want_dot = 0.0, want_ss = 0.0, want_masked = 0.0;
  std::vector<float> mask(n);
  for (std::int64_t i = 0; i < n; ++i) {
    mask[i] = i % 3 == 0 ? 0.0f : 1.0f;
    want_dot += double(x[i]) * y0[i];
    want_ss += double(x[i]) * x[i];
    want_masked += mask[i] * double(x[i]) * x[i];
  }
  CHECK(dot(Host{}, n, x.data(), y0.data()) == doctest::Approx(want_dot).epsilon(1e-6));
  CHECK(sum_squares(Host{}, n, x.data(), nullptr) == doctest::Approx(want_ss).epsilon(1e-12));
  CHECK(sum_squares(Host{}, n, x.data(), mask.data()) == doctest::Approx(want_masked).epsilon(1e-12));
  CHECK(want_masked < want_ss - 1e-3);  // the mask really drops elements
  // fp64 accumulation: 1e8 plus 2^20 squares of 1e-2 (~105 in all). In fp32 every small term
  // is lost (ulp(1e8) = 8); in fp64 each addition rounds by <= 7.5e-9, so <= 1e-2 in all.
  std::vector<float> big(1 << 20, 1e-2f);
  big[0] = 1e4f;
  const double small = double(1e-2f) * double(1e-2f) * ((1 << 20) - 1);
  CHECK(std::abs(sum_squares(Host{}, std::int64_t(big.size()), big.data(), nullptr) - (1e8 + small)) < 1.0);
}

TEST_CASE("gemm_rounded is gemm on bf16- / fp16-rounded copies of A and B, bitwise, for every transpose; the stride gaps are not read; A and B are left as they were") {
  const std::int64_t m = 5, n = 4, k = 6;
  // NaN in the columns past each stored row (the stride gaps): read, they would poison C
  const auto with_gaps = [](std::vector<float> v, std::int64_t cols, std::int64_t ld) {
    for (std::size_t i = 0; i < v.size(); ++i)
      if (static_cast<std::int64_t>(i) % ld >= cols) v[i] = std::numeric_limits<float>::quiet_NaN();
    return v;
  };
  const auto same_bits = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  const auto rounded = [](std::vector<float> v, auto t) {
    round_to(Host{}, static_cast<std::int64_t>(v.size()), v.data(), t);
    return v;
  };
  const auto check = [&](auto t) {
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        CAPTURE(ta);
        CAPTURE(tb);
        const std::int64_t lda = (ta ? m : k) + 2, ldb = (tb ? k : n) + 1, ldc = n + 3;
        const auto a = with_gaps(random_vector((ta ? k : m) * lda, 21), ta ? m : k, lda);
        const auto b = with_gaps(random_vector((tb ? n : k) * ldb, 22), tb ? k : n, ldb);
        const auto c0 = random_vector(m * ldc, 23);
        const auto a0 = a, b0 = b;
        auto want = c0, got = c0, fp32 = c0;
        gemm(Host{}, ta, tb, m, n, k, 0.5f, rounded(a, t).data(), lda, rounded(b, t).data(), ldb, 1.0f, want.data(), ldc);
        gemm_rounded(Host{}, t, ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 1.0f, got.data(), ldc);
        gemm(Host{}, ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 1.0f, fp32.data(), ldc);
        CHECK(got == want);  // the same sgemm on the same values
        CHECK(got != fp32);  // ... which the rounding changed
        CHECK(same_bits(a, a0));
        CHECK(same_bits(b, b0));
      }
  };
  check(dsp::bf16{});
  check(dsp::fp16{});
}

TEST_CASE("gemm_rounded: k = 0 gives beta C; fp16 rounds an input past 65504 to infinity, which reaches C (the loss scaler's overflow)") {
  std::vector<float> c{1, 2, 3, 4};
  const std::vector<float> none(1);
  gemm_rounded(Host{}, dsp::bf16{}, false, false, 2, 2, 0, 1.0f, none.data(), 1, none.data(), 2, 2.0f, c.data(), 2);
  CHECK(c == std::vector<float>{2, 4, 6, 8});
  const std::vector<float> a{70000.0f, 1.0f}, b{1.0f, 1.0f};  // [1, 2] x [2, 1]
  std::vector<float> y16(1), y_bf16(1);
  gemm_rounded(Host{}, dsp::fp16{}, false, false, 1, 1, 2, 1.0f, a.data(), 2, b.data(), 1, 0.0f, y16.data(), 1);
  gemm_rounded(Host{}, dsp::bf16{}, false, false, 1, 1, 2, 1.0f, a.data(), 2, b.data(), 1, 0.0f, y_bf16.data(), 1);
  CHECK(std::isinf(y16[0]));
  CHECK(y_bf16[0] == 70145.0f);  // bf16(70000) = 70144, bf16's range is fp32's
}

TEST_CASE("inside a MatmulPrecisionScope the linear ops multiply inputs rounded to its type; scopes nest and restore") {
  using dsp::backend::MatmulPrecision;
  using dsp::backend::MatmulPrecisionScope;
  using dsp::backend::matmul_precision;
  const std::int64_t tokens = 3, in = 5, out = 4;
  const auto x = random_vector(tokens * in, 24), w = random_vector(out * in, 25), dy = random_vector(tokens * out, 26);
  const auto dw0 = random_vector(out * in, 27);
  const auto bf = [](std::vector<float> v) {
    round_to(Host{}, static_cast<std::int64_t>(v.size()), v.data(), dsp::bf16{});
    return v;
  };
  // the fp32 ops on rounded inputs
  std::vector<float> want_y(tokens * out), want_dx(tokens * in), want_dw = dw0;
  linear_forward(Host{}, bf(x).data(), bf(w).data(), want_y.data(), tokens, in, out);
  linear_backward_input(Host{}, bf(dy).data(), bf(w).data(), want_dx.data(), tokens, in, out);
  linear_backward_weight(Host{}, bf(dy).data(), bf(x).data(), want_dw.data(), tokens, in, out);
  std::vector<float> fp32_y(tokens * out);
  linear_forward(Host{}, x.data(), w.data(), fp32_y.data(), tokens, in, out);

  CHECK(matmul_precision() == MatmulPrecision::Fp32);
  std::vector<float> y(tokens * out), dx(tokens * in), dw = dw0, inner_y(tokens * out);
  {
    MatmulPrecisionScope scope(MatmulPrecision::Bf16);
    CHECK(matmul_precision() == MatmulPrecision::Bf16);
    linear_forward(Host{}, x.data(), w.data(), y.data(), tokens, in, out);
    linear_backward_input(Host{}, dy.data(), w.data(), dx.data(), tokens, in, out);
    linear_backward_weight(Host{}, dy.data(), x.data(), dw.data(), tokens, in, out);
    {
      MatmulPrecisionScope inner(MatmulPrecision::Fp32);
      linear_forward(Host{}, x.data(), w.data(), inner_y.data(), tokens, in, out);
    }
    CHECK(matmul_precision() == MatmulPrecision::Bf16);
  }
  CHECK(matmul_precision() == MatmulPrecision::Fp32);
  CHECK(y == want_y);
  CHECK(dx == want_dx);
  CHECK(dw == want_dw);
  CHECK(y != fp32_y);
  CHECK(inner_y == fp32_y);
}

}  // namespace backend_gemm_test
