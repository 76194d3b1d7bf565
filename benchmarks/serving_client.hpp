#pragma once
// The parts of bench_serving (benchmarks/bench_serving.cpp), a load client for OpenAI-compatible
// HTTP servers (dsp-serve, llama-server, vLLM) with `vllm bench serve`'s definitions; here so
// that bench_serving_test.cpp can run them against a server in its own process.
//
// One request: a POST of {"model", "prompt" | "messages", "max_tokens", "temperature": 0,
// "stream": true, "stream_options": {"include_usage": true}} to 127.0.0.1, its server-sent
// events read as they arrive. A chunk *carries tokens* when choices[0].text (completions) or
// choices[0].delta.content (chat) is not empty, or choices[0].token_ids is a non-empty array;
// usage chunks, role-only and finish-only chunks carry none. (vllm counts every chunk with a
// non-empty `choices` list, the empty ones too.) Per request:
//   TTFT     send -> the first chunk carrying tokens
//   ITL      the gaps between consecutive chunks carrying tokens (one per chunk after the first)
//   E2E      send -> the last chunk carrying tokens (vllm's `latency`; [DONE] comes after it)
//   output tokens  usage.completion_tokens when the server reports it, else the chunks
//                  carrying tokens
//   TPOT     (E2E - TTFT) / (output tokens - 1), for requests of more than one output token
// A request succeeds when its answer is 200 with Content-Type text/event-stream, every event
// is JSON without an "error" member, and the stream ends with `data: [DONE]`.
// Over the run (vllm's calculate_metrics; only the successful valid requests enter):
//   duration          first send -> last answer finished, s
//   request throughput       successful requests / duration
//   output token throughput  sum of output tokens / duration
//   total token throughput   (sum of prompt tokens + sum of output tokens) / duration; prompt
//                            tokens: usage.prompt_tokens, else the prompt's bytes (token ids)
//   peak output token throughput  the most chunks carrying tokens in one 1-s bucket from the
//                            first successful request's send (vllm's: a chunk counts as a token)
//   peak concurrent requests the most requests in flight at one instant, any kind (vllm counts
//                            the requests active within a 1-s bucket instead)
//   mean, median, std (population, numpy's ddof=0) and percentiles of TTFT, TPOT, ITL, E2E;
//   percentiles are numpy.percentile's default (linear interpolation between closest ranks).
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/core/error.hpp"

namespace bench_serving {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

// --- statistics ------------------------------------------------------------------------------

/// The p-th percentile (0 <= p <= 100) of `values` as numpy.percentile computes it by default
/// (method "linear", vllm's): of the n sorted values v, at position h = (n - 1) p / 100,
/// v[floor h] + (h - floor h) (v[floor h + 1] - v[floor h]). 0 for no values (as vllm's `or 0`).
inline double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double h = static_cast<double>(values.size() - 1) * p / 100.0;
  const auto lo = static_cast<std::size_t>(std::floor(h));
  const std::size_t hi = std::min(lo + 1, values.size() - 1);
  return values[lo] + (h - static_cast<double>(lo)) * (values[hi] - values[lo]);
}

/// The mean; 0 for no values.
inline double mean_of(const std::vector<double>& values) {
  if (values.empty()) return 0;
  double sum = 0;
  for (double v : values) sum += v;
  return sum / static_cast<double>(values.size());
}

/// The population standard deviation (numpy.std's default, ddof = 0); 0 for no values.
inline double std_of(const std::vector<double>& values) {
  if (values.empty()) return 0;
  const double m = mean_of(values);
  double sum = 0;
  for (double v : values) sum += (v - m) * (v - m);
  return std::sqrt(sum / static_cast<double>(values.size()));
}

// --- server-sent events ----------------------------------------------------------------------

/// An incremental parser of a text/event-stream body (WHATWG's rules, the fields other than
/// `data` ignored): feed() the bytes as they arrive, in pieces of any size; each event (its
/// `data:` lines joined by '\n', one space after the colon dropped) is handed to the callback
/// when the blank line that ends it arrives. Lines end in "\n" or "\r\n"; lines starting with
/// ':' are comments. finish() hands over an event the stream ended in without its blank line
/// (the standard drops it; servers that omit the last blank line are common enough).
class SseParser {
 public:
  /// Parses `bytes`; calls on_event(std::string_view data) per completed event and stops early
  /// (returning false) when on_event returns false.
  template <class OnEvent>
  bool feed(std::string_view bytes, OnEvent&& on_event) {
    while (!bytes.empty()) {
      const std::size_t nl = bytes.find('\n');
      if (nl == std::string_view::npos) {
        line_.append(bytes);
        return true;
      }
      line_.append(bytes.substr(0, nl));
      bytes.remove_prefix(nl + 1);
      if (!end_line(on_event)) return false;
    }
    return true;
  }

  /// At the end of the stream: an unterminated last line and an event without its blank line
  /// are delivered. Returns on_event's result (true when nothing was pending).
  template <class OnEvent>
  bool finish(OnEvent&& on_event) {
    if (!line_.empty() && !end_line(on_event)) return false;
    if (!has_data_) return true;
    has_data_ = false;
    return on_event(std::string_view(data_));
  }

 private:
  template <class OnEvent>
  bool end_line(OnEvent& on_event) {
    if (!line_.empty() && line_.back() == '\r') line_.pop_back();
    bool go_on = true;
    if (line_.empty()) {
      if (has_data_) go_on = on_event(std::string_view(data_));
      data_.clear();
      has_data_ = false;
    } else if (line_[0] != ':') {
      const std::size_t colon = line_.find(':');
      const std::string_view field = std::string_view(line_).substr(0, colon);
      if (field == "data") {
        std::string_view value = colon == std::string::npos ? std::string_view() : std::string_view(line_).substr(colon + 1);
        if (!value.empty() && value[0] == ' ') value.remove_prefix(1);
        if (has_data_) data_.push_back('\n');
        data_.append(value);
        has_data_ = true;
      }
    }
    line_.clear();
    return go_on;
  }

