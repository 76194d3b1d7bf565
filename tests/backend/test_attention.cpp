// Host causal GQA attention, the materialising op (backend/attention.hpp) and the memory-efficient
// one (backend/host/flash_attention.hpp), against a naive loop, finite differences and each other.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "dsp/backend/attention.hpp"
#include "dsp/backend/host/flash_attention.hpp"
#include "dsp/backend/matmul_precision.hpp"
#include "gradcheck.hpp"

namespace backend_attention_test {

using dsp::backend::Host;
using dsp::test::kGradTol;
using dsp::test::max_grad_error;
using dsp::test::max_rel_diff;
using dsp::test::random_vector;
using dsp::test::weighted_sum;

namespace {

// A KV-cache shaped case: 3 queries per sequence against 5 keys, each query row with its own
// position (so its own number of visible keys); position -1 sees no key at all.
struct AttnCase {
  std::int64_t batch = 2, q_len = 3, kv_len = 5, q_heads = 4, kv_heads = 2, head_dim = 4;
  std::vector<std::int32_t> positions = {2, 3, 4, -1, 0, 2};
  std::int64_t q_size() const { return batch * q_len * q_heads * head_dim; }
  std::int64_t kv_size() const { return batch * kv_len * kv_heads * head_dim; }
  std::int64_t probs_size() const { return batch * q_heads * q_len * kv_len; }
};

// Naive attention in fp64: fills out [batch, q_len, q_heads, head_dim], probs and
// lse [batch, q_heads, q_len] (-inf for a query that sees no key).
void reference_attention(const AttnCase& c, const std::vector<float>& q, const std::vector<float>& k,
                         const std::vector<float>& v, std::vector<double>& out, std::vector<double>& probs,
                         std::vector<double>& lse) {
  out.assign(c.q_size(), 0.0);
  probs.assign(c.probs_size(), 0.0);
  lse.assign(c.batch * c.q_heads * c.q_len, -INFINITY);
  const double scale = 1.0 / std::sqrt(double(c.head_dim));
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t h = 0; h < c.q_heads; ++h) {
      const std::int64_t g = h / (c.q_heads / c.kv_heads);
      for (std::int64_t i = 0; i < c.q_len; ++i) {
        const std::int64_t qi = ((b * c.q_len + i) * c.q_heads + h) * c.head_dim;
        double* p = &probs[((b * c.q_heads + h) * c.q_len + i) * c.kv_len];
        const std::int64_t visible = std::clamp<std::int64_t>(c.positions[b * c.q_len + i] + 1, 0, c.kv_len);
        double mx = -INFINITY, sum = 0.0;
        for (std::int64_t j = 0; j < visible; ++j) {
          const std::int64_t kj = ((b * c.kv_len + j) * c.kv_heads + g) * c.head_dim;
          for (std::int64_t d = 0; d < c.head_dim; ++d) p[j] += double(q[qi + d]) * k[kj + d] * scale;
          mx = std::max(mx, p[j]);
        }
        for (std::int64_t j = 0; j < visible; ++j) {
          p[j] = std::exp(p[j] - mx);
          sum += p[j];
        }
        if (visible > 0) lse[(b * c.q_heads + h) * c.q_len + i] = mx + std::log(sum);
        for (std::int64_t j = 0; j < visible; ++j) {
          p[j] /= sum;
          const std::int64_t vj = ((b * c.kv_len + j) * c.kv_heads + g) * c.head_dim;
          for (std::int64_t d = 0; d < c.head_dim; ++d) out[qi + d] += p[j] * v[vj + d];
        }
      }
    }
}

}  // namespace

