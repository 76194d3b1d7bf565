// OpenAI request bodies: every prompt form, defaults, and each bad input an ApiError with
// the status, the field (param) and the value named.
#include <doctest/doctest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "dsp/serve/openai_request.hpp"

namespace oa = dsp::serve::openai;
using nlohmann::json;

namespace {

const oa::ServedModel served_model{"demo", 256, 128};

// The ApiError parsing `body` throws (fails the test when it throws none).
oa::ApiError error_of(const json& body, bool chat = false) {
  try {
    if (chat) (void)oa::parse_chat_request(body, served_model);
    else (void)oa::parse_completion_request(body, served_model);
  } catch (const oa::ApiError& e) {
    return e;
  }
  FAIL("no ApiError for " << body.dump());
  return oa::ApiError(0, "");
}

bool mentions(const oa::ApiError& e, const std::string& s) { return std::string(e.what()).find(s) != std::string::npos; }

}  // namespace

TEST_CASE("completions: prompt forms, defaults and fields") {
  auto r = oa::parse_completion_request(json::parse(R"({"model": "demo", "prompt": "Hi"})"), served_model);
  REQUIRE(r.prompts.size() == 1);
  CHECK(r.prompts[0] == std::vector<std::int32_t>{'H', 'i'});
  CHECK(r.params[0].max_tokens == 16);  // OpenAI's default
  CHECK(r.params[0].temperature == 1.0f);  // OpenAI's and vLLM's default: sampled, not greedy
  CHECK(!r.stream);
  CHECK(r.model == "demo");

  r = oa::parse_completion_request(json::parse(R"({"prompt": [1, 2, 3], "max_tokens": 5.0})"), served_model);  // model optional
  CHECK(r.prompts == std::vector<std::vector<std::int32_t>>{{1, 2, 3}});
  CHECK(r.params[0].max_tokens == 5);

  r = oa::parse_completion_request(json::parse(R"({"prompt": ["ab", [7]], "n": 3, "seed": 9, "temperature": 0.5,
    "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": -1, "frequency_penalty": 2,
    "stop": "\n\n", "stop_token_ids": [3], "logprobs": 2, "stream": true, "stream_options": {"include_usage": true},
    "ignore_eos": true, "user": "x", "unknown_field": {}})"),
                                  served_model);
  REQUIRE(r.prompts.size() == 2);
  CHECK(r.prompts[1] == std::vector<std::int32_t>{7});
  CHECK(r.n == 3);
  CHECK(r.seeded);
  const auto& p = r.params[1];
  CHECK(p.seed == 9);
  CHECK(p.temperature == doctest::Approx(0.5));
  CHECK(p.top_k == 5);
  CHECK(p.stop == std::vector<std::string>{"\n\n"});
  CHECK(p.stop_token_ids == std::vector<std::int32_t>{3});
  CHECK(p.logprobs == 2);
  CHECK(r.stream);
  CHECK(r.include_usage);
}

