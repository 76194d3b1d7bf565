// CUDA gemm (cuBLAS) against the Host gemm (OpenBLAS) on the same inputs: fp32, bf16 in with
// fp32 out, and bf16 in and out; every transpose combination, padded strides, alpha and beta.
// Then gemm_rounded (16-bit-rounded inputs), copy_columns and transpose, the linear layer (the same template on both
// backends, in fp32 and in a bf16 MatmulPrecisionScope) and the elementwise ops and fp64
// reductions.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "../../relative_error.hpp"
#include "../gradcheck.hpp"
#include "device_vectors.hpp"
#include "dsp/backend/cuda/copy_columns.hpp"
#include "dsp/backend/cuda/elementwise.cuh"
#include "dsp/backend/cuda/gemm.hpp"
#include "dsp/backend/cuda/gemm_batch_invariant.cuh"
#include "dsp/backend/cuda/gemm_rounded.cuh"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/backend/cuda/stream.hpp"
#include "dsp/backend/cuda/transpose.cuh"
#include "dsp/backend/host/copy_columns.hpp"
#include "dsp/backend/host/elementwise.hpp"
#include "dsp/backend/host/gemm.hpp"
#include "dsp/backend/host/gemm_rounded.hpp"
#include "dsp/backend/host/transpose.hpp"
#include "dsp/backend/linear.hpp"
#include "dsp/backend/matmul_precision.hpp"

using dsp::bf16;
using dsp::backend::Cuda;
using dsp::backend::Host;
using dsp::backend::Stream;
using dsp::backend::to_device;
using dsp::backend::to_host;
using dsp::test::on_device;
using dsp::test::on_host;
using dsp::test::random_vector;
using dsp::test::relative_error;

namespace {

// Tolerances, norm-wise (||got - want|| / ||want||):
// - fp32 and bf16 -> fp32: both sides multiply exactly (fp32 products of bf16 values are exact,
//   and the Host reference gets the same bf16-rounded values widened) and accumulate k = 131
//   terms in fp32 in different orders. Each sum's rounding error is at most k u sum|a b| (u =
//   2^-24 = 6e-8, Higham, "Accuracy and Stability of Numerical Algorithms", eq. 3.5), about
//   8e-6 relative in the worst case and sqrt(k) u ~ 7e-7 typically: the issue's 1e-5.
constexpr double kFp32Tol = 1e-5;
// - bf16 -> bf16: the same, then one rounding of each result to bf16, at most u_bf16 = 2^-8 of
//   it (8 significant bits, round to nearest even).
constexpr double kBf16OutTol = 1.0 / 256 + kFp32Tol;

struct Case {
  bool ta, tb;
  std::int64_t m = 37, n = 29, k = 131;  // odd sizes: a swapped dimension or stride shows
  std::int64_t lda() const { return (ta ? m : k) + 3; }
  std::int64_t ldb() const { return (tb ? k : n) + 1; }
  std::int64_t ldc() const { return n + 2; }
  std::int64_t a_size() const { return (ta ? k : m) * lda(); }
  std::int64_t b_size() const { return (tb ? n : k) * ldb(); }
  std::int64_t c_size() const { return m * ldc(); }
};

std::vector<float> round_to_bf16(std::vector<float> v) {
  for (float& x : v) x = float(bf16(x));
  return v;
}
std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = bf16(v[i]);
  return r;
}

}  // namespace