TEST_CASE("attention_forward matches a naive loop with GQA, a KV cache and per-row positions") {
  for (std::int64_t kv_heads : {4, 2, 1}) {
    CAPTURE(kv_heads);
    AttnCase c;
    c.kv_heads = kv_heads;
    const auto q = random_vector(c.q_size(), 41, -2.0f, 2.0f);
    const auto k = random_vector(c.kv_size(), 42, -2.0f, 2.0f);
    const auto v = random_vector(c.kv_size(), 43);
    std::vector<float> out(c.q_size(), 99.0f), probs(c.probs_size(), 99.0f);
    attention_forward(Host{}, q.data(), k.data(), v.data(), c.positions.data(), c.batch, c.q_len, c.kv_len,
                      c.q_heads, c.kv_heads, c.head_dim, out.data(), probs.data());
    std::vector<double> want_out, want_probs, want_lse;
    reference_attention(c, q, k, v, want_out, want_probs, want_lse);
    CHECK(max_rel_diff(out, want_out) < 1e-5);  // fp32 dot products of 4 and sums of 5 terms
    CHECK(max_rel_diff(probs, want_probs) < 1e-5);

    // Masked probabilities are exactly 0 (the reference leaves them 0); a row without visible
    // keys gives a zero output.
    std::int64_t masked = 0;
    for (std::size_t i = 0; i < probs.size(); ++i)
      if (want_probs[i] == 0.0) {
        CHECK(probs[i] == 0.0f);
        ++masked;
      }
    CHECK(masked > 0);
    const std::int64_t empty_row = 1 * c.q_len + 0;  // batch 1, query 0 has position -1
    for (std::int64_t j = 0; j < c.q_heads * c.head_dim; ++j) CHECK(out[empty_row * c.q_heads * c.head_dim + j] == 0.0f);

    // Inference without saved probabilities gives the same output.
    std::vector<float> out2(c.q_size());
    attention_forward(Host{}, q.data(), k.data(), v.data(), c.positions.data(), c.batch, c.q_len, c.kv_len,
                      c.q_heads, c.kv_heads, c.head_dim, out2.data(), nullptr);
    CHECK(out2 == out);
  }
  AttnCase c;
  std::vector<float> x(c.q_size());
  CHECK_THROWS_AS(attention_forward(Host{}, x.data(), x.data(), x.data(), c.positions.data(), c.batch, c.q_len,
                                    c.kv_len, 4, 3, c.head_dim, x.data(), nullptr),
                  dsp::Error);  // 4 q heads cannot share 3 kv heads
}

TEST_CASE("attention_backward matches finite differences for q, k and v with GQA") {
  for (std::int64_t kv_heads : {4, 2, 1}) {
    CAPTURE(kv_heads);
    AttnCase c;
    c.kv_heads = kv_heads;
    auto q = random_vector(c.q_size(), 44);
    auto k = random_vector(c.kv_size(), 45);
    auto v = random_vector(c.kv_size(), 46);
    const auto r = random_vector(c.q_size(), 47);
    std::vector<float> out(c.q_size()), probs(c.probs_size());
    const auto loss = [&] {
      attention_forward(Host{}, q.data(), k.data(), v.data(), c.positions.data(), c.batch, c.q_len, c.kv_len,
                        c.q_heads, c.kv_heads, c.head_dim, out.data(), probs.data());
      return weighted_sum(out, r);
    };
    loss();
    std::vector<float> dq(c.q_size(), 99.0f), dk(c.kv_size(), 99.0f), dv(c.kv_size(), 99.0f);
    attention_backward(Host{}, q.data(), k.data(), v.data(), probs.data(), r.data(), c.batch, c.q_len, c.kv_len,
                       c.q_heads, c.kv_heads, c.head_dim, dq.data(), dk.data(), dv.data());
    CHECK(max_grad_error(q, dq, loss) < kGradTol);
    CHECK(max_grad_error(k, dk, loss) < kGradTol);
    CHECK(max_grad_error(v, dv, loss) < kGradTol);
  }
}

