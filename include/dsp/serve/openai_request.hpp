#pragma once
// OpenAI's request bodies for POST /v1/completions and POST /v1/chat/completions, read into
// prompts and SamplingParams with every field's type and range checked.
//
// Field names are OpenAI's (https://platform.openai.com/docs/api-reference/completions) and,
// for what OpenAI lacks, vLLM's extra sampling fields (top_k, min_p, repetition_penalty,
// stop_token_ids, ignore_eos). A field of the wrong type, a value out of range, an empty
// prompt, a token id outside the vocabulary or a prompt + max_tokens over the model length is
// an ApiError with status 400 naming the field (OpenAI's `param`) and the value; an unknown
// model name is a 404. Fields this server does not implement with a non-default value (echo,
// best_of != n, suffix, logit_bias, tools) are refused rather than ignored; fields it does not
// know are ignored, as OpenAI's API ignores them. An absent field takes OpenAI's default:
// temperature 1 (sampled; 0 asks for greedy), max_tokens 16 for a completion.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/core/error.hpp"
#include "dsp/serve/chat_template.hpp"
#include "dsp/serve/sampling_params.hpp"

namespace dsp::serve::openai {

/// An error the API answers with: HTTP status and OpenAI's error object
/// `{"error": {"message", "type", "param", "code"}}` (param and code may be null).
class ApiError : public InputError {
 public:
  ApiError(int status, std::string message, std::string param = {}, std::string code = {})
      : InputError(message), status_(status), param_(std::move(param)), code_(std::move(code)) {}
  int status() const { return status_; }
  /// OpenAI's error type for the status: invalid_request_error (400, 404, 413), authentication_error
  /// (401), server_error (5xx).
  std::string type() const {
    if (status_ == 401) return "authentication_error";
    if (status_ >= 500) return "server_error";
    return "invalid_request_error";
  }
  const std::string& param() const { return param_; }
  const std::string& code() const { return code_; }
  /// The error body: {"error": {"message", "type", "param", "code"}}.
  nlohmann::json body() const {
    return {{"error",
             {{"message", what()},
              {"type", type()},
              {"param", param_.empty() ? nlohmann::json(nullptr) : nlohmann::json(param_)},
              {"code", code_.empty() ? nlohmann::json(nullptr) : nlohmann::json(code_)}}}};
  }

 private:
  int status_;
  std::string param_, code_;
};

/// What the server needs to know to check a request: its model name and limits.
struct ServedModel {
  std::string name;                 ///< --served-model-name
  std::int64_t vocab_size = 256;    ///< token ids must lie in [0, vocab_size)
  std::int64_t max_model_len = 0;   ///< prompt + max_tokens at most
  /// Completions one request may ask for (prompts x n) at most: the server's --max-queue, as a
  /// request over it could never be queued.
  std::int64_t max_choices = 256;
};

/// At most this many stop strings of at most this many bytes, and stop token ids, per request
/// (OpenAI allows 4 strings; vLLM sets no limit, and every string is matched at every token).
inline constexpr std::size_t max_stop_strings = 16, max_stop_string_bytes = 512, max_stop_token_ids = 1024;

/// A parsed request: its prompts (token ids) and how to sample each of its n choices.
struct ParsedRequest {
  enum class Kind { Completion, Chat };
  Kind kind = Kind::Completion;
  std::string model;
  std::vector<std::vector<std::int32_t>> prompts;  ///< completions: one or more; chat: one
  std::int64_t n = 1;                               ///< choices per prompt
  bool stream = false;
  bool include_usage = false;                       ///< stream_options.include_usage
  /// The sampling of every choice (max_tokens resolved, per prompt for chat's default; seed
  /// unset when the request gave none). SamplingParams::stream is set per choice by the caller.
  std::vector<SamplingParams> params;               ///< one per prompt
  bool seeded = false;                              ///< the request gave a seed
  /// Chat's logprobs: true when `logprobs` was true (top N = top_logprobs, default 0).
  bool chat_logprobs = false;
};

namespace detail {

using dsp::detail::concat;

inline std::string type_name(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null: return "null";
    case nlohmann::json::value_t::boolean: return "a boolean";
    case nlohmann::json::value_t::string: return "a string";
    case nlohmann::json::value_t::array: return "an array";
    case nlohmann::json::value_t::object: return "an object";
    case nlohmann::json::value_t::number_float: return "a number";
    default: return "an integer";
  }
}

inline ApiError bad(std::string_view field, const std::string& message) {
  return ApiError(400, message, std::string(field));
}

// body[field] when present and not null.
inline const nlohmann::json* field(const nlohmann::json& body, std::string_view name) {
  const auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

inline std::optional<double> number(const nlohmann::json& body, std::string_view name) {
  const nlohmann::json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) throw bad(name, concat("'", name, "' must be a number, got ", type_name(*v)));
  return v->get<double>();
}

// v as an integer: a JSON integer within int64, or a number with no fraction (16.0).
inline std::optional<std::int64_t> as_integer(const nlohmann::json& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
    return static_cast<std::int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<std::int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) return static_cast<std::int64_t>(d);
  }
  return std::nullopt;
}