TEST_CASE("fp32 gemm equals the Host gemm: all transposes, padded strides, alpha and beta, on a stream") {
  Stream stream;
  const Cuda b = stream.backend();
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Case c{ta, tb};
      CAPTURE(ta);
      CAPTURE(tb);
      const auto ha = random_vector(c.a_size(), 1), hb = random_vector(c.b_size(), 2);
      auto want = random_vector(c.c_size(), 3);
      auto da = to_device<float>(b, ha), db = to_device<float>(b, hb), dc = to_device<float>(b, want);
      const float alpha = 0.7f, beta = -1.3f;
      gemm(b, ta, tb, c.m, c.n, c.k, alpha, da.data(), c.lda(), db.data(), c.ldb(), beta, dc.data(), c.ldc());
      gemm(Host{}, ta, tb, c.m, c.n, c.k, alpha, ha.data(), c.lda(), hb.data(), c.ldb(), beta, want.data(), c.ldc());
      const auto got = to_host(b, dc.data(), dc.size());
      CHECK(relative_error(got, want) < kFp32Tol);
      for (std::int64_t i = 0; i < c.m; ++i)  // the padding columns of C are left as they were
        for (std::int64_t j = c.n; j < c.ldc(); ++j) CHECK(got[i * c.ldc() + j] == want[i * c.ldc() + j]);
    }
}

namespace {
/// ||gpu - host|| / ||host|| of a bf16-input gemm with output type Out (fp32 or bf16) for one
/// transpose combination; the Host reference gets the bf16-rounded inputs (and C) widened.
template <class Out>
double bf16_gemm_error(bool ta, bool tb, float alpha, float beta, unsigned seed) {
  const Cuda b{};
  const Case c{ta, tb};
  const auto ha = round_to_bf16(random_vector(c.a_size(), seed));
  const auto hb = round_to_bf16(random_vector(c.b_size(), seed + 1));
  auto want = round_to_bf16(random_vector(c.c_size(), seed + 2));  // beta C reads bf16 values when Out is bf16
  auto da = to_device<bf16>(b, to_bf16(ha)), db = to_device<bf16>(b, to_bf16(hb));
  std::vector<Out> c0(want.size());
  for (std::size_t i = 0; i < want.size(); ++i) c0[i] = Out(want[i]);
  auto dc = to_device<Out>(b, c0);
  gemm(b, ta, tb, c.m, c.n, c.k, alpha, da.data(), c.lda(), db.data(), c.ldb(), beta, dc.data(), c.ldc());
  gemm(Host{}, ta, tb, c.m, c.n, c.k, alpha, ha.data(), c.lda(), hb.data(), c.ldb(), beta, want.data(), c.ldc());
  const auto got_out = to_host(b, dc.data(), dc.size());
  std::vector<float> got(got_out.size());
  for (std::size_t i = 0; i < got.size(); ++i) got[i] = float(got_out[i]);
  return relative_error(got, want);
}
}  // namespace

TEST_CASE("bf16 gemm equals the Host gemm on the bf16-rounded inputs: fp32 output, and bf16 output within one rounding") {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      CAPTURE(ta);
      CAPTURE(tb);
      CHECK(bf16_gemm_error<float>(ta, tb, 1.5f, 0.5f, 4) < kFp32Tol);
      const double err16 = bf16_gemm_error<bf16>(ta, tb, 1.0f, 1.0f, 7);
      CHECK(err16 < kBf16OutTol);
      CHECK(err16 > 0.0);  // the output really is bf16: exact agreement would mean fp32 was written
    }
}

TEST_CASE("gemm: beta = 0 ignores NaN in C, k = 0 gives beta C, bad strides throw before any launch") {
  const Cuda b{};
  const auto ha = random_vector(6, 10), hb = random_vector(6, 11);
  auto da = to_device<float>(b, ha), db = to_device<float>(b, hb);
  auto dc = to_device<float>(b, std::vector<float>(4, NAN));
  gemm(b, false, false, 2, 2, 3, 1.0f, da.data(), 3, db.data(), 2, 0.0f, dc.data(), 2);
  for (float x : to_host(b, dc.data(), 4)) CHECK(std::isfinite(x));
  auto dd = to_device<float>(b, std::vector<float>{1, 2, 3, 4});
  gemm(b, false, false, 2, 2, 0, 1.0f, da.data(), 1, db.data(), 2, 2.0f, dd.data(), 2);
  CHECK(to_host(b, dd.data(), 4) == std::vector<float>{2, 4, 6, 8});
  CHECK_THROWS_WITH_AS(gemm(b, false, false, 2, 2, 3, 1.0f, da.data(), 2, db.data(), 2, 0.0f, dc.data(), 2),
                       "gemm: lda=2 too small", dsp::Error);
}

