#pragma once
// OpenAI's response bodies for /v1/completions and /v1/chat/completions, whole and streamed,
// built from the engine's RequestOutputs.
//
// A ChoiceBuilder follows one choice (one engine request) through its outputs and turns each
// into a Delta: the text released (valid UTF-8, Utf8Stream), the log-probabilities of its new
// tokens and the finish reason. A streamed response sends each Delta as a chunk; a whole
// response sends the concatenation, so both carry the same text and tokens by construction.
// Formats: OpenAI's API reference (completion and chat completion objects and their chunk
// objects); `usage` as OpenAI, with prompt_tokens_details.cached_tokens for prefix-cache hits;
// finish_reason "stop", "length" or "abort" (vLLM's for an aborted request).
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/serve/byte_text.hpp"
#include "dsp/serve/openai_request.hpp"
#include "dsp/serve/request.hpp"
#include "dsp/serve/sampler.hpp"
#include "dsp/serve/utf8_stream.hpp"

namespace dsp::serve::openai {

/// The bytes of a token's text.
using TokenText = std::function<std::string(std::int32_t)>;

/// A token's text as the logprobs fields show it: the text when it is valid UTF-8, else
/// "bytes:\xNN..." (vLLM's spelling for a byte that is part of a character).
inline std::string token_string(std::string_view bytes) {
  if (Utf8Stream::sanitize(bytes) == bytes) return std::string(bytes);
  std::string s = "bytes:";
  static constexpr char hex[] = "0123456789abcdef";
  for (char c : bytes) {
    const auto b = static_cast<unsigned char>(c);
    s += "\\x";
    s += hex[b >> 4];
    s += hex[b & 15];
  }
  return s;
}

/// What one step added to a choice.
struct Delta {
  std::string text;                   ///< valid UTF-8 released this step
  nlohmann::json logprobs;            ///< of the new tokens (the endpoint's format), null without logprobs
  std::optional<FinishReason> finish;
  std::int64_t tokens = 0;            ///< new tokens
};

/// Follows one choice through its engine outputs (see the header).
class ChoiceBuilder {
 public:
  /// `index`: the choice's index in the response; `logprobs`: whether the request asked for
  /// them (completions: `logprobs` N; chat: `logprobs: true`).
  ChoiceBuilder(ParsedRequest::Kind kind, std::int64_t index, bool logprobs, TokenText token_text)
      : kind_(kind), index_(index), logprobs_(logprobs), token_text_(std::move(token_text)) {}

  /// Takes one output of this choice's request and returns what it adds.
  Delta add(const RequestOutput& out) {
    Delta d;
    d.text = utf8_.push(out.new_text);
    d.tokens = static_cast<std::int64_t>(out.new_tokens.size());
    d.finish = out.finish;
    if (out.finish) d.text += utf8_.flush();
    if (logprobs_) d.logprobs = logprobs_json(out.logprobs);
    text_ += d.text;
    tokens_ += d.tokens;
    if (out.finish) finish_ = out.finish;
    prompt_tokens_ = out.prompt_tokens;
    cached_tokens_ = out.cached_tokens;
    if (logprobs_) append_logprobs(d.logprobs);
    return d;
  }

  std::int64_t index() const { return index_; }
  bool finished() const { return finish_.has_value(); }
  const std::string& text() const { return text_; }
  std::int64_t tokens() const { return tokens_; }
  std::int64_t prompt_tokens() const { return prompt_tokens_; }
  std::int64_t cached_tokens() const { return cached_tokens_; }
  std::optional<FinishReason> finish() const { return finish_; }
  /// Every token's log-probabilities so far (null without logprobs).
  const nlohmann::json& logprobs() const { return all_logprobs_; }