inline std::optional<std::int64_t> integer(const nlohmann::json& body, std::string_view name) {
  const nlohmann::json* v = field(body, name);
  if (!v) return std::nullopt;
  if (auto i = as_integer(*v)) return i;
  throw bad(name, concat("'", name, "' must be an integer", v->is_number() ? " within 64 bits, got " : ", got ",
                         v->is_number() ? v->dump() : type_name(*v)));
}

inline std::optional<bool> boolean(const nlohmann::json& body, std::string_view name) {
  const nlohmann::json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) throw bad(name, concat("'", name, "' must be a boolean, got ", type_name(*v)));
  return v->get<bool>();
}

inline float as_float(std::string_view name, double v) {
  if (!std::isfinite(v) || std::fabs(v) > std::numeric_limits<float>::max())
    throw bad(name, concat("'", name, "' must be a finite number, got ", v));
  return static_cast<float>(v);
}

// A prompt of token ids: each an integer in [0, vocab).
inline std::vector<std::int32_t> token_ids(const nlohmann::json& a, std::string_view name, std::int64_t vocab) {
  std::vector<std::int32_t> ids;
  ids.reserve(a.size());
  for (const auto& t : a) {
    const auto i = as_integer(t);
    if (!i) throw bad(name, concat("'", name, "' token ids must be integers, got ", t.is_number() ? t.dump() : type_name(t)));
    const std::int64_t id = *i;
    if (id < 0 || id >= vocab)
      throw bad(name, concat("token id ", id, " in '", name, "' is outside the vocabulary [0, ", vocab, ")"));
    ids.push_back(static_cast<std::int32_t>(id));
  }
  return ids;
}

inline std::vector<std::int32_t> text_ids(std::string_view text, std::string_view name, std::int64_t vocab) {
  std::vector<std::int32_t> ids;
  ids.reserve(text.size());
  for (char c : text) {
    const auto id = static_cast<std::int32_t>(static_cast<unsigned char>(c));
    if (id >= vocab)
      throw bad(name, concat("'", name, "' holds byte ", id, ", outside the vocabulary [0, ", vocab, ") of this byte-level model"));
    ids.push_back(id);
  }
  return ids;
}

// Completions' prompt: a string, an array of strings, an array of token ids, or an array of
// arrays of token ids.
inline std::vector<std::vector<std::int32_t>> completion_prompts(const nlohmann::json& body, std::int64_t vocab) {
  const nlohmann::json* p = field(body, "prompt");
  if (!p) throw bad("prompt", "'prompt' is required");
  std::vector<std::vector<std::int32_t>> prompts;
  if (p->is_string()) {
    prompts.push_back(text_ids(p->get_ref<const std::string&>(), "prompt", vocab));
  } else if (p->is_array() && !p->empty() && (*p)[0].is_number()) {
    prompts.push_back(token_ids(*p, "prompt", vocab));
  } else if (p->is_array() && !p->empty()) {
    for (const auto& e : *p) {
      if (e.is_string()) prompts.push_back(text_ids(e.get_ref<const std::string&>(), "prompt", vocab));
      else if (e.is_array()) prompts.push_back(token_ids(e, "prompt", vocab));
      else
        throw bad("prompt", concat("'prompt' must be a string, an array of strings, an array of token ids or an array "
                                   "of arrays of token ids; it holds ", type_name(e)));
    }
  } else if (p->is_array()) {
    throw bad("prompt", "the prompt is empty");
  } else {
    throw bad("prompt", concat("'prompt' must be a string or an array, got ", type_name(*p)));
  }
  for (const auto& ids : prompts)
    if (ids.empty()) throw bad("prompt", "the prompt is empty");
  return prompts;
}