  std::string line_;
  std::string data_;
  bool has_data_ = false;
};

// --- the server ------------------------------------------------------------------------------

/// Where the requests go: a loopback address only (127.0.0.0/8, localhost, ::1).
struct Target {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string base_path;  ///< a path prefix of --base-url ("" or "/prefix"), put before the endpoint
  std::string api_key;    ///< sent as "Authorization: Bearer <key>" when not empty
};

/// True for the loopback names and addresses this client may send to.
inline bool is_loopback(const std::string& host) {
  if (host == "localhost" || host == "::1") return true;
  unsigned a = 0, b = 0, c = 0, d = 0;
  char tail = 0;
  return std::sscanf(host.c_str(), "%u.%u.%u.%u%c", &a, &b, &c, &d, &tail) == 4 && a == 127 && b < 256 && c < 256 && d < 256;
}

/// Throws dsp::InputError unless `target` is on the loopback interface.
inline void check_loopback(const Target& target) {
  DSP_CHECK_AS(dsp::InputError, is_loopback(target.host), "host '", target.host,
               "' is not a loopback address: this client sends to 127.0.0.1 (localhost, ::1) only");
  DSP_CHECK_AS(dsp::InputError, target.port > 0 && target.port < 65536, "port ", target.port, " is not in 1..65535");
}

/// The target of a base URL "http://HOST:PORT[/prefix]" (IPv6 as "[::1]"; port 80 when none).
/// Throws dsp::InputError for another scheme, a malformed URL or a host off the loopback.
inline Target parse_base_url(const std::string& url) {
  const std::string scheme = "http://";
  DSP_CHECK_AS(dsp::InputError, url.starts_with(scheme), "--base-url '", url,
               "' must start with http:// (this client speaks plain HTTP to a local server)");
  std::string rest = url.substr(scheme.size());
  Target t;
  const std::size_t slash = rest.find('/');
  if (slash != std::string::npos) {
    t.base_path = rest.substr(slash);
    rest = rest.substr(0, slash);
    while (!t.base_path.empty() && t.base_path.back() == '/') t.base_path.pop_back();
  }
  std::string port;
  if (rest.starts_with("[")) {  // [::1]:8000
    const std::size_t close = rest.find(']');
    DSP_CHECK_AS(dsp::InputError, close != std::string::npos, "--base-url '", url, "': unclosed '['");
    t.host = rest.substr(1, close - 1);
    if (close + 1 < rest.size()) {
      DSP_CHECK_AS(dsp::InputError, rest[close + 1] == ':', "--base-url '", url, "': expected ':' after ']'");
      port = rest.substr(close + 2);
    }
  } else {
    const std::size_t colon = rest.find(':');
    t.host = rest.substr(0, colon);
    if (colon != std::string::npos) port = rest.substr(colon + 1);
  }
  t.port = 80;
  if (!port.empty()) {
    DSP_CHECK_AS(dsp::InputError, port.find_first_not_of("0123456789") == std::string::npos && port.size() <= 5,
                 "--base-url '", url, "': port '", port, "' is not a number");
    t.port = std::stoi(port);
  }
  check_loopback(t);
  return t;
}

/// A client for one request: a new connection (Connection: close), no Nagle delay.
inline httplib::Client make_client(const Target& target, double timeout_s) {
  httplib::Client cli(target.host, target.port);
  const auto timeout = std::chrono::duration<double>(timeout_s);
  cli.set_connection_timeout(std::chrono::duration_cast<std::chrono::microseconds>(std::min(timeout, std::chrono::duration<double>(10))));
  cli.set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  cli.set_write_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  cli.set_tcp_nodelay(true);
  cli.set_keep_alive(false);
  if (!target.api_key.empty()) cli.set_bearer_token_auth(target.api_key);
  return cli;
}

/// GET base_path + path; the parsed JSON body of a 200 answer, or null (no server, another
/// status, not JSON).
inline Json get_json(const Target& target, const std::string& path, double timeout_s = 10) {
  httplib::Client cli = make_client(target, timeout_s);
  const httplib::Result res = cli.Get(target.base_path + path);
  if (!res || res->status != 200) return nullptr;
  return Json::parse(res->body, nullptr, /*allow_exceptions=*/false);
}

/// The first model /v1/models lists (data[0].id), or "" when the server lists none.
inline std::string discover_model(const Target& target) {
  const Json j = get_json(target, "/v1/models");
  if (j.is_object() && j.contains("data") && j["data"].is_array() && !j["data"].empty() && j["data"][0].is_object() &&
      j["data"][0].contains("id") && j["data"][0]["id"].is_string())
    return j["data"][0]["id"].get<std::string>();
  return "";
}

/// data[0].max_model_len of /v1/models (vLLM and dsp-serve report it), or 0 when absent.
inline std::int64_t discover_max_model_len(const Target& target) {
  const Json j = get_json(target, "/v1/models");
  if (j.is_object() && j.contains("data") && j["data"].is_array() && !j["data"].empty() && j["data"][0].is_object() &&
      j["data"][0].contains("max_model_len") && j["data"][0]["max_model_len"].is_number_integer())
    return j["data"][0]["max_model_len"].get<std::int64_t>();
  return 0;
}

/// True when `body` is OpenAI's error JSON: {"error": {"message": string, "type": string,
/// "param": any, "code": any}} (all four members present); else false with the reason in *why.
inline bool is_openai_error(const std::string& body, std::string* why) {
  const Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  const char* reason = nullptr;
  if (j.is_discarded())
    reason = "the body is not JSON";
  else if (!j.is_object() || !j.contains("error") || !j["error"].is_object())
    reason = "no \"error\" object";
  else if (!j["error"].contains("message") || !j["error"]["message"].is_string())
    reason = "error.message missing or not a string";
  else if (!j["error"].contains("type") || !j["error"]["type"].is_string())
    reason = "error.type missing or not a string";
  else if (!j["error"].contains("param") || !j["error"].contains("code"))
    reason = "error.param or error.code missing";
  if (reason != nullptr && why != nullptr) *why = reason;
  return reason == nullptr;
}