TEST_CASE("flash_attention_forward matches a naive loop: out, and lse (-inf for a query without keys)") {
  for (std::int64_t kv_heads : {4, 2, 1}) {
    CAPTURE(kv_heads);
    AttnCase c;
    c.kv_heads = kv_heads;
    const auto q = random_vector(c.q_size(), 51, -2.0f, 2.0f);
    const auto k = random_vector(c.kv_size(), 52, -2.0f, 2.0f);
    const auto v = random_vector(c.kv_size(), 53);
    std::vector<float> out(c.q_size(), 99.0f), lse(c.batch * c.q_heads * c.q_len, 99.0f);
    flash_attention_forward(Host{}, q.data(), k.data(), v.data(), c.positions.data(), c.batch, c.q_len, c.kv_len,
                            c.q_heads, c.kv_heads, c.head_dim, out.data(), lse.data());
    std::vector<double> want_out, want_probs, want_lse;
    reference_attention(c, q, k, v, want_out, want_probs, want_lse);
    CHECK(max_rel_diff(out, want_out) < 1e-5);  // fp32 dot products of 4 and sums of 5 terms
    std::int64_t empty = 0;
    for (std::size_t i = 0; i < lse.size(); ++i) {
      if (std::isinf(want_lse[i])) {
        CHECK(lse[i] == -INFINITY);
        ++empty;
      } else {
        CHECK(std::abs(lse[i] - want_lse[i]) < 1e-5 * std::max(1.0, std::abs(want_lse[i])));
      }
    }
    CHECK(empty == c.q_heads);  // batch 1's query 0 (position -1), every head

    std::vector<float> out2(c.q_size());  // inference: no lse kept, the same output
    flash_attention_forward(Host{}, q.data(), k.data(), v.data(), c.positions.data(), c.batch, c.q_len, c.kv_len,
                            c.q_heads, c.kv_heads, c.head_dim, out2.data(), nullptr);
    CHECK(out2 == out);
  }
  AttnCase c;
  std::vector<float> x(c.q_size());
  CHECK_THROWS_WITH_AS(flash_attention_forward(Host{}, x.data(), x.data(), x.data(), c.positions.data(), c.batch,
                                               c.q_len, c.kv_len, 4, 3, c.head_dim, x.data(), nullptr),
                       "attention: q_heads=4 is not a multiple of kv_heads=3", dsp::Error);
}

TEST_CASE("flash_attention_backward matches finite differences for q, k and v with GQA") {
  for (std::int64_t kv_heads : {4, 2, 1}) {
    CAPTURE(kv_heads);
    AttnCase c;
    c.kv_heads = kv_heads;
    auto q = random_vector(c.q_size(), 54);
    auto k = random_vector(c.kv_size(), 55);
    auto v = random_vector(c.kv_size(), 56);
    const auto r = random_vector(c.q_size(), 57);
    std::vector<float> out(c.q_size()), lse(c.batch * c.q_heads * c.q_len);
    const auto loss = [&] {
      flash_attention_forward(Host{}, q.data(), k.data(), v.data(), c.positions.data(), c.batch, c.q_len, c.kv_len,
                              c.q_heads, c.kv_heads, c.head_dim, out.data(), lse.data());
      return weighted_sum(out, r);
    };
    loss();
    std::vector<float> dq(c.q_size(), 99.0f), dk(c.kv_size(), 99.0f), dv(c.kv_size(), 99.0f);
    flash_attention_backward(Host{}, q.data(), k.data(), v.data(), out.data(), r.data(), lse.data(),
                             c.positions.data(), c.batch, c.q_len, c.kv_len, c.q_heads, c.kv_heads, c.head_dim,
                             dq.data(), dk.data(), dv.data());
    CHECK(max_grad_error(q, dq, loss) < kGradTol);
    CHECK(max_grad_error(k, dk, loss) < kGradTol);
    CHECK(max_grad_error(v, dv, loss) < kGradTol);
  }
}