TEST_CASE("completions: bad input is a 400 naming the field and the value, an unknown model a 404") {
  auto e = error_of(json::parse(R"({"prompt": "x", "max_tokens": "ten"})"));
  CHECK(e.status() == 400);
  CHECK(e.param() == "max_tokens");
  CHECK(mentions(e, "must be an integer, got a string"));
  CHECK(e.body()["error"]["type"] == "invalid_request_error");

  e = error_of(json::parse(R"({"prompt": "", "max_tokens": 4})"));
  CHECK((e.param() == "prompt" && mentions(e, "empty")));
  CHECK(error_of(json::parse(R"({"prompt": []})")).param() == "prompt");
  CHECK(error_of(json::parse(R"({"prompt": [[]]})")).param() == "prompt");
  CHECK(error_of(json::parse(R"({"max_tokens": 4})")).param() == "prompt");
  CHECK(error_of(json::parse(R"({"prompt": 5})")).param() == "prompt");

  e = error_of(json::parse(R"({"prompt": [1, 256]})"));
  CHECK((e.param() == "prompt" && mentions(e, "token id 256") && mentions(e, "[0, 256)")));
  CHECK(error_of(json::parse(R"({"prompt": [1, -1]})")).param() == "prompt");
  CHECK(error_of(json::parse(R"({"prompt": [1, 2.5]})")).param() == "prompt");

  e = error_of(json::parse(R"({"prompt": "0123456789", "max_tokens": 120})"));  // 10 + 120 > 128
  CHECK((e.status() == 400 && e.code() == "context_length_exceeded"));
  CHECK((mentions(e, "128") && mentions(e, "130") && mentions(e, "10 in the prompt") && mentions(e, "120 for the completion")));
  CHECK_NOTHROW(oa::parse_completion_request(json::parse(R"({"prompt": "0123456789", "max_tokens": 118})"), served_model));

  e = error_of(json::parse(R"({"model": "gpt-4", "prompt": "x"})"));
  CHECK((e.status() == 404 && e.code() == "model_not_found" && mentions(e, "gpt-4")));
  CHECK(error_of(json::parse(R"({"model": 3, "prompt": "x"})")).status() == 400);

  for (const char* body : {R"({"prompt": "x", "top_p": 0})", R"({"prompt": "x", "top_p": 1.5})",
                           R"({"prompt": "x", "repetition_penalty": 0})", R"({"prompt": "x", "presence_penalty": 2.5})",
                           R"({"prompt": "x", "frequency_penalty": -3})", R"({"prompt": "x", "temperature": -1})",
                           R"({"prompt": "x", "max_tokens": 0})", R"({"prompt": "x", "top_k": -2})",
                           R"({"prompt": "x", "min_p": 2})", R"({"prompt": "x", "logprobs": 21})",
                           R"({"prompt": "x", "n": 0})", R"({"prompt": "x", "temperature": "hot"})",
                           R"({"prompt": "x", "stop": [1]})", R"({"prompt": "x", "stop": ""})",
                           R"({"prompt": "x", "stream": "yes"})", R"({"prompt": "x", "stream_options": {"include_usage": true}})",
                           R"({"prompt": "x", "echo": true})", R"({"prompt": "x", "best_of": 3})",
                           R"({"prompt": "x", "logit_bias": {"1": 5}})", R"({"prompt": "x", "stop_token_ids": "3"})"}) {
    CAPTURE(body);
    e = error_of(json::parse(body));
    CHECK(e.status() == 400);
    CHECK(!e.param().empty());
    CHECK(mentions(e, e.param()));
  }
  e = error_of(json::parse(R"({"prompt": "x", "top_p": 1.5})"));
  CHECK((e.param() == "top_p" && mentions(e, "1.5")));
  e = error_of(json::parse(R"({"prompt": "x", "repetition_penalty": -0.5})"));
  CHECK((e.param() == "repetition_penalty" && mentions(e, "-0.5")));
  e = error_of(json::parse(R"({"prompt": "x", "presence_penalty": 2.5})"));
  CHECK((e.param() == "presence_penalty" && mentions(e, "2.5")));
  CHECK(error_of(json::parse(R"([1, 2])")).status() == 400);
}

