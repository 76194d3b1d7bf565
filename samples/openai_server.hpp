#pragma once
// The HTTP front of dsp-serve: OpenAI's API over cpp-httplib, in front of a serve::AsyncEngine.
//
//   POST /v1/completions       prompt: a string, strings, token ids or lists of token ids
//   POST /v1/chat/completions  messages through the byte-level chat template (serve/chat_template.hpp)
//   GET  /v1/models            the served model
//   GET  /health               200 when serving, 503 while the model loads or the server drains
//   GET  /metrics              Prometheus text (AsyncEngine::metrics_text)
//   GET  /version
//
// Every answer to bad input is a 4xx with OpenAI's error JSON, never a 500: malformed JSON, a
// wrong field type, a value out of range, an empty prompt, an over-long request (400), an
// unknown model (404), a missing or wrong API key (401), an unknown path (404), a known path
// with another method (405), a chunked or missing request body (411: bodies need a Content-Length), a
// body over 16 MiB (413); a full queue or a draining server answers 503. Streams are
// server-sent events (`data: {chunk}` ... `data: [DONE]`), one chunk per generated token.
// Whole responses are sent with chunked transfer encoding (to HTTP/1.0 clients: until the
// connection closes) so that the server can see, while the request runs, whether the client is
// still there: a client that disconnects, streaming or not, has its requests aborted and their
// KV blocks freed at the next engine step.
//
// Limits of cpp-httplib 0.11.4 (Debian 12's), the HTTP layer: a thread per connection (the pool
// holds --max-num-seqs + --max-queue + 8), so idle connections occupy threads until their
// 5-second keep-alive timeout, and a drain waits for them that long at most; pipelined requests
// are answered one at a time; a client that half-closes its side is taken for gone.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <sys/socket.h>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "dsp/core/error.hpp"
#include "dsp/serve/async_engine.hpp"
#include "dsp/serve/openai_request.hpp"
#include "dsp/serve/openai_response.hpp"

namespace samples {

/// How the front is reached and what it serves.
struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                  ///< 0: any free port (the one taken is printed)
  std::string api_key;              ///< empty: no authentication
  std::size_t threads = 64;         ///< HTTP worker threads: streams open at once at most
};