/// The value of `name` in Prometheus text exposition `text`: with labels in `name`
/// ('m{rank="0"}'), that series' value; without, the sum over every series of metric `name`
/// (`m 3` and `m{rank="1"} 2` give 5). Empty when no series matches or a value does not parse.
inline std::optional<double> metric_value(const std::string& text, const std::string& name) {
  const bool exact = name.find('{') != std::string::npos;
  std::optional<double> sum;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    // "series value [timestamp]": the series ends at the first space after its labels
    const std::size_t brace = line.find('{');
    const std::size_t close = brace == std::string::npos ? std::string::npos : line.find('}', brace);
    const std::size_t end = line.find(' ', close == std::string::npos ? 0 : close);
    if (end == std::string::npos) continue;
    const std::string series = line.substr(0, end);
    const std::string metric = series.substr(0, std::min(series.size(), series.find('{')));
    if (exact ? series != name : metric != name) continue;
    std::istringstream value(line.substr(end + 1));
    double v = 0;
    if (!(value >> v)) return std::nullopt;
    sum = sum.value_or(0) + v;
  }
  return sum;
}

/// One --expect-metric NAME=VALUE and what /metrics said.
struct MetricExpectation {
  std::string name;
  double expected = 0;
  std::optional<double> seen;  ///< the last value read; empty when the metric was not found
  bool met() const { return seen && *seen == expected; }
};

/// Reads GET /metrics until every expectation holds, every 0.2 s for at most timeout_s (a
/// server frees the blocks of a cancelled request at its next step, not at once); fills in
/// the values last seen. True when all hold.
inline bool wait_for_metrics(const Target& target, std::vector<MetricExpectation>& expectations, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  for (;;) {
    httplib::Client cli = make_client(target, 10);
    const httplib::Result res = cli.Get(target.base_path + "/metrics");
    bool all = true;
    for (MetricExpectation& e : expectations) {
      e.seen = res && res->status == 200 ? metric_value(res->body, e.name) : std::nullopt;
      all = all && e.met();
    }
    if (all || Clock::now() >= deadline) return all;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

// --- one request -----------------------------------------------------------------------------

/// What one request got back and when (times in seconds).
struct RequestResult {
  int status = 0;             ///< HTTP status; 0 when no answer came
  bool success = false;       ///< see the file's header
  bool disconnected = false;  ///< this client closed the connection after its planned chunks
  bool timed_out = false;     ///< --request-timeout passed
  bool got_done = false;      ///< the stream carried data: [DONE]
  std::string error;          ///< why it failed; empty on success
  std::string body;           ///< the body of an answer that is not 200 (at most 64 KiB kept)
  double start = 0;           ///< sent at this time after the benchmark's start
  double ttft = 0;
  double latency = 0;         ///< E2E
  double elapsed = 0;         ///< send -> the answer's end, or the failure, whatever happened
  std::vector<double> itl;
  std::int64_t token_chunks = 0;
  std::int64_t prompt_tokens = -1;      ///< usage.prompt_tokens; -1 when not reported
  std::int64_t completion_tokens = -1;  ///< usage.completion_tokens; -1 when not reported
  std::string text;                     ///< the generated text
  std::string finish_reason;

  std::int64_t output_tokens() const { return completion_tokens >= 0 ? completion_tokens : token_chunks; }
};

/// How to send one request.
struct RequestSpec {
  std::string path;           ///< the endpoint, e.g. /v1/completions
  std::string body;           ///< sent as is (malformed bodies included)
  bool chat = false;          ///< read choices[0].delta.content instead of choices[0].text
  int disconnect_after = 0;   ///< > 0: close the connection after this many chunks carrying tokens
  double timeout_s = 300;     ///< the whole request, and any silence of the server, at most
};

/// Sends one request and reads its answer as it streams (see the file's header for what is
/// measured). Never throws for what the server does; the result says what went wrong.
/// `origin` is the benchmark's start, for RequestResult::start.
inline RequestResult send_request(const Target& target, const RequestSpec& spec, Clock::time_point origin) {
  RequestResult r;
  httplib::Client cli = make_client(target, spec.timeout_s);
  httplib::Request req;
  req.method = "POST";
  req.path = target.base_path + spec.path;
  req.headers = {{"Content-Type", "application/json"}, {"Accept", "text/event-stream"}};
  req.body = spec.body;

  SseParser parser;
  bool event_stream = false;
  double last = 0;
  std::string stream_error;  // an event that made the stream fail
  const auto sent = Clock::now();
  const auto deadline = sent + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(spec.timeout_s));
  const auto seconds_since = [&](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  r.start = std::chrono::duration<double>(sent - origin).count();

  // One event; false stops reading (a planned disconnect, an error event, an event after [DONE]
  // is ignored).
  const auto on_event = [&](std::string_view data) -> bool {
    if (r.got_done) return true;
    if (data == "[DONE]") {
      r.got_done = true;
      return true;
    }
    const Json j = Json::parse(data, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) {
      stream_error = "an event is not a JSON object: " + std::string(data.substr(0, 200));
      return false;
    }
    if (j.contains("error")) {
      stream_error = "error event: " + j["error"].dump().substr(0, 500);
      return false;
    }
    if (j.contains("usage") && j["usage"].is_object()) {
      const Json& u = j["usage"];
      if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer()) r.prompt_tokens = u["prompt_tokens"].get<std::int64_t>();
      if (u.contains("completion_tokens") && u["completion_tokens"].is_number_integer())
        r.completion_tokens = u["completion_tokens"].get<std::int64_t>();
    }
    if (!j.contains("choices") || !j["choices"].is_array() || j["choices"].empty() || !j["choices"][0].is_object()) return true;
    const Json& c = j["choices"][0];
    std::string piece;
    const Json* text = nullptr;
    if (spec.chat) {
      if (c.contains("delta") && c["delta"].is_object() && c["delta"].contains("content")) text = &c["delta"]["content"];
    } else if (c.contains("text")) {
      text = &c["text"];
    }
    if (text != nullptr && text->is_string()) piece = text->get<std::string>();
    if (c.contains("finish_reason") && c["finish_reason"].is_string()) r.finish_reason = c["finish_reason"].get<std::string>();
    const bool has_ids = c.contains("token_ids") && c["token_ids"].is_array() && !c["token_ids"].empty();
    if (piece.empty() && !has_ids) return true;
    const double t = seconds_since(sent);
    if (r.token_chunks == 0)
      r.ttft = t;
    else
      r.itl.push_back(t - last);
    last = t;
    r.latency = t;
    ++r.token_chunks;
    r.text += piece;
    if (spec.disconnect_after > 0 && r.token_chunks >= spec.disconnect_after) {
      r.disconnected = true;
      return false;
    }
    return true;
  };

  req.response_handler = [&](const httplib::Response& res) {
    r.status = res.status;
    event_stream = res.get_header_value("Content-Type").starts_with("text/event-stream");
    return true;
  };
  req.content_receiver = [&](const char* data, std::size_t n, std::uint64_t, std::uint64_t) {
    if (Clock::now() > deadline) {
      r.timed_out = true;
      return false;
    }
    if (r.status != 200 || !event_stream) {
      if (r.body.size() < 65536) r.body.append(data, std::min<std::size_t>(n, 65536 - r.body.size()));
      return true;
    }
    return parser.feed(std::string_view(data, n), on_event);
  };

  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent_ok = cli.send(req, res, err);
  if (sent_ok && r.status == 200 && event_stream && !r.disconnected && stream_error.empty()) parser.finish(on_event);
  if (r.status == 0) r.status = res.status > 0 ? res.status : 0;
  r.elapsed = seconds_since(sent);

  if (r.disconnected) {
    r.error = "disconnected by the client (planned)";
  } else if (r.timed_out || (err == httplib::Error::Read && seconds_since(sent) >= spec.timeout_s * 0.99)) {
    r.timed_out = true;
    r.error = "timed out after " + std::to_string(spec.timeout_s) + " s";
  } else if (!stream_error.empty()) {
    r.error = stream_error;
  } else if (!sent_ok && r.status == 0) {
    r.error = "no answer: " + httplib::to_string(err);
  } else if (r.status != 200) {
    r.error = "HTTP " + std::to_string(r.status) + ": " + r.body.substr(0, 300);
  } else if (!event_stream) {
    r.error = "HTTP 200 without Content-Type text/event-stream: " + r.body.substr(0, 300);
  } else if (!sent_ok) {
    r.error = "the stream broke off: " + httplib::to_string(err);
  } else if (!r.got_done) {
    r.error = "the stream ended without data: [DONE]";
  } else {
    r.success = true;
  }
  return r;
}

// --- prompts ---------------------------------------------------------------------------------

/// One prompt of the pool and the output length asked for it.
struct Prompt {
  std::string text;  ///< valid UTF-8; its bytes are the token ids with --prompt-token-ids
  std::int64_t output_len = 0;
};

/// Where prompts come from (`vllm bench serve`'s random dataset, or text cut from a corpus).
struct DatasetConfig {
  std::string name = "random";  ///< random | corpus
  std::string path;             ///< corpus: a UTF-8 text file (data/tinyshakespeare.txt)
  std::int64_t input_len = 1024;
  std::int64_t output_len = 128;
  double range_ratio = 0;       ///< lengths uniform in [floor(L(1-r)), ceil(L(1+r))], 0 <= r < 1
  std::uint64_t seed = 0;
};

/// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
inline bool is_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t n = 0;
    std::uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    }
    if (c >= 0xC2 && c <= 0xDF) n = 1, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF) n = 2, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4) n = 3, cp = c & 0x07;
    else return false;
    if (i + n >= s.size()) return false;  // truncated
    for (std::size_t k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (n == 3 && (cp < 0x10000 || cp > 0x10FFFF))) return false;
    i += n + 1;
  }
  return true;
}