// Several query tiles (150 rows = 64 + 64 + 22): the tiles' key ranges and the dK/dV sums over
// tiles and over a group's heads. The two ops run the same fp32 GEMMs in different blockings, and
// flash's backward recomputes the probabilities as exp(s - lse), not exp(s - max) / sum: ~1e-6 apart
// (dot products of head_dim = 16 and sums of <= 150 terms); 1e-5 bounds it.
TEST_CASE("flash attention equals the materialising op across query tiles, forward and backward") {
  const std::int64_t batch = 2, len = 150, q_heads = 4, kv_heads = 2, head_dim = 16;
  std::vector<std::int32_t> positions(batch * len);
  for (std::int64_t i = 0; i < batch * len; ++i) positions[i] = static_cast<std::int32_t>(i % len);
  const auto q = random_vector(batch * len * q_heads * head_dim, 61, -2.0f, 2.0f);
  const auto k = random_vector(batch * len * kv_heads * head_dim, 62, -2.0f, 2.0f);
  const auto v = random_vector(k.size(), 63);
  const auto dout = random_vector(q.size(), 64);
  std::vector<float> out(q.size()), probs(batch * q_heads * len * len), dq(q.size()), dk(k.size()), dv(v.size());
  attention_forward(Host{}, q.data(), k.data(), v.data(), positions.data(), batch, len, len, q_heads, kv_heads,
                    head_dim, out.data(), probs.data());
  attention_backward(Host{}, q.data(), k.data(), v.data(), probs.data(), dout.data(), batch, len, len, q_heads,
                     kv_heads, head_dim, dq.data(), dk.data(), dv.data());
  std::vector<float> f_out(q.size()), lse(batch * q_heads * len), f_dq(q.size(), 99.0f), f_dk(k.size(), 99.0f),
      f_dv(v.size(), 99.0f);
  flash_attention_forward(Host{}, q.data(), k.data(), v.data(), positions.data(), batch, len, len, q_heads,
                          kv_heads, head_dim, f_out.data(), lse.data());
  flash_attention_backward(Host{}, q.data(), k.data(), v.data(), f_out.data(), dout.data(), lse.data(),
                           positions.data(), batch, len, len, q_heads, kv_heads, head_dim, f_dq.data(),
                           f_dk.data(), f_dv.data());
  const auto wide = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  CHECK(max_rel_diff(f_out, wide(out)) < 1e-5);
  CHECK(max_rel_diff(f_dq, wide(dq)) < 1e-5);
  CHECK(max_rel_diff(f_dk, wide(dk)) < 1e-5);
  CHECK(max_rel_diff(f_dv, wide(dv)) < 1e-5);
}