namespace {
// The linear layer's forward, input and weight gradients on both backends (the same template) in
// the calling thread's matmul precision: the CUDA results within kFp32Tol of the Host ones.
void check_linear_matches_host(unsigned seed) {
  const Cuda b{};
  const std::int64_t tokens = 19, in = 70, out = 45;
  const auto x = random_vector(tokens * in, seed), w = random_vector(out * in, seed + 1);
  const auto dy = random_vector(tokens * out, seed + 2);
  const auto dw0 = random_vector(out * in, seed + 3);
  std::vector<float> y(tokens * out), dx(tokens * in), dw = dw0;
  linear_forward(Host{}, x.data(), w.data(), y.data(), tokens, in, out);
  linear_backward_input(Host{}, dy.data(), w.data(), dx.data(), tokens, in, out);
  linear_backward_weight(Host{}, dy.data(), x.data(), dw.data(), tokens, in, out);
  auto d_x = on_device(b, x), d_w = on_device(b, w), d_dy = on_device(b, dy), d_dw = on_device(b, dw0);
  dsp::backend::DeviceBuffer<float> d_y(b, y.size()), d_dx(b, dx.size());
  linear_forward(b, d_x.data(), d_w.data(), d_y.data(), tokens, in, out);
  linear_backward_input(b, d_dy.data(), d_w.data(), d_dx.data(), tokens, in, out);
  linear_backward_weight(b, d_dy.data(), d_x.data(), d_dw.data(), tokens, in, out);  // accumulates
  CHECK(relative_error(on_host(d_y), y) < kFp32Tol);
  CHECK(relative_error(on_host(d_dx), dx) < kFp32Tol);
  CHECK(relative_error(on_host(d_dw), dw) < kFp32Tol);
}
}  // namespace

TEST_CASE("linear forward, input and weight gradients equal the Host layer (one template, two backends)") {
  check_linear_matches_host(12);
}

TEST_CASE("axpy, add, scale, copy, fill and the fp64 dot and sum_squares equal the Host ops") {
  const Cuda b{};
  const std::int64_t n = 1 << 20;  // more than one grid of the reduction kernels
  const auto x = random_vector(n, 16), y0 = random_vector(n, 17), weight = random_vector(n, 18, 0.0f, 1.0f);
  std::vector<float> y = y0;
  auto d_x = on_device(b, x), d_y = on_device(b, y0), d_weight = on_device(b, weight);
  axpy(Host{}, n, 0.3f, x.data(), y.data());
  axpy(b, n, 0.3f, d_x.data(), d_y.data());
  add(Host{}, n, x.data(), y.data());
  add(b, n, d_x.data(), d_y.data());
  scale(Host{}, n, -1.7f, y.data());
  scale(b, n, -1.7f, d_y.data());
  CHECK(relative_error(on_host(d_y), y) < kFp32Tol);

  // fp64 sums of exact products: the two sides differ only in the order of the fp64 additions,
  // ~n x 1e-16 = 1e-10 relative at most.
  CHECK(std::abs(sum_squares(b, n, d_x.data(), nullptr) / sum_squares(Host{}, n, x.data(), nullptr) - 1) < 1e-10);
  CHECK(std::abs(sum_squares(b, n, d_x.data(), d_weight.data()) /
                     sum_squares(Host{}, n, x.data(), weight.data()) -
                 1) < 1e-10);
  CHECK(dot(b, n, d_x.data(), d_y.data()) == doctest::Approx(dot(Host{}, n, x.data(), y.data())).epsilon(1e-6));
  CHECK(sum_squares(b, 0, d_x.data(), nullptr) == 0.0);

  copy(b, n, d_x.data(), d_y.data());
  CHECK(on_host(d_y) == x);
  fill(b, n - 1, 2.5f, d_y.data());
  const auto filled = on_host(d_y);
  CHECK(filled[0] == 2.5f);
  CHECK(filled[n - 2] == 2.5f);
  CHECK(filled[n - 1] == x[n - 1]);  // exactly n - 1 written
}