/// `count` prompts: input lengths (bytes) and output lengths drawn uniformly from
/// [floor(L(1 - r)), ceil(L(1 + r))] (vllm's RandomDataset; input at least 1, output at least 1),
/// then the text: random printable ASCII (bytes 32..126) for "random", a cut of the corpus at
/// a uniformly random offset for "corpus" (moved to UTF-8 character boundaries, so it may be up
/// to 3 bytes shorter). The same config gives the same prompts. Throws dsp::InputError for an
/// unknown dataset, bad lengths, or a corpus that cannot be read, is not UTF-8 or is shorter
/// than a prompt.
inline std::vector<Prompt> make_prompts(const DatasetConfig& c, std::size_t count) {
  DSP_CHECK_AS(dsp::InputError, c.name == "random" || c.name == "corpus", "--dataset-name must be random or corpus, got '", c.name, "'");
  DSP_CHECK_AS(dsp::InputError, c.range_ratio >= 0 && c.range_ratio < 1, "--random-range-ratio must be in [0, 1), got ", c.range_ratio);
  DSP_CHECK_AS(dsp::InputError, c.input_len >= 1, "--random-input-len must be >= 1, got ", c.input_len);
  DSP_CHECK_AS(dsp::InputError, c.output_len >= 1, "--random-output-len must be >= 1, got ", c.output_len);
  std::string corpus;
  if (c.name == "corpus") {
    DSP_CHECK_AS(dsp::InputError, !c.path.empty(), "--dataset-name corpus needs --dataset-path FILE");
    std::ifstream in(c.path, std::ios::binary);
    DSP_CHECK_AS(dsp::InputError, in.good(), "--dataset-path '", c.path, "' cannot be opened");
    std::ostringstream ss;
    ss << in.rdbuf();
    corpus = ss.str();
    DSP_CHECK_AS(dsp::InputError, is_utf8(corpus), "--dataset-path '", c.path, "' is not UTF-8 text");
  }
  const auto low = [&](std::int64_t len) { return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::floor(len * (1 - c.range_ratio)))); };
  const auto high = [&](std::int64_t len) { return static_cast<std::int64_t>(std::ceil(len * (1 + c.range_ratio))); };
  std::mt19937_64 rng(c.seed);
  std::uniform_int_distribution<std::int64_t> in_len(low(c.input_len), high(c.input_len));
  std::uniform_int_distribution<std::int64_t> out_len(low(c.output_len), high(c.output_len));
  std::vector<Prompt> prompts(count);
  std::vector<std::int64_t> input_lens(count);
  for (std::size_t i = 0; i < count; ++i) input_lens[i] = in_len(rng);
  for (std::size_t i = 0; i < count; ++i) prompts[i].output_len = out_len(rng);
  std::uniform_int_distribution<int> printable(32, 126);
  for (std::size_t i = 0; i < count; ++i) {
    const auto len = static_cast<std::size_t>(input_lens[i]);
    std::string& text = prompts[i].text;
    if (c.name == "random") {
      text.resize(len);
      for (char& ch : text) ch = static_cast<char>(printable(rng));
      continue;
    }
    DSP_CHECK_AS(dsp::InputError, corpus.size() >= len, "--dataset-path '", c.path, "' holds ", corpus.size(),
                 " bytes, fewer than a prompt of ", len);
    std::uniform_int_distribution<std::size_t> offset(0, corpus.size() - len);
    std::size_t begin = offset(rng), end = begin + len;
    const auto continuation = [&](std::size_t k) { return k < corpus.size() && (static_cast<unsigned char>(corpus[k]) & 0xC0) == 0x80; };
    while (begin < end && continuation(begin)) ++begin;
    while (end > begin && continuation(end)) --end;
    text = corpus.substr(begin, end - begin);
    if (text.empty()) text = " ";  // a cut inside one long character: never an empty prompt
  }
  return prompts;
}