// Chat's messages: [{"role", "content"}], content a string or an array of {"type": "text",
// "text"} parts.
inline std::vector<ChatMessage> chat_messages(const nlohmann::json& body) {
  const nlohmann::json* m = field(body, "messages");
  if (!m) throw bad("messages", "'messages' is required");
  if (!m->is_array()) throw bad("messages", concat("'messages' must be an array, got ", type_name(*m)));
  if (m->empty()) throw bad("messages", "'messages' is empty");
  std::vector<ChatMessage> messages;
  for (std::size_t i = 0; i < m->size(); ++i) {
    const auto& e = (*m)[i];
    const std::string where = concat("messages[", i, "]");
    if (!e.is_object()) throw bad("messages", concat(where, " must be an object, got ", type_name(e)));
    const nlohmann::json* role = field(e, "role");
    if (!role || !role->is_string()) throw bad("messages", concat(where, ".role must be a string"));
    ChatMessage msg{role->get<std::string>(), {}};
    if (!is_chat_role(msg.role))
      throw bad("messages", concat(where, ".role '", msg.role, "' is not one of system, developer, user, assistant"));
    const nlohmann::json* content = field(e, "content");
    if (!content) {
      if (msg.role != "assistant") throw bad("messages", concat(where, ".content is required"));
    } else if (content->is_string()) {
      msg.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (const auto& part : *content) {
        const nlohmann::json* type = part.is_object() ? field(part, "type") : nullptr;
        if (!type || *type != "text")
          throw bad("messages", concat(where, ".content: only parts of type 'text' are supported"));
        const nlohmann::json* text = field(part, "text");
        if (!text || !text->is_string()) throw bad("messages", concat(where, ".content: a text part needs a string 'text'"));
        msg.content += text->get<std::string>();
      }
    } else {
      throw bad("messages", concat(where, ".content must be a string or an array of text parts, got ", type_name(*content)));
    }
    messages.push_back(std::move(msg));
  }
  return messages;
}

