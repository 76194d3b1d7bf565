#pragma once
// Token sampling from one row of logits, in vLLM's order: penalties (apply_penalties), then
// greedy (argmax), or temperature softmax, min-p (Nguyen et al. 2024, "Turning Up the Heat:
// Min-p Sampling"), top-k and the nucleus (top-p, Holtzman et al. 2020, "The Curious Case of
// Neural Text Degeneration"). The random draw is counter-based (CounterRng keyed by
// (seed, stream) at `counter`), so a token depends only on its logits and on (seed, stream,
// counter): not on the batch it was decoded in, nor on the tensor-parallel size, nor on
// the rank that samples it. Log-probabilities (token_logprobs) come from the raw logits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/core/rng.hpp"
#include "dsp/serve/sampling_params.hpp"

namespace dsp::serve {

/// Draws the next token from logits_row [>= vocab] (e.g. a gathered row of padded_vocab
/// columns): only the first `vocab` entries are real tokens, the rest (vocabulary padding)
/// can never be returned.
/// - Greedy (temperature 0): argmax, lowest index on ties.
/// - Otherwise: p = softmax(logits / temperature) in fp64; keep the tokens with p >= min_p x
///   max p; of those the top_k most likely (ties broken by lower index), renormalised; keep the
///   smallest prefix of those, in decreasing probability, whose cumulative probability is >=
///   top_p (as Hugging Face's TopK then TopP warpers); draw from the renormalised rest with
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
  std::size_t best = 0;  // the argmax, lowest index on ties: found in the pass that checks the row
  for (std::size_t i = 0; i < real.size(); ++i) {
    DSP_CHECK(std::isfinite(real[i]), "logit of token ", i, " is ", real[i], ": the model produced non-finite logits");
    if (real[i] > real[best]) best = i;
  }
  if (params.greedy()) return static_cast<std::int32_t>(best);

  // Token ids by decreasing logit (= decreasing probability), lower id first on ties; only
  // the first `kept` need to be ordered.
  std::vector<std::int32_t> order(real.size());
  std::iota(order.begin(), order.end(), 0);
  auto kept = static_cast<std::ptrdiff_t>(params.top_k > 0 ? std::min(params.top_k, vocab) : vocab);
  std::partial_sort(order.begin(), order.begin() + kept, order.end(), [&](std::int32_t a, std::int32_t b) {
    return real[static_cast<std::size_t>(a)] > real[static_cast<std::size_t>(b)] ||
           (real[static_cast<std::size_t>(a)] == real[static_cast<std::size_t>(b)] && a < b);
  });

  // Unnormalised probabilities exp((l - max) / T) of the top-k tokens, in that order; min-p
  // keeps those of at least min_p times the top one's (weight 1), which form a prefix.
  const double top = real[static_cast<std::size_t>(order.front())], t = params.temperature;
  std::vector<double> weight(static_cast<std::size_t>(kept));
  for (std::size_t i = 0; i < weight.size(); ++i)
    weight[i] = std::exp((real[static_cast<std::size_t>(order[i])] - top) / t);
  if (params.min_p > 0.0f)
    while (weight.size() > 1 && weight.back() < params.min_p) weight.pop_back();
  const double total = std::accumulate(weight.begin(), weight.end(), 0.0);

  // Nucleus: the shortest prefix whose probability (within the kept tokens) reaches top_p.
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

/// What the model said of one sampled token (OpenAI's logprobs): the token's log-probability
/// under the raw logits and the top N tokens (id, log-probability), most likely first.
struct TokenLogprobs {
  std::int32_t token = 0;
  double logprob = 0.0;
  std::vector<std::pair<std::int32_t, double>> top;
};

/// log softmax of the first `vocab` logits of `logits_row` (in fp64) at `token`, and the
/// `top_n` most likely tokens (ties: lower id first; at most vocab). Throws Error when the row
/// has fewer than vocab entries or token lies outside [0, vocab).
inline TokenLogprobs token_logprobs(std::span<const float> logits_row, std::int64_t vocab, std::int32_t token,
                                    std::int64_t top_n) {
  DSP_CHECK(vocab >= 1 && static_cast<std::int64_t>(logits_row.size()) >= vocab && token >= 0 && token < vocab,
            "token_logprobs: token ", token, " of a row of ", logits_row.size(), " logits, vocabulary ", vocab);
  const auto real = logits_row.first(static_cast<std::size_t>(vocab));
  const double top = *std::max_element(real.begin(), real.end());
  double total = 0.0;
  for (float l : real) total += std::exp(static_cast<double>(l) - top);
  const double log_total = top + std::log(total);
  TokenLogprobs out{token, real[static_cast<std::size_t>(token)] - log_total, {}};
  std::vector<std::int32_t> order(real.size());
  std::iota(order.begin(), order.end(), 0);
  const auto n = static_cast<std::ptrdiff_t>(std::min(std::max<std::int64_t>(top_n, 0), vocab));
  std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](std::int32_t a, std::int32_t b) {
    return real[static_cast<std::size_t>(a)] > real[static_cast<std::size_t>(b)] ||
           (real[static_cast<std::size_t>(a)] == real[static_cast<std::size_t>(b)] && a < b);
  });
  for (std::ptrdiff_t i = 0; i < n; ++i)
    out.top.emplace_back(order[static_cast<std::size_t>(i)], real[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] - log_total);
  return out;
}

/// Applies a request's penalties to its logits row in place, as vLLM does before sampling:
/// the repetition penalty r to every token in `prompt` or `output` (logit / r when positive,
/// logit x r otherwise), then to every token in `output` the frequency penalty times its count
/// and the presence penalty once. Only the first `vocab` entries are touched; ids outside
/// [0, vocab) in the lists are ignored. A result beyond fp32's range saturates at +/- FLT_MAX
/// (a repetition penalty of 1e-40 divides a logit past it), so that no request's values can
/// make a logit infinite, which sample_token refuses as a diverged model; a logit that is not
/// finite already (the model's) is left as it is, so the request fails as an unpenalised one.
inline void apply_penalties(std::span<float> logits_row, std::int64_t vocab, const SamplingParams& params,
                            std::span<const std::int32_t> prompt, std::span<const std::int32_t> output) {
  if (!params.penalised()) return;
  const auto v = static_cast<std::size_t>(std::min<std::int64_t>(vocab, static_cast<std::int64_t>(logits_row.size())));
  std::vector<std::int32_t> count(v, 0);
  std::vector<bool> seen(v, false);
  for (auto id : prompt)
    if (id >= 0 && static_cast<std::size_t>(id) < v) seen[static_cast<std::size_t>(id)] = true;
  for (auto id : output)
    if (id >= 0 && static_cast<std::size_t>(id) < v) {
      seen[static_cast<std::size_t>(id)] = true;
      ++count[static_cast<std::size_t>(id)];
    }
  for (std::size_t i = 0; i < v; ++i) {
    float& l = logits_row[i];
    if (!std::isfinite(l)) continue;  // the model's own non-finite logit stays, for sample_token to refuse
    if (seen[i] && params.repetition_penalty != 1.0f)
      l = l > 0.0f ? l / params.repetition_penalty : l * params.repetition_penalty;
    if (count[i] > 0)
      l -= params.frequency_penalty * static_cast<float>(count[i]) + params.presence_penalty;
    l = std::clamp(l, -std::numeric_limits<float>::max(), std::numeric_limits<float>::max());
  }
}

}  // namespace dsp::serve