// --- the plan of a run -----------------------------------------------------------------------

/// What a request of the run is.
enum class RequestKind { Valid, Malformed, Disconnect };
/// The malformed requests, sent in this order, cycling: each should get a 4xx with error JSON.
enum class MalformedKind { NotJson, WrongType, OverLength, UnknownModel, EmptyPrompt };

inline const char* kind_name(RequestKind k) {
  switch (k) {
    case RequestKind::Valid: return "valid";
    case RequestKind::Malformed: return "malformed";
    case RequestKind::Disconnect: return "disconnect";
  }
  return "?";
}
inline const char* malformed_name(MalformedKind k) {
  switch (k) {
    case MalformedKind::NotJson: return "not_json";
    case MalformedKind::WrongType: return "wrong_type";
    case MalformedKind::OverLength: return "over_length";
    case MalformedKind::UnknownModel: return "unknown_model";
    case MalformedKind::EmptyPrompt: return "empty_prompt";
  }
  return "?";
}

/// One request of the run.
struct PlannedRequest {
  RequestKind kind = RequestKind::Valid;
  std::size_t prompt = 0;  ///< index into the prompt pool
  MalformedKind malformed = MalformedKind::NotJson;
  int disconnect_after = 0;  ///< Disconnect: chunks carrying tokens read before closing (1..3)
  double arrival = 0;        ///< s after the start at which it may be sent (when a slot is free)
};

/// How a run is made and sent.
struct Options {
  Target target;
  std::string endpoint = "/v1/completions";
  std::string model;
  std::size_t num_prompts = 1000;
  std::size_t num_distinct_prompts = 0;  ///< prompt pool size; 0: one prompt per request
  double request_rate = std::numeric_limits<double>::infinity();
  double burstiness = 1;  ///< gamma shape of the inter-arrival times (1: Poisson)
  int max_concurrency = 0;  ///< 0: no limit but this client's (kMaxThreads)
  std::uint64_t seed = 0;
  bool prompt_token_ids = false;
  bool ignore_eos = false;
  double request_timeout_s = 300;
  double malformed_fraction = 0;
  double disconnect_fraction = 0;
  std::int64_t max_model_len = 0;  ///< for the over-length malformed requests; 0: that kind left out
  bool chat() const { return endpoint.find("chat/completions") != std::string::npos; }
};

/// The most requests in flight at once (one thread each) when --max-concurrency is not given.
inline constexpr int kMaxThreads = 1024;

/// The requests of a run: request i uses prompt i mod pool size; a seeded shuffle picks
/// round(F N) of them as malformed and round(F' N) as disconnecting (kinds and 1..3 chunks
/// cycling); arrival times are 0 for an infinite rate, else cumulative gamma(shape b,
/// scale 1/(rate b)) gaps (Poisson for b = 1; vllm's), the first request at 0.
inline std::vector<PlannedRequest> plan_requests(const Options& o, std::size_t pool) {
  DSP_CHECK_AS(dsp::InputError, o.malformed_fraction >= 0 && o.disconnect_fraction >= 0 &&
                                    o.malformed_fraction + o.disconnect_fraction <= 1,
               "--malformed-fraction and --disconnect-fraction must be >= 0 and sum to at most 1, got ",
               o.malformed_fraction, " and ", o.disconnect_fraction);
  DSP_CHECK_AS(dsp::InputError, pool >= 1, "the prompt pool is empty");
  const std::size_t n = o.num_prompts;
  std::vector<PlannedRequest> plan(n);
  for (std::size_t i = 0; i < n; ++i) plan[i].prompt = i % pool;
  std::mt19937_64 rng(o.seed ^ 0x9E3779B97F4A7C15ull);
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  const auto malformed = static_cast<std::size_t>(std::llround(o.malformed_fraction * static_cast<double>(n)));
  const auto disconnect = std::min(n - malformed, static_cast<std::size_t>(std::llround(o.disconnect_fraction * static_cast<double>(n))));
  std::vector<MalformedKind> kinds = {MalformedKind::NotJson, MalformedKind::WrongType, MalformedKind::OverLength,
                                      MalformedKind::UnknownModel, MalformedKind::EmptyPrompt};
  if (o.max_model_len <= 0) std::erase(kinds, MalformedKind::OverLength);
  std::vector<std::size_t> picked(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(malformed + disconnect));
  // kinds cycle in the order of sending, not of the shuffle
  std::vector<std::size_t> bad(picked.begin(), picked.begin() + static_cast<std::ptrdiff_t>(malformed));
  std::vector<std::size_t> cut(picked.begin() + static_cast<std::ptrdiff_t>(malformed), picked.end());
  std::sort(bad.begin(), bad.end());
  std::sort(cut.begin(), cut.end());
  for (std::size_t k = 0; k < bad.size(); ++k) {
    plan[bad[k]].kind = RequestKind::Malformed;
    plan[bad[k]].malformed = kinds[k % kinds.size()];
  }
  for (std::size_t k = 0; k < cut.size(); ++k) {
    plan[cut[k]].kind = RequestKind::Disconnect;
    plan[cut[k]].disconnect_after = static_cast<int>(k % 3) + 1;
  }
  if (std::isfinite(o.request_rate)) {
    DSP_CHECK_AS(dsp::InputError, o.request_rate > 0, "--request-rate must be > 0 or inf, got ", o.request_rate);
    DSP_CHECK_AS(dsp::InputError, o.burstiness > 0, "--burstiness must be > 0, got ", o.burstiness);
    std::gamma_distribution<double> gap(o.burstiness, 1.0 / (o.request_rate * o.burstiness));
    double t = 0;
    for (std::size_t i = 0; i < n; ++i) {
      plan[i].arrival = t;
      t += gap(rng);
    }
  }
  return plan;
}