// Fields this server does not implement: refused when they ask for something other than
// the default, so that a client never gets silently different behaviour.
inline void refuse_unsupported(const nlohmann::json& body, std::int64_t n) {
  const auto refuse = [](std::string_view f) { throw bad(f, concat("'", f, "' is not supported by this server")); };
  if (const nlohmann::json* v = field(body, "echo"); v && *v != false) refuse("echo");
  if (const nlohmann::json* v = field(body, "best_of"); v && !(as_integer(*v) == n))
    throw bad("best_of", concat("'best_of' other than n (", n, ") is not supported by this server, got ", v->dump()));
  if (const nlohmann::json* v = field(body, "suffix"); v && *v != "") refuse("suffix");
  if (const nlohmann::json* v = field(body, "logit_bias"); v && !(v->is_object() && v->empty())) refuse("logit_bias");
  for (const char* f : {"tools", "functions"})
    if (const nlohmann::json* v = field(body, f); v && !(v->is_array() && v->empty())) refuse(f);
  for (const char* f : {"tool_choice", "function_call"})
    if (const nlohmann::json* v = field(body, f); v && *v != "none") refuse(f);
  if (const nlohmann::json* v = field(body, "response_format"); v && !(v->is_object() && v->size() == 1 && v->value("type", nlohmann::json()) == "text"))
    refuse("response_format");
  // vLLM's own request fields.
  if (const nlohmann::json* v = field(body, "min_tokens"); v && *v != 0) refuse("min_tokens");
  for (const char* f : {"include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                        "add_special_tokens", "use_beam_search", "return_tokens_as_token_ids"})
    if (const nlohmann::json* v = field(body, f); v && *v != (std::string_view(f) == "skip_special_tokens" ||
                                                             std::string_view(f) == "spaces_between_special_tokens"))
      refuse(f);
  for (const char* f : {"allowed_token_ids", "prompt_logprobs", "truncate_prompt_tokens", "guided_json", "guided_regex",
                        "guided_choice", "guided_grammar", "guided_decoding_backend", "structured_outputs",
                        "logits_processors", "length_penalty"})
    if (field(body, f)) refuse(f);
  if (const nlohmann::json* v = field(body, "bad_words"); v && !(v->is_array() && v->empty())) refuse("bad_words");
}

// The sampling fields common to both endpoints.
inline SamplingParams sampling(const nlohmann::json& body, ParsedRequest& r) {
  SamplingParams p;
  p.temperature = 1.0f;  // OpenAI's default (vLLM's without generation_config defaults); SamplingParams' own 0 is greedy
  if (auto v = number(body, "temperature")) p.temperature = as_float("temperature", *v);
  if (auto v = number(body, "top_p")) p.top_p = as_float("top_p", *v);
  if (auto v = integer(body, "top_k")) p.top_k = *v;
  if (auto v = number(body, "min_p")) p.min_p = as_float("min_p", *v);
  if (auto v = number(body, "repetition_penalty")) p.repetition_penalty = as_float("repetition_penalty", *v);
  if (auto v = number(body, "presence_penalty")) p.presence_penalty = as_float("presence_penalty", *v);
  if (auto v = number(body, "frequency_penalty")) p.frequency_penalty = as_float("frequency_penalty", *v);
  if (auto v = integer(body, "seed")) {
    p.seed = static_cast<std::uint64_t>(*v);
    r.seeded = true;
  }
  if (const nlohmann::json* s = field(body, "stop")) {
    if (s->is_string()) {
      p.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      for (const auto& e : *s) {
        if (!e.is_string()) throw bad("stop", concat("'stop' must be a string or an array of strings; it holds ", type_name(e)));
        p.stop.push_back(e.get<std::string>());
      }
    } else {
      throw bad("stop", concat("'stop' must be a string or an array of strings, got ", type_name(*s)));
    }
    if (p.stop.size() > max_stop_strings)
      throw bad("stop", concat("'stop' holds ", p.stop.size(), " strings; at most ", max_stop_strings, " are allowed"));
    for (const auto& stop : p.stop)
      if (stop.size() > max_stop_string_bytes)
        throw bad("stop", concat("'stop' holds a string of ", stop.size(), " bytes; at most ", max_stop_string_bytes, " are allowed"));
  }
  if (const nlohmann::json* s = field(body, "stop_token_ids")) {
    if (!s->is_array()) throw bad("stop_token_ids", concat("'stop_token_ids' must be an array of integers, got ", type_name(*s)));
    if (s->size() > max_stop_token_ids)
      throw bad("stop_token_ids", concat("'stop_token_ids' holds ", s->size(), " ids; at most ", max_stop_token_ids, " are allowed"));
    for (const auto& e : *s) {
      const auto i = as_integer(e);
      if (!i) throw bad("stop_token_ids", concat("'stop_token_ids' must hold integers; it holds ", e.is_number() ? e.dump() : type_name(e)));
      const std::int64_t id = *i;
      if (id < 0 || id > std::numeric_limits<std::int32_t>::max())
        throw bad("stop_token_ids", concat("'stop_token_ids' holds ", id, ", not a token id"));
      p.stop_token_ids.push_back(static_cast<std::int32_t>(id));
    }
  }
  (void)boolean(body, "ignore_eos");  // dsp's byte models have no EOS token: only stop / stop_token_ids end a request
  r.stream = boolean(body, "stream").value_or(false);
  if (const nlohmann::json* o = field(body, "stream_options")) {
    if (!o->is_object()) throw bad("stream_options", concat("'stream_options' must be an object, got ", type_name(*o)));
    if (!r.stream) throw bad("stream_options", "'stream_options' is only allowed when 'stream' is true");
    r.include_usage = boolean(*o, "include_usage").value_or(false);
  }
  if (auto v = integer(body, "n")) r.n = *v;
  if (r.n < 1 || r.n > 128) throw bad("n", concat("'n' must be in [1, 128], got ", r.n));
  return p;
}

// Checks every SamplingParams range (naming the field, as SamplingParams::validate does) and
// that prompt + max_tokens fits the model.
inline void check_lengths(const ParsedRequest& r, const ServedModel& m, const char* prompt_field) {
  for (std::size_t i = 0; i < r.prompts.size(); ++i) {
    const auto len = static_cast<std::int64_t>(r.prompts[i].size());
    const std::int64_t max_tokens = r.params[i].max_tokens;
    if (max_tokens > m.max_model_len - len)  // (len + max_tokens could overflow)
      throw ApiError(400,
                     concat("This model's maximum context length is ", m.max_model_len, " tokens. However, you requested ",
                            max_tokens <= std::numeric_limits<std::int64_t>::max() - len ? concat(len + max_tokens) : concat("over ", m.max_model_len),
                            " tokens (", len, " in the prompt, ", max_tokens,
                            " for the completion). Please reduce the prompt or max_tokens."),
                     prompt_field, "context_length_exceeded");
  }
}

// prompts x n within what the server can queue.
inline void check_choices(const ParsedRequest& r, const ServedModel& m) {
  const auto total = static_cast<std::int64_t>(r.prompts.size()) * r.n;
  if (total > m.max_choices)
    throw bad("n", concat("the request asks for ", total, " completions (", r.prompts.size(), " prompts x n ", r.n,
                          "); this server takes at most ", m.max_choices, " at once (--max-queue)"));
}

inline void validated(const SamplingParams& p) {
  try {
    p.validate();
  } catch (const InputError& e) {  // "top_p must be in (0, 1], got 2": the field is its first word
    const std::string message = e.what();
    throw bad(message.substr(0, message.find(' ')), message);
  }
}

inline void check_model(const nlohmann::json& body, const ServedModel& m, ParsedRequest& r) {
  const nlohmann::json* v = field(body, "model");
  r.model = m.name;
  if (!v) return;  // as vLLM: the served model
  if (!v->is_string()) throw bad("model", concat("'model' must be a string, got ", type_name(*v)));
  if (v->get<std::string>() != m.name)
    throw ApiError(404, concat("The model '", v->get<std::string>(), "' does not exist (this server serves '", m.name, "')"),
                   "model", "model_not_found");
}

// A request of `kind` whose body is a JSON object naming this model (or none).
inline ParsedRequest begin(ParsedRequest::Kind kind, const nlohmann::json& body, const ServedModel& m) {
  if (!body.is_object()) throw ApiError(400, concat("the request body must be a JSON object, got ", type_name(body)));
  ParsedRequest r;
  r.kind = kind;
  check_model(body, m, r);
  return r;
}

}  // namespace detail

/// Reads a POST /v1/completions body. max_tokens defaults to 16 (OpenAI's default). Throws
/// ApiError (400, or 404 for another model's name) as the header says.
inline ParsedRequest parse_completion_request(const nlohmann::json& body, const ServedModel& m) {
  using namespace detail;
  ParsedRequest r = begin(ParsedRequest::Kind::Completion, body, m);
  r.prompts = completion_prompts(body, m.vocab_size);
  SamplingParams p = sampling(body, r);
  p.max_tokens = integer(body, "max_tokens").value_or(16);
  if (auto v = integer(body, "logprobs")) {
    if (*v < 0 || *v > 20) throw bad("logprobs", concat("'logprobs' must be in [0, 20], got ", *v));
    p.logprobs = *v;
  }
  refuse_unsupported(body, r.n);
  check_choices(r, m);
  validated(p);
  r.params.assign(r.prompts.size(), p);
  check_lengths(r, m, "prompt");
  return r;
}

/// Reads a POST /v1/chat/completions body: the messages become one prompt through
/// chat_prompt (chat_template.hpp). max_completion_tokens (or the older max_tokens) defaults
/// to what the model length leaves after the prompt (vLLM's default). Throws ApiError.
inline ParsedRequest parse_chat_request(const nlohmann::json& body, const ServedModel& m) {
  using namespace detail;
  ParsedRequest r = begin(ParsedRequest::Kind::Chat, body, m);
  r.prompts.push_back(text_ids(chat_prompt(chat_messages(body)), "messages", m.vocab_size));
  SamplingParams p = sampling(body, r);
  const auto prompt_len = static_cast<std::int64_t>(r.prompts[0].size());
  std::optional<std::int64_t> max_tokens = integer(body, "max_completion_tokens");
  const char* max_tokens_field = max_tokens ? "max_completion_tokens" : "max_tokens";
  if (!max_tokens) max_tokens = integer(body, "max_tokens");
  if (max_tokens && *max_tokens < 1)
    throw bad(max_tokens_field, concat(max_tokens_field, " must be >= 1, got ", *max_tokens));
  if (!max_tokens && prompt_len >= m.max_model_len)
    throw ApiError(400,
                   concat("This model's maximum context length is ", m.max_model_len, " tokens. However, your messages are ",
                          prompt_len, " tokens, which leaves no room for the completion."),
                   "messages", "context_length_exceeded");
  p.max_tokens = max_tokens.value_or(m.max_model_len - prompt_len);
  r.chat_logprobs = boolean(body, "logprobs").value_or(false);
  const auto top = integer(body, "top_logprobs");
  if (top && (*top < 0 || *top > 20)) throw bad("top_logprobs", concat("'top_logprobs' must be in [0, 20], got ", *top));
  if (top && !r.chat_logprobs) throw bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  if (r.chat_logprobs) p.logprobs = top.value_or(0);
  refuse_unsupported(body, r.n);
  check_choices(r, m);
  validated(p);
  r.params.push_back(p);
  check_lengths(r, m, "messages");
  return r;
}

}  // namespace dsp::serve::openai
