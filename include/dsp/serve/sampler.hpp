#pragma once
// Token sampling from one row of logits: greedy (argmax), or temperature softmax restricted
// to the top-k tokens and then to the nucleus (top-p, Holtzman et al. 2020, "The Curious
// Case of Neural Text Degeneration"). The random draw is counter-based (CounterRng keyed by
// (seed, stream) at `counter`), so a token depends only on its logits and on (seed, stream,
// counter): not on the batch it was decoded in, nor on the tensor-parallel size, nor on
// the rank that samples it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/core/rng.hpp"

namespace dsp::serve {

/// How tokens are drawn. The defaults are greedy decoding.
struct SamplingParams {
  float temperature = 0.0f;  ///< softmax temperature; 0 = greedy (argmax)
  std::int64_t top_k = 0;    ///< keep the k most likely tokens; 0 = off
  float top_p = 1.0f;        ///< keep the smallest set of tokens with probability >= top_p; 1 = off
  std::uint64_t seed = 0;    ///< key of the random stream (unused when greedy)

  /// Throws InputError, naming the value, for a negative or non-finite temperature, a
  /// negative top_k, or top_p outside (0, 1].
  void validate() const {
    DSP_CHECK_AS(InputError, std::isfinite(temperature) && temperature >= 0.0f,
                 "sampling temperature must be finite and >= 0, got ", temperature);
    DSP_CHECK_AS(InputError, top_k >= 0, "sampling top_k must be >= 0 (0 = off), got ", top_k);
    DSP_CHECK_AS(InputError, top_p > 0.0f && top_p <= 1.0f, "sampling top_p must be in (0, 1], got ", top_p);
  }
  bool greedy() const { return temperature == 0.0f; }
};

/// Draws the next token from logits_row [>= vocab] (e.g. a gathered row of padded_vocab
/// columns): only the first `vocab` entries are real tokens, the rest (vocabulary padding)
/// can never be returned.
/// - Greedy (temperature 0): argmax, lowest index on ties.
/// - Otherwise: p = softmax(logits / temperature) in fp64; keep the top_k most likely tokens
///   (ties broken by lower index) and renormalise; keep the smallest prefix of those, in
///   decreasing probability, whose cumulative probability is >= top_p (as Hugging Face's
///   TopK then TopP warpers); draw from the renormalised rest with
///   u = CounterRng(seed, stream).uniform(counter).
/// Use stream = the sequence's index within its request and counter = the index of the
/// generated token, so a sequence gets the same tokens alone or in any batch.
/// Returns a token id in [0, vocab). Throws InputError for invalid params and Error when
/// vocab < 1 or the row has fewer than vocab entries. Error also for a non-finite logit (a diverged model).
inline std::int32_t sample_token(std::span<const float> logits_row, std::int64_t vocab, const SamplingParams& params,
                                 std::uint64_t stream, std::uint64_t counter) {
  params.validate();
  DSP_CHECK(vocab >= 1 && static_cast<std::int64_t>(logits_row.size()) >= vocab, "sample_token: a row of ",
            logits_row.size(), " logits cannot hold a vocabulary of ", vocab);
  const auto real = logits_row.first(static_cast<std::size_t>(vocab));
  for (std::size_t i = 0; i < real.size(); ++i)
    DSP_CHECK(std::isfinite(real[i]), "logit of token ", i, " is ", real[i], ": the model produced non-finite logits");
  if (params.greedy()) return static_cast<std::int32_t>(std::max_element(real.begin(), real.end()) - real.begin());

  // Token ids by decreasing logit (= decreasing probability), lower id first on ties; only
  // the first `kept` need to be ordered.
  std::vector<std::int32_t> order(real.size());
  std::iota(order.begin(), order.end(), 0);
  const auto kept = static_cast<std::ptrdiff_t>(params.top_k > 0 ? std::min(params.top_k, vocab) : vocab);
  std::partial_sort(order.begin(), order.begin() + kept, order.end(), [&](std::int32_t a, std::int32_t b) {
    return real[static_cast<std::size_t>(a)] > real[static_cast<std::size_t>(b)] ||
           (real[static_cast<std::size_t>(a)] == real[static_cast<std::size_t>(b)] && a < b);
  });

  // Unnormalised probabilities exp((l - max) / T) of the top-k tokens, in that order.
  const double top = real[static_cast<std::size_t>(order.front())], t = params.temperature;
  std::vector<double> weight(static_cast<std::size_t>(kept));
  for (std::size_t i = 0; i < weight.size(); ++i)
    weight[i] = std::exp((real[static_cast<std::size_t>(order[i])] - top) / t);
  const double total = std::accumulate(weight.begin(), weight.end(), 0.0);

  // Nucleus: the shortest prefix whose probability (within the top k) reaches top_p.
  std::size_t nucleus = 0;
  double mass = 0.0;
  while (nucleus < weight.size() && mass < params.top_p * total) mass += weight[nucleus++];

  const double u = CounterRng(params.seed, stream).uniform(counter) * mass;
  double cumulative = 0.0;
  for (std::size_t i = 0; i + 1 < nucleus; ++i) {
    cumulative += weight[i];
    if (u < cumulative) return order[i];
  }
  return order[nucleus - 1];  // the last kept token takes the remainder (and rounding slack)
}

}  // namespace dsp::serve