namespace detail {

namespace oa = dsp::serve::openai;

inline std::string dump(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

inline void send_error(httplib::Response& res, const oa::ApiError& e) {
  res.status = e.status();
  res.set_content(dump(e.body()), "application/json");
}

// The paths this server answers with GET and with POST.
inline const std::set<std::string>& get_paths() {
  static const std::set<std::string> paths{"/health", "/version", "/metrics", "/v1/models"};
  return paths;
}
inline const std::set<std::string>& post_paths() {
  static const std::set<std::string> paths{"/v1/completions", "/v1/chat/completions"};
  return paths;
}

// OpenAI's error JSON for `status` on `req`; a 404 on a path served with another method becomes
// 405 with an Allow header.
inline void send_status_error(const httplib::Request& req, httplib::Response& res, int status) {
  const bool get = get_paths().contains(req.path), post = post_paths().contains(req.path);
  if (status == 404 && (get || post)) {
    status = 405;
    res.set_header("Allow", get ? "GET" : "POST");
  }
  const std::string message = status == 404   ? "no route " + req.method + " " + req.path
                              : status == 405 ? req.method + " is not allowed on " + req.path
                              : status == 411 ? std::string("send the request body (JSON) with a Content-Length header")
                              : status == 413 ? std::string("the request body is over the limit (16 MiB; 8 KiB as a form: send Content-Type: application/json)")
                              : status == 400 ? std::string("malformed HTTP request")
                                              : "HTTP " + std::to_string(status);
  send_error(res, oa::ApiError(status, message));
}

inline std::string random_id(const char* prefix) {
  static thread_local std::mt19937_64 gen{std::random_device{}()};
  char buf[40];
  std::snprintf(buf, sizeof buf, "%s%016llx", prefix, static_cast<unsigned long long>(gen()));
  return buf;
}

// One HTTP request's engine requests (its prompts x n choices) and what they have produced.
struct Call {
  oa::ResponseHeader header;
  std::shared_ptr<dsp::serve::OutputQueue> queue = std::make_shared<dsp::serve::OutputQueue>();
  std::vector<std::string> ids;                  // engine request per choice
  std::map<std::string, std::size_t> choice_of;  // engine id -> choice
  std::vector<oa::ChoiceBuilder> choices;
  std::vector<bool> started;                     // a chunk of the choice was sent
  bool stream = false, include_usage = false;
  std::int64_t prompt_tokens = 0;
  std::atomic<bool> done{false};

  std::size_t unfinished() const {
    std::size_t n = 0;
    for (const auto& c : choices) n += c.finished() ? 0 : 1;
    return n;
  }
  std::int64_t n = 1;  // choices per prompt
  // Usage: each prompt counted once, with the prefix-cache hits of its first choice.
  nlohmann::json usage() const {
    std::int64_t completion = 0, cached = 0;
    for (const auto& c : choices) completion += c.tokens();
    for (std::size_t i = 0; i < choices.size(); i += static_cast<std::size_t>(n)) cached += choices[i].cached_tokens();
    return oa::usage_json(prompt_tokens, completion, cached);
  }
};

inline bool write_event(httplib::DataSink& sink, const nlohmann::json& j) {
  const std::string event = "data: " + dump(j) + "\n\n";
  return sink.write(event.data(), event.size());
}

}  // namespace detail

/// The server: binds at construction (so that a port in use fails before the model loads),
/// answers /health with 503 until serve() hands it the engine.
template <class AsyncEngineT>
class OpenAiServer {
 public:
  /// Binds host:port and starts listening on a thread of its own. Throws ConfigError when the
  /// address cannot be bound.
  OpenAiServer(HttpOptions options, dsp::serve::openai::ServedModel model)
      : options_(std::move(options)), model_(std::move(model)) {
    const std::size_t threads = options_.threads;
    server_.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    server_.set_payload_max_length(std::size_t{16} << 20);
    server_.set_keep_alive_timeout(5);  // an idle connection holds an HTTP thread this long at most
    // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, with which a second server
    // binds the same port and takes part of the traffic instead of failing.
    server_.set_socket_options([this](socket_t sock) {
      int yes = 1;
      ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
      listen_socket_ = sock;  // the last socket made is the one bound (set_socket_options is called per candidate)
    });
    routes();
    if (options_.port == 0) {
      port_ = server_.bind_to_any_port(options_.host);
      DSP_CHECK_AS(dsp::ConfigError, port_ > 0, "cannot listen on ", options_.host, ": no free port");
    } else {
      DSP_CHECK_AS(dsp::ConfigError, server_.bind_to_port(options_.host, options_.port), "cannot listen on ",
                   options_.host, ":", options_.port, " (address in use, or not this machine's?)");
      port_ = options_.port;
    }
    // Debian's cpp-httplib 0.11.4 listens with a backlog of 5: a burst of connections (64
    // clients at once) overflows it and the kernel drops some (TcpExtListenOverflows), which
    // the clients see as no answer. Listening again on the bound socket raises the backlog.
    DSP_CHECK_AS(dsp::ConfigError, ::listen(listen_socket_, SOMAXCONN) == 0, "cannot listen on ", options_.host, ":",
                 port_, " with a backlog of ", SOMAXCONN);
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }
  OpenAiServer(const OpenAiServer&) = delete;
  OpenAiServer& operator=(const OpenAiServer&) = delete;
  ~OpenAiServer() { stop(); }

  int port() const { return port_; }
  /// Starts answering requests on `engine` (which must outlive this server or stop() first).
  void serve(AsyncEngineT& engine) { engine_.store(&engine); }
  /// Stops listening and joins the HTTP threads (their open responses run to their end).
  void stop() {
    if (!thread_.joinable()) return;
    server_.stop();
    thread_.join();
    engine_.store(nullptr);
  }

 private:
  using Kind = dsp::serve::openai::ParsedRequest::Kind;

