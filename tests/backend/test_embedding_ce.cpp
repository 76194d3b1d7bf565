// Host embedding (vocab-parallel row ranges) and cross-entropy building blocks against closed
// forms, a two-rank vocab split and finite differences.
#include <doctest/doctest.h>

#include <cmath>

#include "dsp/backend/host/cross_entropy.hpp"
#include "dsp/backend/host/embedding.hpp"
#include "gradcheck.hpp"

namespace backend_embedding_ce_test {

using dsp::backend::Host;
using dsp::test::kGradTol;
using dsp::test::max_grad_error;
using dsp::test::max_rel_diff;
using dsp::test::random_vector;
using dsp::test::weighted_sum;

TEST_CASE("embedding rows come from the rank holding them; other ids give zero rows") {
  const std::int64_t vocab = 7, hidden = 5, tokens = 6;
  const std::vector<std::int32_t> ids = {3, 6, 0, 4, 3, 2};
  const auto full = random_vector(vocab * hidden, 61);
  // Rank 0 holds rows [0, 3), rank 1 rows [3, 7).
  const std::int64_t split = 3;
  std::vector<float> out0(tokens * hidden, 99.0f), out1(tokens * hidden, 99.0f);
  embedding_forward(Host{}, ids.data(), tokens, full.data(), split, 0, hidden, out0.data());
  embedding_forward(Host{}, ids.data(), tokens, full.data() + split * hidden, vocab - split, split, hidden,
                    out1.data());
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t j = 0; j < hidden; ++j) {
      const float want = full[ids[t] * hidden + j];
      CHECK(out0[t * hidden + j] == (ids[t] < split ? want : 0.0f));
      CHECK(out1[t * hidden + j] == (ids[t] >= split ? want : 0.0f));
    }

  // Backward on rank 1: repeated id 3 accumulates twice, ids of rank 0 are skipped; FD over
  // its table (linear, so the check is exact up to rounding).
  auto table = std::vector<float>(full.begin() + split * hidden, full.end());
  const auto r = random_vector(tokens * hidden, 62);
  const auto loss = [&] {
    embedding_forward(Host{}, ids.data(), tokens, table.data(), vocab - split, split, hidden, out1.data());
    return weighted_sum(out1, r);
  };
  const auto d0 = random_vector(table.size(), 63);
  auto dtable = d0;
  embedding_backward(Host{}, ids.data(), tokens, r.data(), vocab - split, split, hidden, dtable.data());
  for (std::size_t i = 0; i < dtable.size(); ++i) dtable[i] -= d0[i];  // accumulates
  CHECK(dtable[0] == doctest::Approx(r[0] + r[4 * hidden]));       // row of id 3: tokens 0 and 4
  CHECK(max_grad_error(table, dtable, loss) < kGradTol);
}

namespace {
// logits [tokens, 8]: 6 real vocab ids and 2 padding columns (vocab padded to a multiple of 4).
struct CeCase {
  std::int64_t tokens = 4, cols = 8, valid = 6;
  std::vector<std::int32_t> targets = {2, 5, -1, 0};
};
}  // namespace

TEST_CASE("cross-entropy of uniform logits is log(valid); ignored targets give 0") {
  const CeCase c;
  std::vector<float> logits(c.tokens * c.cols, 0.3f);
  std::vector<float> loss(c.tokens), mx(c.tokens), se(c.tokens);
  cross_entropy_forward(Host{}, logits.data(), c.targets.data(), c.tokens, c.cols, c.valid, loss.data(), mx.data(),
                        se.data());
  for (std::int64_t t = 0; t < c.tokens; ++t)
    CHECK(loss[t] == doctest::Approx(c.targets[t] < 0 ? 0.0 : std::log(double(c.valid))).epsilon(1e-6));
  std::vector<std::int32_t> bad = {6, 0, 0, 0};  // a padding column is not a vocab id
  CHECK_THROWS_AS(cross_entropy_forward(Host{}, logits.data(), bad.data(), c.tokens, c.cols, c.valid, loss.data(),
                                        mx.data(), se.data()),
                  dsp::Error);
}

