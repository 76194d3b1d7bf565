// OpenAI response bodies from engine outputs: streamed deltas add up to the whole response,
// UTF-8 never split, logprobs in each endpoint's format, usage.
#include <doctest/doctest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "dsp/serve/openai_response.hpp"

namespace oa = dsp::serve::openai;
using dsp::serve::FinishReason;
using dsp::serve::RequestOutput;
using Kind = oa::ParsedRequest::Kind;

namespace {

RequestOutput output(std::vector<std::int32_t> tokens, std::string text, std::optional<FinishReason> finish = {}) {
  RequestOutput o;
  o.id = "r";
  for (auto t : tokens) o.logprobs.push_back({t, -0.5 * t, {{t, -0.5 * t}, {1, -3.0}}});
  o.new_tokens = std::move(tokens);
  o.new_text = std::move(text);
  o.finish = finish;
  o.prompt_tokens = 4;
  o.cached_tokens = 2;
  return o;
}

}  // namespace

TEST_CASE("ChoiceBuilder: deltas hold back a split character; their sum is the whole text") {
  oa::ChoiceBuilder c(Kind::Completion, 0, true, dsp::serve::byte_token_text);
  const oa::Delta d1 = c.add(output({'a', 0xE2}, "a\xE2"));
  CHECK(d1.text == "a");
  CHECK(d1.tokens == 2);
  CHECK(d1.logprobs["tokens"] == nlohmann::json({"a", "bytes:\\xe2"}));
  CHECK(d1.logprobs["text_offset"] == nlohmann::json({0, 1}));
  CHECK(d1.logprobs["top_logprobs"][0]["a"] == doctest::Approx(-48.5));
  const oa::Delta d2 = c.add(output({0x82, 0xAC}, "\x82\xAC", FinishReason::Length));
  CHECK(d2.text == "\xE2\x82\xAC");
  CHECK(d2.logprobs["text_offset"] == nlohmann::json({2, 3}));
  CHECK(d2.finish == FinishReason::Length);
  CHECK(c.text() == d1.text + d2.text);
  CHECK(c.tokens() == 4);
  CHECK(c.logprobs()["token_logprobs"].size() == 4);
  CHECK(c.logprobs()["text_offset"] == nlohmann::json({0, 1, 2, 3}));
  // A byte that never completes a character becomes U+FFFD when the choice ends.
  oa::ChoiceBuilder e(Kind::Completion, 0, false, dsp::serve::byte_token_text);
  CHECK(e.add(output({0xC3}, "\xC3")).text.empty());
  CHECK(e.add(output({}, "", FinishReason::Abort)).text == "\xEF\xBF\xBD");
  CHECK(e.logprobs().is_null());
}

TEST_CASE("chunks and whole responses: completions and chat") {
  const oa::ResponseHeader completion{Kind::Completion, "cmpl-1", 100, "demo"};
  oa::ChoiceBuilder c(Kind::Completion, 2, false, dsp::serve::byte_token_text);
  const oa::Delta d = c.add(output({'h', 'i'}, "hi", FinishReason::Stop));
  const auto chunk = oa::chunk_json(completion, 2, d);
  CHECK(chunk["object"] == "text_completion");
  CHECK(chunk["choices"][0]["text"] == "hi");
  CHECK(chunk["choices"][0]["index"] == 2);
  CHECK(chunk["choices"][0]["finish_reason"] == "stop");
  CHECK(chunk["choices"][0]["logprobs"].is_null());
  const auto whole = oa::response_json(completion, {c}, oa::usage_json(4, 2, 2));
  CHECK(whole["choices"][0]["text"] == "hi");
  CHECK(whole["usage"] == nlohmann::json::parse(
                              R"({"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 2}})"));

  const oa::ResponseHeader chat{Kind::Chat, "chatcmpl-1", 100, "demo"};
  oa::ChoiceBuilder m(Kind::Chat, 0, true, dsp::serve::byte_token_text);
  const oa::Delta first = m.add(output({'o'}, "o"));
  auto ch = oa::chunk_json(chat, 0, first, true);
  CHECK(ch["object"] == "chat.completion.chunk");
  CHECK(ch["choices"][0]["delta"] == nlohmann::json({{"role", "assistant"}, {"content", "o"}}));
  CHECK(ch["choices"][0]["finish_reason"].is_null());
  CHECK(ch["choices"][0]["logprobs"]["content"][0]["token"] == "o");
  CHECK(ch["choices"][0]["logprobs"]["content"][0]["bytes"] == nlohmann::json({'o'}));
  CHECK(ch["choices"][0]["logprobs"]["content"][0]["top_logprobs"].size() == 2);
  const oa::Delta last = m.add(output({'k'}, "k", FinishReason::Length));
  CHECK(!oa::chunk_json(chat, 0, last)["choices"][0]["delta"].contains("role"));
  const auto reply = oa::response_json(chat, {m}, oa::usage_json(4, 2, 0));
  CHECK(reply["object"] == "chat.completion");
  CHECK(reply["choices"][0]["message"] == nlohmann::json({{"role", "assistant"}, {"content", "ok"}}));
  CHECK(reply["choices"][0]["finish_reason"] == "length");
  CHECK(reply["choices"][0]["logprobs"]["content"].size() == 2);
  const auto usage = oa::usage_chunk_json(chat, oa::usage_json(4, 2, 0));
  CHECK(usage["choices"].empty());
  CHECK(usage["usage"]["total_tokens"] == 6);
}
