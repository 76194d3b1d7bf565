// Host attention with a document mask (q_key_begin; Megatron's --reset-attention-mask): the
// materialising op (backend/attention.hpp) and the flash op (backend/host/flash_attention.hpp)
// against a naive fp64 loop over an explicit [q_len, kv_len] mask, each other, finite
// differences, and the documents run alone.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "dsp/backend/attention.hpp"
#include "dsp/backend/host/flash_attention.hpp"
#include "gradcheck.hpp"

namespace backend_document_attention_test {

using dsp::backend::Host;
using dsp::test::kGradTol;
using dsp::test::max_grad_error;
using dsp::test::random_vector;
using dsp::test::weighted_sum;

namespace {

// Packed sequences: per sequence, the lengths of its documents (summing to q_len = kv_len).
struct DocCase {
  std::int64_t batch = 2, q_len = 150, q_heads = 4, kv_heads = 2, head_dim = 8;
  // 150 rows = 3 query tiles of 64: documents cross tile borders, and a tile starting inside a
  // document (rows 64.., 128..) starts its keys at that document's first row
  std::vector<std::vector<std::int64_t>> docs = {{5, 37, 22, 70, 16}, {1, 100, 49}};
  std::vector<std::int32_t> positions, key_begin;
  std::vector<std::vector<char>> mask;  // [batch][q_len * kv_len]: 1 where query i sees key j

  std::int64_t q_size() const { return batch * q_len * q_heads * head_dim; }
  std::int64_t kv_size() const { return batch * q_len * kv_heads * head_dim; }