/// The body of a valid request for `p`: {"model", "prompt": text | [byte ids] (completions) or
/// "messages": [{"role": "user", "content": text}] (chat), "max_tokens", "temperature": 0,
/// "stream": true, "stream_options": {"include_usage": true}[, "ignore_eos": true]}.
inline Json valid_body(const Options& o, const Prompt& p) {
  Json body = {{"model", o.model}, {"max_tokens", p.output_len}, {"temperature", 0.0}, {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  if (o.chat()) {
    body["messages"] = Json::array({{{"role", "user"}, {"content", p.text}}});
  } else if (o.prompt_token_ids) {
    Json ids = Json::array();
    for (char ch : p.text) ids.push_back(static_cast<int>(static_cast<unsigned char>(ch)));
    body["prompt"] = std::move(ids);
  } else {
    body["prompt"] = p.text;
  }
  if (o.ignore_eos) body["ignore_eos"] = true;
  return body;
}

/// The body of a malformed request of kind `k` made from `p`:
///   NotJson       the valid body cut in half
///   WrongType     "max_tokens": "ten"
///   OverLength    a prompt of max_model_len bytes (`p` repeated) and max_tokens = max_model_len:
///                 over max_model_len whatever the tokenizer (a non-empty prompt is >= 1 token)
///   UnknownModel  "model": "no-such-model"
///   EmptyPrompt   "prompt": "" ([] with token ids); chat: "messages": [] (an empty message is
///                 valid: the chat template still makes a prompt of it)
inline std::string malformed_body(const Options& o, const Prompt& p, MalformedKind k) {
  Json body = valid_body(o, p);
  const auto set_prompt = [&](const std::string& text) {
    Prompt q{text, p.output_len};
    const Json b = valid_body(o, q);
    if (o.chat())
      body["messages"] = b["messages"];
    else
      body["prompt"] = b["prompt"];
  };
  switch (k) {
    case MalformedKind::NotJson: {
      const std::string s = body.dump();
      return s.substr(0, s.size() / 2);
    }
    case MalformedKind::WrongType: body["max_tokens"] = "ten"; break;
    case MalformedKind::OverLength: {
      std::string text;
      const auto len = static_cast<std::size_t>(std::max<std::int64_t>(1, o.max_model_len));
      while (text.size() < len) text += p.text.empty() ? std::string("a") : p.text;
      std::size_t end = len;  // no character cut in two: end on a boundary, pad with 'a'
      while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
      text.resize(end);
      text.resize(len, 'a');
      set_prompt(text);
      body["max_tokens"] = o.max_model_len;
      break;
    }
    case MalformedKind::UnknownModel: body["model"] = "no-such-model"; break;
    case MalformedKind::EmptyPrompt:
      if (o.chat())
        body["messages"] = Json::array();
      else
        set_prompt("");
      break;
  }
  return body.dump();
}

// --- the run ---------------------------------------------------------------------------------

/// A run's requests and what each got.
struct Run {
  Options options;
  std::vector<Prompt> prompts;
  std::vector<PlannedRequest> plan;
  std::vector<RequestResult> results;  ///< one per planned request
  double duration = 0;                 ///< s, first send -> last answer
  int peak_concurrency = 0;            ///< most requests in flight at once
};

/// Sends every planned request: W threads (W = --max-concurrency, else min(N, kMaxThreads)),
/// each taking the next request in order, waiting for its arrival time, sending it and reading
/// the whole answer; so a request goes out at its arrival time or when a slot frees, whichever
/// is later (vllm's semaphore). Blocks until all are answered (each within its timeout).
inline Run run_requests(const Options& o, std::vector<Prompt> prompts, std::vector<PlannedRequest> plan) {
  Run run{o, std::move(prompts), std::move(plan), {}, 0, 0};
  const std::size_t n = run.plan.size();
  run.results.resize(n);
  std::vector<RequestSpec> specs(n);
  for (std::size_t i = 0; i < n; ++i) {
    const PlannedRequest& q = run.plan[i];
    const Prompt& p = run.prompts.at(q.prompt);
    specs[i].path = o.endpoint;
    specs[i].chat = o.chat();
    specs[i].timeout_s = o.request_timeout_s;
    specs[i].body = q.kind == RequestKind::Malformed ? malformed_body(o, p, q.malformed) : valid_body(o, p).dump();
    specs[i].disconnect_after = q.kind == RequestKind::Disconnect ? q.disconnect_after : 0;
  }
  const std::size_t workers = std::min<std::size_t>(n, o.max_concurrency > 0 ? static_cast<std::size_t>(o.max_concurrency) : kMaxThreads);
  std::atomic<std::size_t> next{0};
  std::atomic<int> in_flight{0}, peak{0};
  const auto start = Clock::now();
  {
    std::vector<std::jthread> threads;
    threads.reserve(workers);
    for (std::size_t w = 0; w < workers; ++w)
      threads.emplace_back([&] {
        for (std::size_t i = next++; i < n; i = next++) {
          std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(run.plan[i].arrival)));
          const int now = ++in_flight;
          for (int seen = peak.load(); now > seen && !peak.compare_exchange_weak(seen, now);) {
          }
          run.results[i] = send_request(o.target, specs[i], start);
          --in_flight;
        }
      });
  }
  run.duration = std::chrono::duration<double>(Clock::now() - start).count();
  run.peak_concurrency = peak.load();
  return run;
}

