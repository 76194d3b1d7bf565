// serve::sample_token: greedy, vocabulary padding, top-k, top-p and the distribution of the
// counter-based draws.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "dsp/serve/sampler.hpp"

using namespace dsp;

namespace serve_sampler_test {
using serve::SamplingParams;

namespace {

// Pearson's chi-square statistic of `draws` draws of sample_token from `logits` (counters
// 0..draws-1 of one stream) against softmax(logits / temperature) restricted to the tokens
// in `keep` and renormalised. A kept token with probability 0 that is drawn adds infinity.
double chi_square(const std::vector<float>& logits, const SamplingParams& params, const std::vector<bool>& keep,
                  int draws) {
  std::vector<double> expected(logits.size()), observed(logits.size());
  double total = 0.0;
  for (std::size_t t = 0; t < logits.size(); ++t)
    total += expected[t] = keep[t] ? std::exp(logits[t] / params.temperature) : 0.0;
  for (int i = 0; i < draws; ++i)
    ++observed[static_cast<std::size_t>(serve::sample_token(logits, static_cast<std::int64_t>(logits.size()), params, 3,
                                                            static_cast<std::uint64_t>(i)))];
  double chi2 = 0.0;
  for (std::size_t t = 0; t < logits.size(); ++t) {
    const double e = expected[t] / total * draws, d = observed[t] - e;
    chi2 += e == 0.0 ? (observed[t] == 0.0 ? 0.0 : INFINITY) : d * d / e;
  }
  return chi2;
}

// Tokens 0..n-1 (by index) of a row of pseudo-random logits in [-4, 4).
std::vector<float> random_row(std::uint64_t row, std::size_t n) {
  std::vector<float> logits(n);
  const CounterRng rng(99, row);
  for (std::size_t i = 0; i < n; ++i) logits[i] = static_cast<float>(8.0 * rng.uniform(i) - 4.0);
  return logits;
}

}  // namespace

TEST_CASE("sampler: greedy is the argmax, lowest index on ties") {
  const std::vector<float> logits{0.1f, 3.0f, -2.0f, 3.0f, 2.9f};
  CHECK(serve::sample_token(logits, 5, {}, 0, 0) == 1);
  CHECK(serve::sample_token(logits, 3, {}, 0, 0) == 1);
  CHECK(serve::sample_token(logits, 1, {}, 0, 0) == 0);
}

TEST_CASE("sampler: padded vocabulary entries never win nor get drawn") {
  // Padding columns of the gathered logits are 0 (zero weight rows); real logits far below.
  std::vector<float> logits{-1000.0f, -2000.0f, -1500.0f, -1000.5f, -3000.0f, 0.0f, 0.0f, 0.0f};
  const std::int64_t vocab = 5;
  CHECK(serve::sample_token(logits, vocab, {}, 0, 0) == 0);
  logits[6] = 1e30f;  // even garbage padding cannot win
  for (const SamplingParams& params :
       {SamplingParams{}, SamplingParams{.temperature = 1.0f}, SamplingParams{.temperature = 1e4f, .top_k = 3},
        SamplingParams{.temperature = 1e4f, .top_p = 0.5f}})
    for (std::uint64_t c = 0; c < 2000; ++c) CHECK(serve::sample_token(logits, vocab, params, 1, c) < vocab);
}

TEST_CASE("sampler: top_k = 1 and a tiny top_p both equal greedy") {
  for (std::uint64_t row = 0; row < 50; ++row) {
    auto logits = random_row(row, 33);
    logits[7] = logits[20] = 5.0f;  // a tie at the top: both must pick the lower index
    for (std::uint64_t c = 0; c < 20; ++c) {
      CHECK(serve::sample_token(logits, 33, {.temperature = 1.0f, .top_k = 1, .seed = 5}, row, c) == 7);
      CHECK(serve::sample_token(logits, 33, {.temperature = 2.0f, .top_p = 1e-6f, .seed = 5}, row, c) == 7);
    }
  }
}

TEST_CASE("sampler: draws are a pure function of (seed, stream, counter)") {
  const auto logits = random_row(0, 50);
  const SamplingParams params{.temperature = 1.0f, .seed = 11};
  int same_stream = 0, other_stream = 0, other_seed = 0;
  for (std::uint64_t c = 0; c < 200; ++c) {
    const auto t = serve::sample_token(logits, 50, params, 4, c);
    same_stream += t == serve::sample_token(logits, 50, params, 4, c);
    other_stream += t == serve::sample_token(logits, 50, params, 5, c);
    other_seed += t == serve::sample_token(logits, 50, {.temperature = 1.0f, .seed = 12}, 4, c);
  }
  CHECK(same_stream == 200);
  // Independent draws from this row agree with probability sum p^2 = 0.066: 13 of 200
  // expected (sd 3.5); 30 is ~5 sd above.
  CHECK(other_stream < 30);
  CHECK(other_seed < 30);
}

// Histograms of 40000 draws against the distribution the sampler claims. The draws are
// deterministic (fixed seed), so the check cannot flake; the bound is what a true sampler
// exceeds with probability < 1e-4: chi-square with k - 1 <= 5 degrees of freedom, P(X > 25)
// = 1.4e-4 at 5 dof (less at fewer).
TEST_CASE("sampler: histograms match softmax, top-k and nucleus distributions") {
  const std::vector<float> logits{1.0f, 0.5f, 0.0f, -0.5f, -1.0f, 2.0f};
  const int draws = 40000;
  const std::vector<bool> all(6, true), top3{true, true, false, false, false, true};
  CHECK(chi_square(logits, {.temperature = 1.0f, .seed = 1}, all, draws) < 25.0);
  CHECK(chi_square(logits, {.temperature = 0.5f, .seed = 2}, all, draws) < 25.0);
  // top_k = 3 keeps tokens 5, 0, 1, renormalised.
  CHECK(chi_square(logits, {.temperature = 1.0f, .top_k = 3, .seed = 3}, top3, draws) < 25.0);
  // top_p = 0.75: softmax is token 5 0.538, 0 0.198, 1 0.120, 2 0.073, ...: cumulative 0.538,
  // 0.736, 0.856, so the nucleus is again tokens 5, 0, 1.
  CHECK(chi_square(logits, {.temperature = 1.0f, .top_p = 0.75f, .seed = 4}, top3, draws) < 25.0);
  // top_k = 4, then top_p = 0.8 of the renormalised top 4 (5 0.579, 0 0.213, 1 0.129, 2 0.078:
  // cumulative 0.579, 0.792, 0.921): tokens 5, 0, 1.
  CHECK(chi_square(logits, {.temperature = 1.0f, .top_k = 4, .top_p = 0.8f, .seed = 5}, top3, draws) < 25.0);
  // The bound has power: the nucleus draws are far from the full softmax.
  CHECK(chi_square(logits, {.temperature = 1.0f, .top_p = 0.75f, .seed = 4}, all, draws) > 1000.0);
}

TEST_CASE("sampler: invalid parameters and rows throw") {
  const std::vector<float> logits{0.0f, 1.0f};
  CHECK_THROWS_AS(SamplingParams{.temperature = -0.5f}.validate(), InputError);
  CHECK_THROWS_AS(SamplingParams{.temperature = NAN}.validate(), InputError);
  CHECK_THROWS_AS(SamplingParams{.top_k = -2}.validate(), InputError);
  CHECK_NOTHROW(SamplingParams{.top_k = -1}.validate());  // vLLM's "off"
  CHECK_THROWS_AS(SamplingParams{.top_p = 0.0f}.validate(), InputError);
  CHECK_THROWS_AS(SamplingParams{.top_p = 1.5f}.validate(), InputError);
  CHECK_NOTHROW(SamplingParams{.temperature = 0.7f, .top_k = 10, .top_p = 1.0f}.validate());
  CHECK_THROWS_AS(serve::sample_token(logits, 2, {.top_p = -1.0f}, 0, 0), InputError);
  CHECK_THROWS_AS(serve::sample_token(logits, 3, {}, 0, 0), Error);
  CHECK_THROWS_AS(serve::sample_token(logits, 0, {}, 0, 0), Error);
}

TEST_CASE("non-finite logits are an error, not a crash") {
  const std::vector<float> row{std::nanf(""), 1.0f, 2.0f};
  dsp::serve::SamplingParams p;
  p.temperature = 1.0f;
  CHECK_THROWS_WITH_AS(dsp::serve::sample_token(row, 3, p, 0, 0), doctest::Contains("non-finite logits"), dsp::Error);
  p.temperature = 0.0f;
  CHECK_THROWS_AS(dsp::serve::sample_token(row, 3, p, 0, 0), dsp::Error);
  // With penalties too: saturating the penalised values must not hide a diverged model.
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), std::nanf("")}) {
    CAPTURE(bad);
    std::vector<float> penalised{bad, 1.0f, 2.0f};
    const dsp::serve::SamplingParams q{.repetition_penalty = 1.5f, .presence_penalty = 0.5f};
    const std::vector<std::int32_t> seen{0};
    dsp::serve::apply_penalties(penalised, 3, q, seen, seen);
    CHECK_THROWS_WITH_AS(dsp::serve::sample_token(penalised, 3, q, 0, 0), doctest::Contains("non-finite logits"),
                         dsp::Error);
  }
}

TEST_CASE("penalties at the ends of their range saturate instead of making a logit infinite") {
  // A repetition penalty of 1e-40 divides a positive logit past fp32's range, 3.4e38 multiplies
  // a negative one past it: the logit stops at +/- FLT_MAX and sampling goes on.
  for (float r : {1e-40f, 3.4e38f}) {
    CAPTURE(r);
    std::vector<float> row{2.0f, -2.0f, 0.5f};
    const SamplingParams p{.repetition_penalty = r};
    const std::vector<std::int32_t> prompt{0, 1};
    serve::apply_penalties(row, 3, p, prompt, {});
    for (float l : row) CHECK(std::isfinite(l));
    CHECK(serve::sample_token(row, 3, p, 0, 0) == (r < 1.0f ? 0 : 2));
  }
}

}  // namespace serve_sampler_test