  void routes() {
    namespace oa = dsp::serve::openai;
    server_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      // Runs before the body is read. cpp-httplib 0.11.4 reads a chunked request body without
      // the 16 MiB bound, so bodies must come with a Content-Length (as OpenAI's clients send).
      if (req.has_header("Transfer-Encoding")) {
        detail::send_error(res, oa::ApiError(411, "send the request body with a Content-Length, not Transfer-Encoding"));
        return httplib::Server::HandlerResponse::Handled;
      }
      // A method httplib expects a body with, without a Content-Length: httplib would read the
      // body until the client closes (unbounded) or its 5 s read timeout (then a 400), so the
      // answer comes now: 411 on a POST path, else what the request gets with a body (404, 405).
      const bool body_method = req.method == "POST" || req.method == "PUT" || req.method == "PATCH" || req.method == "DELETE";
      if (body_method && !req.has_header("Content-Length")) {
        detail::send_status_error(req, res, req.method == "POST" && detail::post_paths().contains(req.path) ? 411 : 404);
        return httplib::Server::HandlerResponse::Handled;
      }
      if (options_.api_key.empty() || !req.path.starts_with("/v1/")) return httplib::Server::HandlerResponse::Unhandled;
      if (req.get_header_value("Authorization") == "Bearer " + options_.api_key)
        return httplib::Server::HandlerResponse::Unhandled;
      detail::send_error(res, oa::ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", "",
                                           "invalid_api_key"));
      return httplib::Server::HandlerResponse::Handled;
    });
    // Statuses httplib sets itself (an unknown path: 404; a body too large: 413; a malformed
    // request: 400) get OpenAI's error JSON too.
    server_.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (res.body.empty()) detail::send_status_error(req, res, res.status);
    });
    server_.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
      detail::send_error(res, oa::ApiError(500, "internal error"));
    });
    server_.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      AsyncEngineT* engine = engine_.load();
      if (!engine || engine->draining()) {
        res.status = 503;
        res.set_content(engine ? "draining\n" : "loading\n", "text/plain");
        return;
      }
      res.set_content("", "text/plain");
    });
    server_.Get("/version", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"version":"dsp"})", "application/json");
    });
    server_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      AsyncEngineT* engine = engine_.load();
      res.set_content(engine ? engine->metrics_text() : std::string(), "text/plain; version=0.0.4");
    });
    server_.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      const nlohmann::json card = {{"id", model_.name},       {"object", "model"},
                                   {"created", created_},     {"owned_by", "dsp"},
                                   {"root", model_.name},     {"max_model_len", model_.max_model_len}};
      res.set_content(detail::dump({{"object", "list"}, {"data", nlohmann::json::array({card})}}), "application/json");
    });
    server_.Post("/v1/completions",
                 [this](const httplib::Request& req, httplib::Response& res) { complete(req, res, Kind::Completion); });
    server_.Post("/v1/chat/completions",
                 [this](const httplib::Request& req, httplib::Response& res) { complete(req, res, Kind::Chat); });
  }

  void complete(const httplib::Request& req, httplib::Response& res, Kind kind) {
    namespace oa = dsp::serve::openai;
    try {
      AsyncEngineT* engine = engine_.load();
      if (!engine) throw oa::ApiError(503, "the model is loading; retry when GET /health answers 200");
      nlohmann::json body;
      try {
        body = nlohmann::json::parse(req.body);
      } catch (const nlohmann::json::exception& e) {
        throw oa::ApiError(400, std::string("the request body is not valid JSON: ") + e.what());
      }
      const oa::ParsedRequest parsed =
          kind == Kind::Chat ? oa::parse_chat_request(body, model_) : oa::parse_completion_request(body, model_);
      auto call = std::make_shared<detail::Call>();
      call->header = {kind, detail::random_id(kind == Kind::Chat ? "chatcmpl-" : "cmpl-"), std::time(nullptr), parsed.model};
      call->stream = parsed.stream;
      call->include_usage = parsed.include_usage;
      call->n = parsed.n;
      // Without a seed a request draws from a fresh one; its choices differ by random stream.
      const std::uint64_t seed = parsed.seeded ? parsed.params[0].seed : std::random_device{}() * 0x100000001ull;
      std::vector<dsp::serve::NewRequest> requests;
      for (std::size_t p = 0; p < parsed.prompts.size(); ++p) {
        call->prompt_tokens += static_cast<std::int64_t>(parsed.prompts[p].size());
        for (std::int64_t j = 0; j < parsed.n; ++j) {
          dsp::serve::SamplingParams params = parsed.params[p];
          const std::int64_t index = static_cast<std::int64_t>(p) * parsed.n + j;
          params.stream = static_cast<std::uint64_t>(j);  // a prompt's text does not depend on the others
          if (!parsed.seeded) params.seed = seed;
          requests.push_back({parsed.prompts[p], params});
          call->choices.emplace_back(kind, index, params.logprobs.has_value(), dsp::serve::byte_token_text);
        }
      }
      call->started.assign(call->choices.size(), false);
      try {
        call->ids = engine->submit(std::move(requests), call->queue);
      } catch (const dsp::serve::ServerBusy& e) {
        throw oa::ApiError(503, e.what(), "", "server_busy");
      } catch (const dsp::InputError& e) {
        throw oa::ApiError(400, e.what());
      }
      for (std::size_t i = 0; i < call->ids.size(); ++i) call->choice_of[call->ids[i]] = i;
      auto provider = [call, engine](std::size_t, httplib::DataSink& sink) { return respond(*call, *engine, sink); };
      auto releaser = [call, engine](bool) {
        if (!call->done) engine->abort(call->ids);  // the client went away (or the write failed)
      };
      const std::string type = call->stream ? "text/event-stream" : "application/json";
      // HTTP/1.0 has no chunked encoding: the body runs to the end of the connection.
      if (req.version == "HTTP/1.0") res.set_content_provider(type, provider, releaser);
      else res.set_chunked_content_provider(type, provider, releaser);
      if (call->stream) res.set_header("Cache-Control", "no-cache");
    } catch (const oa::ApiError& e) {
      detail::send_error(res, e);
    }
  }

  // Writes the call's response as its outputs arrive; false (the connection is dropped) when
  // the client is gone, after aborting its requests.
  static bool respond(detail::Call& call, AsyncEngineT& engine, httplib::DataSink& sink) {
    namespace oa = dsp::serve::openai;
    while (call.unfinished() > 0) {
      if (!sink.is_writable()) {
        engine.abort(call.ids);
        return false;
      }
      std::vector<dsp::serve::RequestOutput> outputs;
      try {
        outputs = call.queue->pop(std::chrono::milliseconds(50));
      } catch (const dsp::Error& e) {  // the engine stopped: say so in the body, as the status is sent
        const oa::ApiError error(500, e.what());
        if (call.stream) detail::write_event(sink, error.body());
        else {
          const std::string body = detail::dump(error.body());
          sink.write(body.data(), body.size());
        }
        call.done = true;
        sink.done();
        return true;
      }
      for (const auto& out : outputs) {
        const std::size_t i = call.choice_of.at(out.id);
        const oa::Delta d = call.choices[i].add(out);
        if (!call.stream) continue;
        if (!detail::write_event(sink, oa::chunk_json(call.header, call.choices[i].index(), d, !call.started[i]))) {
          engine.abort(call.ids);
          return false;
        }
        call.started[i] = true;
      }
    }
    bool ok = true;
    if (call.stream) {
      if (call.include_usage) ok = detail::write_event(sink, oa::usage_chunk_json(call.header, call.usage()));
      static constexpr std::string_view done = "data: [DONE]\n\n";
      ok = ok && sink.write(done.data(), done.size());
    } else {
      const std::string body = detail::dump(oa::response_json(call.header, call.choices, call.usage()));
      ok = sink.write(body.data(), body.size());
    }
    call.done = true;
    if (ok) sink.done();
    return ok;
  }

  HttpOptions options_;
  dsp::serve::openai::ServedModel model_;
  std::int64_t created_ = std::time(nullptr);
  httplib::Server server_;
  int port_ = 0;
  socket_t listen_socket_ = -1;
  std::thread thread_;
  std::atomic<AsyncEngineT*> engine_{nullptr};
};

}  // namespace samples