// --- what a run measured ---------------------------------------------------------------------

/// The reference output of a prompt (--write-outputs / --expected-outputs).
struct Reference {
  std::int64_t max_tokens = 0;
  std::string text;
};
using References = std::map<std::string, Reference>;  ///< by prompt text

/// The mean, median, std and asked percentiles of one latency, in ms.
struct Distribution {
  double mean = 0, median = 0, std = 0;
  std::vector<std::pair<double, double>> percentiles;  ///< (p, value)
};

inline Distribution distribution_ms(const std::vector<double>& seconds, const std::vector<double>& ps) {
  std::vector<double> ms(seconds.size());
  for (std::size_t i = 0; i < seconds.size(); ++i) ms[i] = seconds[i] * 1000;
  Distribution d{mean_of(ms), percentile(ms, 50), std_of(ms), {}};
  for (double p : ps) d.percentiles.emplace_back(p, percentile(ms, p));
  return d;
}

/// Everything a run's summary and JSON report.
struct Summary {
  std::size_t completed = 0, failed = 0;  ///< valid requests (disconnecting ones apart)
  std::int64_t total_input = 0, total_output = 0;
  double request_throughput = 0, output_throughput = 0, total_token_throughput = 0, peak_output_throughput = 0;
  Distribution ttft, tpot, itl, e2el;
  // load test
  std::size_t malformed_sent = 0, malformed_ok = 0, malformed_other = 0;
  std::map<std::string, std::map<int, std::size_t>> malformed_statuses;  ///< kind -> status -> count
  std::size_t disconnect_sent = 0, disconnect_done = 0, disconnect_finished_first = 0, disconnect_failed = 0;
  // outputs
  std::size_t outputs_checked = 0, output_mismatches = 0, outputs_unchecked = 0, repeat_mismatches = 0;
  bool reference_given = false;
  std::vector<std::string> problems;  ///< the first few failures, one line each

  /// No valid request failed, every malformed one got a 4xx with error JSON, no disconnecting
  /// request failed before its disconnect, and no output differed from the reference, from an
  /// earlier answer to the same prompt, or lacked a reference when one was given.
  bool passed() const {
    return failed == 0 && malformed_other == 0 && disconnect_failed == 0 && output_mismatches == 0 && repeat_mismatches == 0 &&
           outputs_unchecked == 0;
  }
};

/// The first byte at which a and b differ (their common length when one is a prefix).
inline std::size_t first_difference(const std::string& a, const std::string& b) {
  std::size_t k = 0;
  while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
  return k;
}

/// A prompt or text shortened for a one-line message, with C escapes.
inline std::string excerpt(const std::string& s, std::size_t from = 0, std::size_t max = 40) {
  std::string out;
  const std::size_t end = std::min(s.size(), from + max);
  for (std::size_t k = from; k < end; ++k) {
    const char c = s[k];
    if (c == '\n') out += "\\n";
    else if (c == '"') out += "\\\"";
    else out += c;
  }
  return "\"" + out + (end < s.size() ? "...\"" : "\"");
}