TEST_CASE("completions: extreme values, limits and unsupported fields (found by review)") {
  // max_tokens near 2^63: no overflow past the length check.
  auto e = error_of(json::parse(R"({"prompt": "ROMEO:", "max_tokens": 9223372036854775807})"));
  CHECK((e.code() == "context_length_exceeded" && mentions(e, "9223372036854775807 for the completion")));
  // Integers beyond int64 are refused, not wrapped (top_k 2^64 - 1 is not -1).
  e = error_of(json::parse(R"({"prompt": "x", "top_k": 18446744073709551615})"));
  CHECK((e.param() == "top_k" && mentions(e, "18446744073709551615")));
  CHECK(error_of(json::parse(R"({"prompt": "x", "n": 9223372036854775808})")).param() == "n");
  // Integral floats are integers everywhere.
  auto r = oa::parse_completion_request(json::parse(R"({"prompt": [65.0, 66], "stop_token_ids": [3.0], "n": 2.0})"), served_model);
  CHECK(r.prompts[0] == std::vector<std::int32_t>{65, 66});
  CHECK(r.params[0].stop_token_ids == std::vector<std::int32_t>{3});
  CHECK(error_of(json::parse(R"({"prompt": [65.5]})")).param() == "prompt");
  // Bounded stop lists.
  json many = {{"prompt", "x"}, {"stop", json::array()}};
  for (int i = 0; i < 17; ++i) many["stop"].push_back("s" + std::to_string(i));
  e = error_of(many);
  CHECK((e.param() == "stop" && mentions(e, "17 strings")));
  e = error_of(json{{"prompt", "x"}, {"stop", std::string(513, 'a')}});
  CHECK((e.param() == "stop" && mentions(e, "513 bytes")));
  // prompts x n over what the server can queue: 400 (it could never run), before any work.
  const oa::ServedModel small{"demo", 256, 128, 4};
  try {
    (void)oa::parse_completion_request(json::parse(R"({"prompt": ["a", "b", "c"], "n": 2})"), small);
    FAIL("no error");
  } catch (const oa::ApiError& err) {
    CHECK((err.status() == 400 && err.param() == "n"));
    CHECK(std::string(err.what()).find("6 completions (3 prompts x n 2)") != std::string::npos);
  }
  // Unsupported fields with a non-default value are refused; their defaults pass.
  for (const char* body : {R"({"prompt": "x", "response_format": {"type": 5}})", R"({"prompt": "x", "response_format": {"type": "json_object"}})",
                           R"({"prompt": "x", "tools": {"type": "text"}})", R"({"prompt": "x", "tool_choice": "auto"})",
                           R"({"prompt": "x", "min_tokens": 4})", R"({"prompt": "x", "include_stop_str_in_output": true})",
                           R"({"prompt": "x", "guided_json": {}})", R"({"prompt": "x", "allowed_token_ids": [1]})",
                           R"({"prompt": "x", "bad_words": ["a"]})", R"({"prompt": "x", "prompt_logprobs": 1})",
                           R"({"prompt": "x", "truncate_prompt_tokens": 4})", R"({"prompt": "x", "skip_special_tokens": false})"}) {
    CAPTURE(body);
    e = error_of(json::parse(body));
    CHECK((e.status() == 400 && mentions(e, "not supported")));
  }
  CHECK_NOTHROW(oa::parse_completion_request(
      json::parse(R"({"prompt": "x", "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "min_tokens": 0,
                    "skip_special_tokens": true, "include_stop_str_in_output": false, "bad_words": [], "echo": false, "best_of": 1})"),
      served_model));
}

TEST_CASE("chat: the template, max_tokens' default and logprobs") {
  const json body = json::parse(R"({"messages": [{"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "!"}]}]})");
  auto r = oa::parse_chat_request(body, served_model);
  const std::string prompt = "SYSTEM:\nBe brief.\n\nUSER:\nHello!\n\nASSISTANT:\n";
  REQUIRE(r.prompts.size() == 1);
  CHECK(r.prompts[0] == std::vector<std::int32_t>(prompt.begin(), prompt.end()));
  CHECK(r.params[0].max_tokens == 128 - static_cast<std::int64_t>(prompt.size()));  // vLLM's default: what is left
  CHECK(!r.params[0].logprobs);
  CHECK(r.params[0].temperature == 1.0f);  // as for completions

  r = oa::parse_chat_request(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true,
    "top_logprobs": 3, "max_completion_tokens": 4})"),
                             served_model);
  CHECK(r.params[0].logprobs == 3);
  CHECK(r.params[0].max_tokens == 4);
  CHECK(r.chat_logprobs);

  CHECK(error_of(json::parse(R"({"messages": []})"), true).param() == "messages");
  CHECK(error_of(json::parse(R"({"messages": "hi"})"), true).param() == "messages");
  CHECK(error_of(json::parse(R"({"messages": [{"role": "tool", "content": "x"}]})"), true).param() == "messages");
  CHECK(error_of(json::parse(R"({"messages": [{"role": "user"}]})"), true).param() == "messages");
  CHECK(error_of(json::parse(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})"), true).param() ==
        "messages");
  CHECK(error_of(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})"), true).param() ==
        "top_logprobs");
  const auto e = error_of(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 200})"), true);
  CHECK((e.code() == "context_length_exceeded" && e.param() == "messages"));
  const auto zero = error_of(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0})"), true);
  CHECK(zero.param() == "max_completion_tokens");
  const json long_chat = {{"messages", {{{"role", "user"}, {"content", std::string(130, 'a')}}}}};
  CHECK(error_of(long_chat, true).code() == "context_length_exceeded");
}