// Flash attention's tile GEMMs follow the matmul scope (backend/matmul_precision.hpp): in a bf16
// or fp16 scope they round their inputs, Q, K, V, dO, P and dS, as the CUDA tensor-core kernels
// do. Reference: a naive fp64 loop over that contract (rounded(x) = T(x) widened; the fp32 out
// and lse of the op under test feed it, as they feed the op's backward). The op and the loop
// differ by fp32 noise (~1e-6), which flips a 16-bit rounding of P or dS by one ulp (bf16 2^-8
// relative) on about 1e-6 / 2^-8 ~ 3e-4 of those elements, each moving one term of a sum by
// 2^-8 of itself; the terms are small (P sums to 1 over up to 150 keys), and the largest
// difference measured is 6e-5 (bf16 dv). Not rounding at all moves the results by 2e-3 to
// 7e-3 instead (bf16, the figures of the moved checks): 1e-3 lies between. The forward also
// against the materialising op in the same scope (the same roundings of Q, K, P and V), and
// everything against the fp32 op: moved by more than 1e-4 (bf16) / 1e-5 (fp16) somewhere, or
// the scope was ignored.
template <class T>
void check_flash_in_scope(dsp::backend::MatmulPrecision precision, double moved) {
  const std::int64_t batch = 2, len = 150, q_heads = 4, kv_heads = 2, head_dim = 16, group = q_heads / kv_heads;
  const std::int64_t ldq = q_heads * head_dim, ldk = kv_heads * head_dim;
  std::vector<std::int32_t> positions(batch * len);
  for (std::int64_t i = 0; i < batch * len; ++i) positions[i] = static_cast<std::int32_t>(i % len);
  const auto q = random_vector(batch * len * ldq, 71, -2.0f, 2.0f);
  const auto k = random_vector(batch * len * ldk, 72, -2.0f, 2.0f);
  const auto v = random_vector(k.size(), 73);
  const auto dout = random_vector(q.size(), 74);
  const auto flash = [&](std::vector<float>& out, std::vector<float>& lse, std::vector<float>& dq,
                         std::vector<float>& dk, std::vector<float>& dv) {
    out.assign(q.size(), 0.0f), lse.assign(batch * q_heads * len, 0.0f), dq.assign(q.size(), 0.0f);
    dk.assign(k.size(), 0.0f), dv.assign(v.size(), 0.0f);
    flash_attention_forward(Host{}, q.data(), k.data(), v.data(), positions.data(), batch, len, len, q_heads,
                            kv_heads, head_dim, out.data(), lse.data());
    flash_attention_backward(Host{}, q.data(), k.data(), v.data(), out.data(), dout.data(), lse.data(),
                             positions.data(), batch, len, len, q_heads, kv_heads, head_dim, dq.data(), dk.data(),
                             dv.data());
  };
  std::vector<float> out32, lse32, dq32, dk32, dv32, out, lse, dq, dk, dv;
  flash(out32, lse32, dq32, dk32, dv32);
  dsp::backend::MatmulPrecisionScope scope(precision);
  flash(out, lse, dq, dk, dv);
  std::vector<float> m_out(q.size()), probs(batch * q_heads * len * len);
  attention_forward(Host{}, q.data(), k.data(), v.data(), positions.data(), batch, len, len, q_heads, kv_heads,
                    head_dim, m_out.data(), probs.data());

  const auto r = [](double x) { return double(T::to_float(T::from_float(static_cast<float>(x)))); };
  const double scale = 1.0 / std::sqrt(double(head_dim));
  std::vector<double> want_dq(q.size(), 0.0), want_dk(k.size(), 0.0), want_dv(v.size(), 0.0);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < q_heads; ++h)
      for (std::int64_t i = 0; i < len; ++i) {
        const std::int64_t qi = (b * len + i) * ldq + h * head_dim, visible = positions[b * len + i] + 1;
        double d = 0.0;  // D = dO . O
        for (std::int64_t c = 0; c < head_dim; ++c) d += double(dout[qi + c]) * out[qi + c];
        for (std::int64_t j = 0; j < visible; ++j) {
          const std::int64_t kj = (b * len + j) * ldk + (h / group) * head_dim;
          double s = 0.0, dp = 0.0;
          for (std::int64_t c = 0; c < head_dim; ++c) {
            s += r(q[qi + c]) * r(k[kj + c]);
            dp += r(dout[qi + c]) * r(v[kj + c]);
          }
          const double p = std::exp(s * scale - lse[(b * q_heads + h) * len + i]), ds = r(p * (dp - d));
          for (std::int64_t c = 0; c < head_dim; ++c) {
            want_dq[qi + c] += scale * ds * r(k[kj + c]);
            want_dk[kj + c] += scale * ds * r(q[qi + c]);
            want_dv[kj + c] += r(p) * r(dout[qi + c]);
          }
        }
      }
  const auto wide = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  CHECK(max_rel_diff(out, wide(m_out)) < 1e-3);
  CHECK(max_rel_diff(dq, want_dq) < 1e-3);
  CHECK(max_rel_diff(dk, want_dk) < 1e-3);
  CHECK(max_rel_diff(dv, want_dv) < 1e-3);
  CHECK(max_rel_diff(out, wide(out32)) > moved);
  CHECK(max_rel_diff(dq, wide(dq32)) > moved);
  CHECK(max_rel_diff(dk, wide(dk32)) > moved);
  CHECK(max_rel_diff(dv, wide(dv32)) > moved);
}

TEST_CASE("flash attention in a bf16 / fp16 matmul scope rounds its GEMM inputs: a naive loop with the same roundings") {
  check_flash_in_scope<dsp::bf16>(dsp::backend::MatmulPrecision::Bf16, 1e-4);
  check_flash_in_scope<dsp::fp16>(dsp::backend::MatmulPrecision::Fp16, 1e-5);
}

}  // namespace backend_attention_test