/// The summary of `run` (see the file's header for the definitions). `references`: the
/// expected outputs, or null.
inline Summary summarize(const Run& run, const References* references, const std::vector<double>& ps) {
  Summary s;
  s.reference_given = references != nullptr;
  const auto problem = [&](std::string line) {
    if (s.problems.size() < 10) s.problems.push_back(std::move(line));
  };
  std::vector<double> ttfts, tpots, itls, e2els;
  std::map<std::size_t, std::size_t> first_answer;  // prompt -> request whose text is the one seen first
  for (std::size_t i = 0; i < run.plan.size(); ++i) {
    const PlannedRequest& q = run.plan[i];
    const RequestResult& r = run.results[i];
    const Prompt& p = run.prompts[q.prompt];
    if (q.kind == RequestKind::Malformed) {
      ++s.malformed_sent;
      std::string why;
      const bool ok = r.status >= 400 && r.status < 500 && is_openai_error(r.body, &why);
      ++s.malformed_statuses[malformed_name(q.malformed)][r.status];
      if (ok) {
        ++s.malformed_ok;
      } else {
        ++s.malformed_other;
        problem("request " + std::to_string(i) + " (malformed: " + malformed_name(q.malformed) + "): " +
                (r.status >= 400 && r.status < 500 ? "HTTP " + std::to_string(r.status) + " but " + why + ": " + r.body.substr(0, 200)
                 : r.status == 200                 ? std::string("HTTP 200 (accepted)")
                 : r.error.empty()                 ? "HTTP " + std::to_string(r.status)
                                                   : r.error));
      }
      continue;
    }
    if (q.kind == RequestKind::Disconnect) {
      ++s.disconnect_sent;
      if (r.disconnected)
        ++s.disconnect_done;
      else if (r.success)
        ++s.disconnect_finished_first;
      else {
        ++s.disconnect_failed;
        problem("request " + std::to_string(i) + " (to disconnect after " + std::to_string(q.disconnect_after) + " chunks): " + r.error);
      }
      continue;
    }
    if (!r.success) {
      ++s.failed;
      problem("request " + std::to_string(i) + ": " + r.error);
      continue;
    }
    ++s.completed;
    const std::int64_t out = r.output_tokens();
    s.total_output += out;
    s.total_input += r.prompt_tokens >= 0 ? r.prompt_tokens : static_cast<std::int64_t>(p.text.size());
    if (out > 1) tpots.push_back((r.latency - r.ttft) / static_cast<double>(out - 1));
    itls.insert(itls.end(), r.itl.begin(), r.itl.end());
    ttfts.push_back(r.ttft);
    e2els.push_back(r.latency);
    // outputs: the same prompt (and max_tokens) must give the same text, in this run and in
    // the reference
    const auto [it, first] = first_answer.emplace(q.prompt, i);
    if (!first && run.results[it->second].text != r.text) {
      ++s.repeat_mismatches;
      const std::string& a = run.results[it->second].text;
      const std::size_t k = first_difference(a, r.text);
      problem("request " + std::to_string(i) + ": prompt " + excerpt(p.text) + " answered differently from request " +
              std::to_string(it->second) + " from byte " + std::to_string(k) + ": " + excerpt(r.text, k) + " vs " + excerpt(a, k));
    }
    if (references != nullptr) {
      const auto ref = references->find(p.text);
      if (ref == references->end() || ref->second.max_tokens != p.output_len) {
        ++s.outputs_unchecked;
        problem("request " + std::to_string(i) + ": prompt " + excerpt(p.text) +
                (ref == references->end() ? std::string(" has no reference output")
                                          : " has a reference for max_tokens " + std::to_string(ref->second.max_tokens) +
                                                ", this run asked " + std::to_string(p.output_len)));
      } else {
        ++s.outputs_checked;
        if (ref->second.text != r.text) {
          ++s.output_mismatches;
          const std::size_t k = first_difference(ref->second.text, r.text);
          problem("request " + std::to_string(i) + ": prompt " + excerpt(p.text) + " differs from the reference from byte " +
                  std::to_string(k) + ": got " + excerpt(r.text, k) + ", expected " + excerpt(ref->second.text, k));
        }
      }
    }
  }
  // peak output token throughput: chunks carrying tokens per 1-s bucket (vllm's)
  double first_start = std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < run.plan.size(); ++i)
    if (run.plan[i].kind == RequestKind::Valid && run.results[i].success) first_start = std::min(first_start, run.results[i].start);
  std::map<std::int64_t, std::int64_t> buckets;
  for (std::size_t i = 0; i < run.plan.size(); ++i) {
    const RequestResult& r = run.results[i];
    if (run.plan[i].kind != RequestKind::Valid || !r.success || r.token_chunks == 0) continue;
    double t = r.start + r.ttft - first_start;
    ++buckets[static_cast<std::int64_t>(t)];
    for (double gap : r.itl) ++buckets[static_cast<std::int64_t>(t += gap)];
  }
  for (const auto& [second, count] : buckets) s.peak_output_throughput = std::max(s.peak_output_throughput, static_cast<double>(count));
  const double d = run.duration > 0 ? run.duration : 1e-9;
  s.request_throughput = static_cast<double>(s.completed) / d;
  s.output_throughput = static_cast<double>(s.total_output) / d;
  s.total_token_throughput = static_cast<double>(s.total_input + s.total_output) / d;
  s.ttft = distribution_ms(ttfts, ps);
  s.tpot = distribution_ms(tpots, ps);
  s.itl = distribution_ms(itls, ps);
  s.e2el = distribution_ms(e2els, ps);
  return s;
}

/// The reference outputs a run gives: prompt -> {max_tokens, text} of its successful valid
/// requests (the first answer of a prompt asked several times).
inline References references_of(const Run& run) {
  References refs;
  for (std::size_t i = 0; i < run.plan.size(); ++i) {
    const PlannedRequest& q = run.plan[i];
    if (q.kind != RequestKind::Valid || !run.results[i].success) continue;
    const Prompt& p = run.prompts[q.prompt];
    refs.emplace(p.text, Reference{p.output_len, run.results[i].text});
  }
  return refs;
}

/// Writes `refs` as {"<prompt>": {"max_tokens": M, "text": "<output>"}, ...}.
inline void write_references(const std::string& path, const References& refs) {
  Json j = Json::object();
  for (const auto& [prompt, ref] : refs) j[prompt] = {{"max_tokens", ref.max_tokens}, {"text", ref.text}};
  std::ofstream out(path);
  DSP_CHECK_AS(dsp::InputError, out.good(), "--write-outputs '", path, "' cannot be written");
  out << j.dump(1, ' ', false, Json::error_handler_t::replace) << '\n';
  DSP_CHECK_AS(dsp::InputError, out.good(), "--write-outputs '", path, "': write failed");
}

/// Reads a file write_references wrote. Throws dsp::InputError when it cannot be read or is
/// not of that form.
inline References read_references(const std::string& path) {
  std::ifstream in(path);
  DSP_CHECK_AS(dsp::InputError, in.good(), "--expected-outputs '", path, "' cannot be opened");
  Json j;
  try {
    in >> j;
  } catch (const Json::exception& e) {
    throw dsp::InputError(dsp::detail::concat("--expected-outputs '", path, "' is not valid JSON: ", e.what()));
  }
  DSP_CHECK_AS(dsp::InputError, j.is_object(), "--expected-outputs '", path, "' must hold a JSON object");
  References refs;
  for (const auto& [prompt, v] : j.items()) {
    DSP_CHECK_AS(dsp::InputError,
                 v.is_object() && v.contains("max_tokens") && v["max_tokens"].is_number_integer() && v.contains("text") &&
                     v["text"].is_string(),
                 "--expected-outputs '", path, "': the value of prompt ", excerpt(prompt),
                 " must be {\"max_tokens\": integer, \"text\": string}");
    refs.emplace(prompt, Reference{v["max_tokens"].get<std::int64_t>(), v["text"].get<std::string>()});
  }
  return refs;
}

}  // namespace bench_serving