 private:
  nlohmann::json logprobs_json(const std::vector<TokenLogprobs>& entries) {
    if (kind_ == ParsedRequest::Kind::Chat) {  // {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}
      nlohmann::json content = nlohmann::json::array();
      for (const auto& e : entries) {
        nlohmann::json top = nlohmann::json::array();
        for (const auto& [id, lp] : e.top) top.push_back(chat_entry(id, lp));
        nlohmann::json entry = chat_entry(e.token, e.logprob);
        entry["top_logprobs"] = std::move(top);
        content.push_back(std::move(entry));
      }
      return {{"content", std::move(content)}};
    }
    // Completions' legacy object: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset.
    nlohmann::json j = {{"tokens", nlohmann::json::array()}, {"token_logprobs", nlohmann::json::array()},
                        {"top_logprobs", nlohmann::json::array()}, {"text_offset", nlohmann::json::array()}};
    for (const auto& e : entries) {
      const std::string bytes = token_text_(e.token);
      j["tokens"].push_back(token_string(bytes));
      j["token_logprobs"].push_back(e.logprob);
      nlohmann::json top = nlohmann::json::object();
      for (const auto& [id, lp] : e.top) top[token_string(token_text_(id))] = lp;
      j["top_logprobs"].push_back(std::move(top));
      j["text_offset"].push_back(text_offset_);
      text_offset_ += static_cast<std::int64_t>(bytes.size());
    }
    return j;
  }
  nlohmann::json chat_entry(std::int32_t id, double logprob) const {
    const std::string bytes = token_text_(id);
    nlohmann::json b = nlohmann::json::array();
    for (char c : bytes) b.push_back(static_cast<unsigned char>(c));
    return {{"token", token_string(bytes)}, {"logprob", logprob}, {"bytes", std::move(b)}};
  }
  void append_logprobs(const nlohmann::json& d) {
    if (all_logprobs_.is_null()) {
      all_logprobs_ = d;
      return;
    }
    for (auto& [key, value] : all_logprobs_.items())
      for (const auto& v : d.at(key)) value.push_back(v);
  }

  ParsedRequest::Kind kind_;
  std::int64_t index_;
  bool logprobs_;
  TokenText token_text_;
  Utf8Stream utf8_;
  std::string text_;
  std::int64_t tokens_ = 0, prompt_tokens_ = 0, cached_tokens_ = 0, text_offset_ = 0;
  std::optional<FinishReason> finish_;
  nlohmann::json all_logprobs_;
};

inline nlohmann::json finish_json(std::optional<FinishReason> f) {
  return f ? nlohmann::json(std::string(finish_reason_name(*f))) : nlohmann::json(nullptr);
}

/// OpenAI's usage object. prompt_tokens counts each prompt once (not once per choice).
inline nlohmann::json usage_json(std::int64_t prompt_tokens, std::int64_t completion_tokens, std::int64_t cached_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

/// The identity of a response: its id ("cmpl-..." or "chatcmpl-..."), creation time (Unix
/// seconds), model name and kind.
struct ResponseHeader {
  ParsedRequest::Kind kind;
  std::string id;
  std::int64_t created = 0;
  std::string model;
};

/// One streamed chunk carrying `delta` of choice `index` (text_completion or
/// chat.completion.chunk). Chat's first chunk of a choice (`first`) carries the role.
inline nlohmann::json chunk_json(const ResponseHeader& h, std::int64_t index, const Delta& d, bool first = false) {
  nlohmann::json choice = {{"index", index}, {"logprobs", d.logprobs}, {"finish_reason", finish_json(d.finish)}};
  if (h.kind == ParsedRequest::Kind::Chat) {
    nlohmann::json delta = {{"content", d.text}};
    if (first) delta["role"] = "assistant";
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = d.text;
  }
  return {{"id", h.id},
          {"object", h.kind == ParsedRequest::Kind::Chat ? "chat.completion.chunk" : "text_completion"},
          {"created", h.created},
          {"model", h.model},
          {"choices", nlohmann::json::array({std::move(choice)})}};
}

/// The last chunk of a stream with stream_options.include_usage: no choices, the usage.
inline nlohmann::json usage_chunk_json(const ResponseHeader& h, nlohmann::json usage) {
  return {{"id", h.id},
          {"object", h.kind == ParsedRequest::Kind::Chat ? "chat.completion.chunk" : "text_completion"},
          {"created", h.created},
          {"model", h.model},
          {"choices", nlohmann::json::array()},
          {"usage", std::move(usage)}};
}

/// A whole response (text_completion or chat.completion) of finished choices, in index order.
inline nlohmann::json response_json(const ResponseHeader& h, const std::vector<ChoiceBuilder>& choices, nlohmann::json usage) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& c : choices) {
    nlohmann::json choice = {{"index", c.index()}, {"logprobs", c.logprobs()}, {"finish_reason", finish_json(c.finish())}};
    if (h.kind == ParsedRequest::Kind::Chat) choice["message"] = {{"role", "assistant"}, {"content", c.text()}};
    else choice["text"] = c.text();
    list.push_back(std::move(choice));
  }
  return {{"id", h.id},
          {"object", h.kind == ParsedRequest::Kind::Chat ? "chat.completion" : "text_completion"},
          {"created", h.created},
          {"model", h.model},
          {"choices", std::move(list)},
          {"usage", std::move(usage)}};
}

}  // namespace dsp::serve::openai
