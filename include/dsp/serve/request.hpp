#pragma once
// A request in the serving engine: its tokens, sampling parameters, where its keys and values
// are (block table) and how far they are computed; and what a step reports of it.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dsp/core/tensor.hpp"
#include "dsp/serve/block_manager.hpp"
#include "dsp/serve/sampler.hpp"
#include "dsp/serve/sampling_params.hpp"
#include "dsp/serve/stop_checker.hpp"

namespace dsp::serve {

/// Why a request ended (OpenAI's finish_reason).
enum class FinishReason { Stop, Length, Abort };

/// "stop", "length", "abort".
constexpr std::string_view finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Abort: return "abort";
  }
  return "?";
}

enum class RequestStatus { Waiting, Running, Finished };

struct Request {
  std::string id;
  std::vector<std::int32_t> prompt;
  SamplingParams params;
  std::int64_t max_model_len = 0;   ///< of the engine, for the length stop
  std::vector<std::int32_t> output;  ///< generated tokens
  /// Tokens whose keys and values are in the cache: prompt + output positions 0..computed-1.
  std::int64_t computed = 0;
  RequestStatus status = RequestStatus::Waiting;
  BlockTable table;
  std::int64_t cached_tokens = 0;  ///< prompt tokens found in the prefix cache at its admission
  std::int64_t preemptions = 0;    ///< times it was preempted (blocks freed, recomputed later)
  StopChecker stops;
  std::optional<FinishReason> finish;
  /// With params.prompt_logits: logits of the prompt positions computed so far [prompt, vocab].
  std::vector<float> prompt_logits;

  /// Prompt and output tokens, the sequence the cache holds.
  std::int64_t num_tokens() const { return static_cast<std::int64_t>(prompt.size() + output.size()); }
  std::int32_t token(std::int64_t i) const {
    const auto p = static_cast<std::int64_t>(prompt.size());
    return i < p ? prompt[static_cast<std::size_t>(i)] : output[static_cast<std::size_t>(i - p)];
  }
  std::vector<std::int32_t> all_tokens() const {
    std::vector<std::int32_t> t = prompt;
    t.insert(t.end(), output.begin(), output.end());
    return t;
  }
};

/// What one engine step reports of a request: the tokens it generated in this step (one, or
/// none while its prompt is still being prefilled in chunks), the text they released and
/// whether it ended.
struct RequestOutput {
  std::string id;
  std::vector<std::int32_t> new_tokens;
  /// Bytes of generated text released this step (held back while they could begin a stop
  /// string; cut before a matched stop string and before a stop token's text).
  std::string new_text;
  /// With SamplingParams::logprobs: one entry per new token.
  std::vector<TokenLogprobs> logprobs;
  /// With SamplingParams::prompt_logits, in the step that samples the first token: the
  /// model's logits of every prompt position [prompt, vocab] (host, fp32).
  Tensor prompt_logits;
  std::optional<FinishReason> finish;
  std::int64_t prompt_tokens = 0;     ///< prompt length
  std::int64_t generated_tokens = 0;  ///< output length so far
  std::int64_t cached_tokens = 0;     ///< prompt tokens served from the prefix cache
  bool finished() const { return finish.has_value(); }
};

}  // namespace dsp::serve