TEST_CASE("copy_columns writes exactly the addressed block, as the Host op") {
  const Cuda b{};
  const std::int64_t rows = 9, src_cols = 13, dst_cols = 11;
  const auto src = random_vector(rows * src_cols, 19), dst0 = random_vector(rows * dst_cols, 20);
  std::vector<float> dst = dst0;
  copy_columns(Host{}, src.data(), src_cols, 4, dst.data(), dst_cols, 2, rows, 6);
  auto d_src = on_device(b, src), d_dst = on_device(b, dst0);
  copy_columns(b, d_src.data(), src_cols, 4, d_dst.data(), dst_cols, 2, rows, 6);
  CHECK(on_host(d_dst) == dst);
  CHECK(dst != dst0);
}

TEST_CASE("transpose writes exactly the addressed block, as the Host op") {
  const Cuda b{};
  const std::int64_t rows = 9, cols = 5, ld_src = 13, ld_dst = 11;  // a block of each, strided
  const auto src = random_vector(rows * ld_src, 21), dst0 = random_vector(cols * ld_dst, 22);
  std::vector<float> dst = dst0;
  dsp::backend::transpose(Host{}, rows, cols, src.data() + 2, ld_src, dst.data() + 1, ld_dst);
  auto d_src = on_device(b, src), d_dst = on_device(b, dst0);
  dsp::backend::transpose(b, rows, cols, d_src.data() + 2, ld_src, d_dst.data() + 1, ld_dst);
  CHECK(on_host(d_dst) == dst);
  CHECK(dst[1 * ld_dst + 1 + 3] == src[3 * ld_src + 2 + 1]);  // element (3, 1) moved to (1, 3)
}

TEST_CASE("gemm_rounded equals the Host gemm_rounded (bf16 and fp16 inputs, fp32 accumulation), and so do the linear ops in a MatmulPrecisionScope") {
  // Both round A and B with the same conversion (test_convert: bitwise) and multiply the rounded
  // values exactly; only the order of the fp32 sums differs: kFp32Tol.
  const Cuda b{};
  const auto compare = [&](auto t) {
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const Case c{ta, tb};
        CAPTURE(ta);
        CAPTURE(tb);
        const auto ha = random_vector(c.a_size(), 31), hb = random_vector(c.b_size(), 32);
        auto want = random_vector(c.c_size(), 33);
        auto da = on_device(b, ha), db = on_device(b, hb), dc = on_device(b, want);
        gemm_rounded(b, t, ta, tb, c.m, c.n, c.k, 0.7f, da.data(), c.lda(), db.data(), c.ldb(), 0.5f, dc.data(), c.ldc());
        gemm_rounded(Host{}, t, ta, tb, c.m, c.n, c.k, 0.7f, ha.data(), c.lda(), hb.data(), c.ldb(), 0.5f, want.data(),
                     c.ldc());
        const auto got = on_host(dc);
        CHECK(relative_error(got, want) < kFp32Tol);
        for (std::int64_t i = 0; i < c.m; ++i)  // the padding columns of C are left as they were
          for (std::int64_t j = c.n; j < c.ldc(); ++j) CHECK(got[i * c.ldc() + j] == want[i * c.ldc() + j]);
        CHECK(on_host(da) == ha);  // the inputs were rounded into temporaries, not in place
      }
  };
  compare(bf16{});
  compare(dsp::fp16{});

  using dsp::backend::MatmulPrecision;
  using dsp::backend::MatmulPrecisionScope;
  for (MatmulPrecision p : {MatmulPrecision::Bf16, MatmulPrecision::Fp16}) {
    CAPTURE(static_cast<int>(p));
    MatmulPrecisionScope scope(p);
    check_linear_matches_host(34);
  }
}