TEST_CASE("cross-entropy matches log-sum-exp minus the target logit; gradient matches finite differences") {
  const CeCase c;
  auto logits = random_vector(c.tokens * c.cols, 64, -4.0f, 4.0f);
  const auto dloss = random_vector(c.tokens, 65);
  std::vector<float> loss(c.tokens), mx(c.tokens), se(c.tokens);
  const auto total = [&] {
    cross_entropy_forward(Host{}, logits.data(), c.targets.data(), c.tokens, c.cols, c.valid, loss.data(),
                          mx.data(), se.data());
    return weighted_sum(loss, dloss);
  };
  total();
  std::vector<double> want(c.tokens, 0.0);
  for (std::int64_t t = 0; t < c.tokens; ++t) {
    if (c.targets[t] < 0) continue;
    double s = 0.0;
    for (std::int64_t j = 0; j < c.valid; ++j) s += std::exp(double(logits[t * c.cols + j]));
    want[t] = std::log(s) - logits[t * c.cols + c.targets[t]];
  }
  CHECK(max_rel_diff(loss, want) < 1e-5);  // log of a sum of 6 exps, fp32

  std::vector<float> dlogits(logits.size(), 99.0f);
  cross_entropy_backward(Host{}, logits.data(), c.targets.data(), c.tokens, c.cols, c.valid, 0, mx.data(), se.data(),
                         dloss.data(), dlogits.data());
  CHECK(max_grad_error(logits, dlogits, total) < kGradTol);
  for (std::int64_t t = 0; t < c.tokens; ++t)
    for (std::int64_t j = 0; j < c.cols; ++j)
      if (j >= c.valid || c.targets[t] < 0) CHECK(dlogits[t * c.cols + j] == 0.0f);
}

TEST_CASE("vocab-parallel cross-entropy over two ranks equals the single-rank result") {
  // Global vocab 6 padded to 8; rank 0 holds ids [0, 4) (all real), rank 1 ids [4, 8) of which
  // the first 2 are real. Combining: max of maxes, sum of sum_exps (taken with the global max),
  // sum of gathered target logits (Megatron-LM VocabParallelCrossEntropy).
  const CeCase c;
  const std::int64_t part = 4;
  const auto logits = random_vector(c.tokens * c.cols, 66, -4.0f, 4.0f);
  const auto dloss = random_vector(c.tokens, 67);
  std::vector<float> loss(c.tokens), mx(c.tokens), se(c.tokens), dfull(logits.size());
  cross_entropy_forward(Host{}, logits.data(), c.targets.data(), c.tokens, c.cols, c.valid, loss.data(), mx.data(),
                        se.data());
  cross_entropy_backward(Host{}, logits.data(), c.targets.data(), c.tokens, c.cols, c.valid, 0, mx.data(), se.data(),
                         dloss.data(), dfull.data());

  std::vector<float> shard[2];
  for (std::int64_t rank = 0; rank < 2; ++rank)
    for (std::int64_t t = 0; t < c.tokens; ++t)
      shard[rank].insert(shard[rank].end(), logits.begin() + t * c.cols + rank * part,
                         logits.begin() + t * c.cols + (rank + 1) * part);
  const std::int64_t valid[2] = {part, c.valid - part};
  std::vector<float> m[2], s[2], tl[2];
  for (int rank = 0; rank < 2; ++rank) {
    m[rank].resize(c.tokens);
    row_max(Host{}, shard[rank].data(), c.tokens, part, valid[rank], m[rank].data());
  }
  std::vector<float> gmax(c.tokens), gsum(c.tokens, 0.0f), gtarget(c.tokens, 0.0f);
  for (std::int64_t t = 0; t < c.tokens; ++t) gmax[t] = std::max(m[0][t], m[1][t]);
  for (int rank = 0; rank < 2; ++rank) {
    s[rank].resize(c.tokens);
    tl[rank].resize(c.tokens);
    row_sum_exp(Host{}, shard[rank].data(), c.tokens, part, valid[rank], gmax.data(), s[rank].data());
    gather_target_logit(Host{}, shard[rank].data(), c.targets.data(), c.tokens, part, rank * part, tl[rank].data());
    for (std::int64_t t = 0; t < c.tokens; ++t) {
      gsum[t] += s[rank][t];
      gtarget[t] += tl[rank][t];
    }
  }
  for (std::int64_t t = 0; t < c.tokens; ++t) {
    CHECK(gmax[t] == mx[t]);
    CHECK(gsum[t] == doctest::Approx(se[t]).epsilon(1e-6));
    const float l = c.targets[t] < 0 ? 0.0f : std::log(gsum[t]) + gmax[t] - gtarget[t];
    CHECK(l == doctest::Approx(loss[t]).epsilon(1e-6));
  }
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<float> d(shard[rank].size());
    cross_entropy_backward(Host{}, shard[rank].data(), c.targets.data(), c.tokens, part, valid[rank], rank * part,
                           gmax.data(), gsum.data(), dloss.data(), d.data());
    for (std::int64_t t = 0; t < c.tokens; ++t)
      for (std::int64_t j = 0; j < part; ++j)
        CHECK(d[t * part + j] == doctest::Approx(dfull[t * c.cols + rank * part + j]).epsilon(1e-6));
  }

  // A rank holding only padding: max is -infinity and contributes nothing to the sum.
  row_max(Host{}, shard[1].data(), c.tokens, part, 0, m[1].data());
  CHECK(std::isinf(m[1][0]));
  CHECK(m[1][0] < 0);
}

}  // namespace backend_embedding_ce_test
