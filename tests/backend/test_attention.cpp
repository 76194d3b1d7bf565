// Host causal GQA attention, the materialising op (backend/attention.hpp) and the memory-efficient
// one (backend/host/flash_attention.hpp), against a naive loop, finite differences and each other.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "dsp/backend/attention.hpp"
#include "dsp/backend/host/flash_attention.hpp"
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

}  // namespace backend_attention_test
