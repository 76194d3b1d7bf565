#pragma once
// SamplingParams: how one request's tokens are drawn and when it stops, with vLLM's and
// OpenAI's field names and ranges.
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dsp/core/error.hpp"

namespace dsp::serve {

/// Per-request sampling and stopping. The defaults are greedy decoding of 16 tokens (OpenAI's
/// max_tokens default) with no penalties.
struct SamplingParams {
  float temperature = 0.0f;         ///< softmax temperature; 0 = greedy (argmax of the penalised logits)
  std::int64_t top_k = 0;           ///< keep the k most likely tokens; 0 or -1 = off
  float top_p = 1.0f;               ///< nucleus: smallest set with probability >= top_p; 1 = off
  float min_p = 0.0f;               ///< keep tokens with probability >= min_p x the top one's; 0 = off
  /// CTRL's repetition penalty (Keskar et al. 2019) on tokens of the prompt and the output: a
  /// positive logit is divided by it, a negative one multiplied; 1 = off.
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;    ///< subtracted once from the logit of every token already generated
  float frequency_penalty = 0.0f;   ///< subtracted per occurrence in the generated tokens
  std::uint64_t seed = 0;           ///< key of the random stream (unused when greedy)
  /// Random stream within the seed: the choice index of an OpenAI request with n > 1, so
  /// its n completions differ.
  std::uint64_t stream = 0;
  std::int64_t max_tokens = 16;     ///< tokens to generate at most (>= 1)
  std::vector<std::int32_t> stop_token_ids{};  ///< generating one of these ends the request (it is kept)
  /// Strings that end the request when the generated text contains one, matched on the text
  /// across token boundaries; the text is cut before the match (vLLM's default).
  std::vector<std::string> stop{};
  /// Return the sampled token's log-probability and the top N (N >= 0) of each step, from
  /// the model's raw logits (before penalties and temperature: vLLM's default); nullopt = none.
  std::optional<std::int64_t> logprobs{};
  /// Also return the model's logits of every prompt position [prompt, vocab] (fp32): the
  /// consistency check and the logits-file export read them.
  bool prompt_logits = false;

  /// Throws InputError naming the field and the value when one is out of range: temperature
  /// negative or not finite, top_k < -1, top_p outside (0, 1], min_p outside [0, 1],
  /// repetition_penalty <= 0 or not finite, presence or frequency penalty outside [-2, 2],
  /// max_tokens < 1, a negative stop token id, an empty stop string, logprobs < 0.
  void validate() const {
    DSP_CHECK_AS(InputError, std::isfinite(temperature) && temperature >= 0.0f,
                 "temperature must be finite and >= 0, got ", temperature);
    DSP_CHECK_AS(InputError, top_k >= -1, "top_k must be >= -1 (-1 or 0: off), got ", top_k);
    DSP_CHECK_AS(InputError, top_p > 0.0f && top_p <= 1.0f, "top_p must be in (0, 1], got ", top_p);
    DSP_CHECK_AS(InputError, min_p >= 0.0f && min_p <= 1.0f, "min_p must be in [0, 1], got ", min_p);
    DSP_CHECK_AS(InputError, std::isfinite(repetition_penalty) && repetition_penalty > 0.0f,
                 "repetition_penalty must be > 0 (1: off), got ", repetition_penalty);
    DSP_CHECK_AS(InputError, presence_penalty >= -2.0f && presence_penalty <= 2.0f,
                 "presence_penalty must be in [-2, 2], got ", presence_penalty);
    DSP_CHECK_AS(InputError, frequency_penalty >= -2.0f && frequency_penalty <= 2.0f,
                 "frequency_penalty must be in [-2, 2], got ", frequency_penalty);
    DSP_CHECK_AS(InputError, max_tokens >= 1, "max_tokens must be >= 1, got ", max_tokens);
    for (auto id : stop_token_ids) DSP_CHECK_AS(InputError, id >= 0, "stop_token_ids holds a negative id ", id);
    for (const auto& s : stop) DSP_CHECK_AS(InputError, !s.empty(), "stop holds an empty string");
    DSP_CHECK_AS(InputError, !logprobs || *logprobs >= 0, "logprobs must be >= 0, got ", logprobs.value_or(0));
  }
  bool greedy() const { return temperature == 0.0f; }
  bool penalised() const {
    return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
  }
};

}  // namespace dsp::serve