  // positions: the rows (the causal end); key_begin from docs; the explicit mask from the
  // document each row belongs to (independent of key_begin: row i sees j iff same document, j <= i)
  void build() {
    positions.assign(batch * q_len, 0);
    key_begin.assign(batch * q_len, 0);
    mask.assign(batch, std::vector<char>(q_len * q_len, 0));
    for (std::int64_t b = 0; b < batch; ++b) {
      std::vector<std::int64_t> doc_of(q_len);
      std::int64_t row = 0, d = 0;
      for (std::int64_t len : docs[b]) {
        for (std::int64_t r = 0; r < len; ++r, ++row) {
          doc_of[row] = d;
          positions[b * q_len + row] = static_cast<std::int32_t>(row);
          key_begin[b * q_len + row] = static_cast<std::int32_t>(row - r);
        }
        ++d;
      }
      REQUIRE(row == q_len);
      for (std::int64_t i = 0; i < q_len; ++i)
        for (std::int64_t j = 0; j <= i; ++j) mask[b][i * q_len + j] = doc_of[i] == doc_of[j];
    }
  }
};

// Naive masked attention in fp64, forward and backward: out, and dq, dk, dv from dout.
void reference(const DocCase& c, const std::vector<float>& q, const std::vector<float>& k,
               const std::vector<float>& v, const std::vector<float>& dout, std::vector<double>& out,
               std::vector<double>& dq, std::vector<double>& dk, std::vector<double>& dv) {
  const std::int64_t n = c.q_len, d = c.head_dim;
  out.assign(c.q_size(), 0.0);
  dq.assign(c.q_size(), 0.0);
  dk.assign(c.kv_size(), 0.0);
  dv.assign(c.kv_size(), 0.0);
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> p(n), dp(n);
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t h = 0; h < c.q_heads; ++h) {
      const std::int64_t g = h / (c.q_heads / c.kv_heads);
      auto qi = [&](std::int64_t i) { return ((b * n + i) * c.q_heads + h) * d; };
      auto kj = [&](std::int64_t j) { return ((b * n + j) * c.kv_heads + g) * d; };
      for (std::int64_t i = 0; i < n; ++i) {
        double mx = -INFINITY, sum = 0.0;
        for (std::int64_t j = 0; j < n; ++j) {
          p[j] = 0.0;
          if (!c.mask[b][i * n + j]) continue;
          double s = 0.0;
          for (std::int64_t e = 0; e < d; ++e) s += double(q[qi(i) + e]) * k[kj(j) + e];
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        for (std::int64_t j = 0; j < n; ++j)
          if (c.mask[b][i * n + j]) sum += p[j] = std::exp(p[j] - mx);
        double dsum = 0.0;
        for (std::int64_t j = 0; j < n; ++j) {
          if (!c.mask[b][i * n + j]) continue;
          p[j] /= sum;
          dp[j] = 0.0;
          for (std::int64_t e = 0; e < d; ++e) {
            out[qi(i) + e] += p[j] * v[kj(j) + e];
            dp[j] += double(dout[qi(i) + e]) * v[kj(j) + e];
          }
          dsum += p[j] * dp[j];
        }
        for (std::int64_t j = 0; j < n; ++j) {
          if (!c.mask[b][i * n + j]) continue;
          const double ds = p[j] * (dp[j] - dsum);
          for (std::int64_t e = 0; e < d; ++e) {
            dq[qi(i) + e] += scale * ds * k[kj(j) + e];
            dk[kj(j) + e] += scale * ds * q[qi(i) + e];
            dv[kj(j) + e] += p[j] * dout[qi(i) + e];
          }
        }
      }
    }
}

double norm_rel(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

struct Grads {
  std::vector<float> out, dq, dk, dv;
};

Grads run(const DocCase& c, bool flash, const std::vector<float>& q, const std::vector<float>& k,
          const std::vector<float>& v, const std::vector<float>& dout, const std::int32_t* key_begin) {
  Grads r{std::vector<float>(q.size()), std::vector<float>(q.size()), std::vector<float>(k.size()),
          std::vector<float>(v.size())};
  if (flash) {
    std::vector<float> lse(c.batch * c.q_heads * c.q_len);
    dsp::backend::flash_attention_forward(Host{}, q.data(), k.data(), v.data(), c.positions.data(), c.batch,
                                          c.q_len, c.q_len, c.q_heads, c.kv_heads, c.head_dim, r.out.data(),
                                          lse.data(), key_begin);
    dsp::backend::flash_attention_backward(Host{}, q.data(), k.data(), v.data(), r.out.data(), dout.data(),
                                           lse.data(), c.positions.data(), c.batch, c.q_len, c.q_len, c.q_heads,
                                           c.kv_heads, c.head_dim, r.dq.data(), r.dk.data(), r.dv.data(), key_begin);
  } else {
    std::vector<float> probs(c.batch * c.q_heads * c.q_len * c.q_len);
    dsp::backend::attention_forward(Host{}, q.data(), k.data(), v.data(), c.positions.data(), c.batch, c.q_len,
                                    c.q_len, c.q_heads, c.kv_heads, c.head_dim, r.out.data(), probs.data(),
                                    key_begin);
    dsp::backend::attention_backward(Host{}, q.data(), k.data(), v.data(), probs.data(), dout.data(), c.batch,
                                     c.q_len, c.q_len, c.q_heads, c.kv_heads, c.head_dim, r.dq.data(), r.dk.data(),
                                     r.dv.data());
  }
  return r;
}

}  // namespace

// fp32 against fp64 over at most 100 visible keys and head_dim 8 of O(1) values: each output
// is a short fp32 dot product / softmax with ~1e-7 relative rounding per term, so norm-wise
// ~1e-6; 1e-5 (the project's fp32 bound) leaves 10x. A mask error (a key of another document
// seen, or one of its own missed) moves outputs by O(0.1).
TEST_CASE("document-masked attention, materialising and flash, forward and backward, equal a naive loop with an explicit mask") {
  DocCase c;
  c.build();
  const auto q = random_vector(c.q_size(), 1), k = random_vector(c.kv_size(), 2), v = random_vector(c.kv_size(), 3);
  const auto dout = random_vector(c.q_size(), 4);
  std::vector<double> out, dq, dk, dv;
  reference(c, q, k, v, dout, out, dq, dk, dv);
  Grads per_path[2];
  for (bool flash : {false, true}) {
    CAPTURE(flash);
    const Grads r = run(c, flash, q, k, v, dout, c.key_begin.data());
    CHECK(norm_rel(r.out, out) < 1e-5);
    CHECK(norm_rel(r.dq, dq) < 1e-5);
    CHECK(norm_rel(r.dk, dk) < 1e-5);
    CHECK(norm_rel(r.dv, dv) < 1e-5);
    per_path[flash] = r;
  }
  // flash and materialising agree with each other (both fp32: the same 1e-5 bound, measured ~1e-7)
  for (auto m : {&Grads::out, &Grads::dq, &Grads::dk, &Grads::dv}) {
    const std::vector<double> ref((per_path[0].*m).begin(), (per_path[0].*m).end());
    CHECK(norm_rel(per_path[1].*m, ref) < 1e-5);
  }
  // the mask matters: plain causal attention over the same rows is far from the reference
  const Grads causal = run(c, false, q, k, v, dout, nullptr);
  CHECK(norm_rel(causal.out, out) > 1e-2);
}

TEST_CASE("document-masked attention: each document's rows equal that document run alone (no key of another leaks)") {
  // The second sequence's middle document (rows 1..100) run as its own sequence of 100: the same
  // outputs and gradients. Tolerance 1e-5 (fp32, summation order of the GEMMs differs with the
  // key count), measured ~1e-7.
  DocCase c;
  c.build();
  const auto q = random_vector(c.q_size(), 5), k = random_vector(c.kv_size(), 6), v = random_vector(c.kv_size(), 7);
  const auto dout = random_vector(c.q_size(), 8);
  DocCase alone;
  alone.batch = 1;
  alone.q_len = 100;
  alone.docs = {{100}};
  alone.build();
  const std::int64_t first = 1, qw = c.q_heads * c.head_dim, kw = c.kv_heads * c.head_dim;
  auto rows = [&](const std::vector<float>& x, std::int64_t width) {
    const auto begin = x.begin() + (c.q_len + first) * width;  // sequence 1, row `first`
    return std::vector<float>(begin, begin + alone.q_len * width);
  };
  for (bool flash : {false, true}) {
    CAPTURE(flash);
    const Grads packed = run(c, flash, q, k, v, dout, c.key_begin.data());
    const Grads single = run(alone, flash, rows(q, qw), rows(k, kw), rows(v, kw), rows(dout, qw), nullptr);
    auto close = [](const std::vector<float>& a, const std::vector<float>& b) {
      return norm_rel(a, std::vector<double>(b.begin(), b.end()));
    };
    CHECK(close(rows(packed.out, qw), single.out) < 1e-5);
    CHECK(close(rows(packed.dq, qw), single.dq) < 1e-5);
    CHECK(close(rows(packed.dk, kw), single.dk) < 1e-5);
    CHECK(close(rows(packed.dv, kw), single.dv) < 1e-5);
  }
}

// Central finite differences (gradcheck.hpp's step and tolerance, derived there) through the
// masked ops: small enough to perturb every element (q_len 12 in documents of 3, 1, 8; one
// query tile).
TEST_CASE("document-masked attention backward matches finite differences, materialising and flash") {
  DocCase c;
  c.batch = 1;
  c.q_len = 12;
  c.head_dim = 4;
  c.docs = {{3, 1, 8}};
  c.build();
  auto q = random_vector(c.q_size(), 9), k = random_vector(c.kv_size(), 10), v = random_vector(c.kv_size(), 11);
  const auto r = random_vector(c.q_size(), 12);  // L = sum out * r
  for (bool flash : {false, true}) {
    CAPTURE(flash);
    const Grads g = run(c, flash, q, k, v, r, c.key_begin.data());
    auto loss = [&] {
      std::vector<float> out(q.size()), lse(c.batch * c.q_heads * c.q_len), probs(c.q_len * c.q_len * c.q_heads);
      if (flash)
        dsp::backend::flash_attention_forward(Host{}, q.data(), k.data(), v.data(), c.positions.data(), c.batch,
                                              c.q_len, c.q_len, c.q_heads, c.kv_heads, c.head_dim, out.data(),
                                              lse.data(), c.key_begin.data());
      else
        dsp::backend::attention_forward(Host{}, q.data(), k.data(), v.data(), c.positions.data(), c.batch, c.q_len,
                                        c.q_len, c.q_heads, c.kv_heads, c.head_dim, out.data(), probs.data(),
                                        c.key_begin.data());
      return weighted_sum(out, r);
    };
    CHECK(max_grad_error(q, g.dq, loss) < kGradTol);
    CHECK(max_grad_error(k, g.dk, loss) < kGradTol);
    CHECK(max_grad_error(v, g.dv, loss) < kGradTol);
  }
}

TEST_CASE("a query whose key range is empty gets a zero output and zero gradients on both paths") {
  // key_begin past the row's position (a caller's mask that leaves nothing visible): as a row
  // without keys in the causal ops, out 0 (flash: lse -inf), no gradient.
  DocCase c;
  c.batch = 1;
  c.q_len = 4;
  c.head_dim = 4;
  c.docs = {{4}};
  c.build();
  c.key_begin = {0, 0, 3, 0};  // row 2 would start at key 3 > its position 2
  const auto q = random_vector(c.q_size(), 13), k = random_vector(c.kv_size(), 14), v = random_vector(c.kv_size(), 15);
  const auto dout = random_vector(c.q_size(), 16);
  for (bool flash : {false, true}) {
    CAPTURE(flash);
    const Grads g = run(c, flash, q, k, v, dout, c.key_begin.data());
    const std::int64_t w = c.q_heads * c.head_dim;
    for (std::int64_t e = 0; e < w; ++e) {
      CHECK(g.out[2 * w + e] == 0.0f);
      CHECK(g.dq[2 * w + e] == 0.0f);
    }
  }
}

}  // namespace backend_document_attention_test
