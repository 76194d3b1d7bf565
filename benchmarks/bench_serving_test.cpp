// bench_serving's parts (serving_client.hpp) against a stub OpenAI server in this process, on
// 127.0.0.1 at a port the system picks: the SSE parser on every split of a stream, numpy's
// percentile, the prompts and the plan, then whole runs: the metrics, the load-test counts
// (malformed requests answered 4xx, disconnects that really close: the stub sees its writes
// fail), reference outputs, and the server faults the client must report (a 200 to a bad
// request, an error without error JSON, a stream without [DONE], outputs that change).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <filesystem>
#include <set>

#include "serving_client.hpp"

namespace bench_serving_test {

using namespace bench_serving;

// --- a stub server ---------------------------------------------------------------------------

// The completion of `prompt`: `max_tokens` bytes of the prompt reversed, cycled (one byte a
// token, as dsp's byte-level models); with `drift`, the last byte differs every other call.
std::string stub_output(const std::string& prompt, std::int64_t max_tokens) {
  std::string out;
  for (std::int64_t k = 0; k < max_tokens; ++k) out += prompt[prompt.size() - 1 - static_cast<std::size_t>(k) % prompt.size()];
  return out;
}

// How the stub misbehaves (each a fault bench_serving must report).
struct Faults {
  bool accept_wrong_type = false;   // 200 and a stream for "max_tokens": "ten" (as 10)
  bool plain_404 = false;           // unknown model: 404 with a text body, not error JSON
  bool no_done = false;             // streams end without data: [DONE]
  bool drift = false;               // every other answer's last byte changes
};

class StubServer {
 public:
  explicit StubServer(Faults faults = {}) : faults_(faults) {
    server_.new_task_queue = [] { return new httplib::ThreadPool(32); };
    server_.Get("/v1/models", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"object": "list", "data": [{"id": "stub", "object": "model", "max_model_len": 64}]})", "application/json");
    });
    server_.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) { complete(req, res); });
    server_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content("# HELP stub:streams_open Streams not yet ended.\n# TYPE stub:streams_open gauge\nstub:streams_open " +
                          std::to_string(open_.load()) + "\n",
                      "text/plain; version=0.0.4");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    REQUIRE(port_ > 0);
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    for (int k = 0; k < 500 && !server_.is_running(); ++k) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    REQUIRE(server_.is_running());
  }
  ~StubServer() {
    server_.stop();
    thread_.join();
  }
  Target target() const { return Target{"127.0.0.1", port_, "", ""}; }
  int streams_cut() const { return cut_.load(); }  // streams whose client went away
  int streams_done() const { return done_.load(); }

 private:
  static void error(httplib::Response& res, int status, const std::string& message, const char* type = "invalid_request_error") {
    res.status = status;
    res.set_content(Json{{"error", {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}}}}.dump(), "application/json");
  }

  void complete(const httplib::Request& req, httplib::Response& res) {
    const Json j = Json::parse(req.body, nullptr, false);
    if (!j.is_object()) return error(res, 400, "the body is not JSON");
    if (!j.contains("model") || j["model"] != "stub") {
      if (faults_.plain_404) {
        res.status = 404;
        res.set_content("not found", "text/plain");
        return;
      }
      return error(res, 404, "the model does not exist", "NotFoundError");
    }
    std::int64_t max_tokens = 16;
    if (j.contains("max_tokens")) {
      if (j["max_tokens"].is_number_integer())
        max_tokens = j["max_tokens"].get<std::int64_t>();
      else if (faults_.accept_wrong_type)
        max_tokens = 10;
      else
        return error(res, 400, "max_tokens must be an integer");
    }
    std::string prompt;
    if (j["prompt"].is_string()) {
      prompt = j["prompt"].get<std::string>();
    } else if (j["prompt"].is_array()) {
      for (const Json& id : j["prompt"]) prompt += static_cast<char>(id.get<int>());
    } else {
      return error(res, 400, "prompt must be a string or an array of token ids");
    }
    if (prompt.empty()) return error(res, 400, "the prompt is empty");
    if (static_cast<std::int64_t>(prompt.size()) + max_tokens > 64) return error(res, 400, "prompt + max_tokens over 64");
    std::string text = stub_output(prompt, max_tokens);
    if (faults_.drift && (calls_++ % 2 == 1)) text.back() = text.back() == 'x' ? 'y' : 'x';
    // one event a token, 1 ms apart; every third event split in two writes (a line cut in half)
    auto sent = std::make_shared<std::size_t>(0);
    ++open_;
    const std::int64_t prompt_tokens = static_cast<std::int64_t>(prompt.size());
    res.set_chunked_content_provider("text/event-stream", [this, text, sent, prompt_tokens](std::size_t, httplib::DataSink& sink) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      const std::size_t k = (*sent)++;
      std::string event;
      if (k < text.size()) {
        event = "data: " + Json{{"object", "text_completion"}, {"choices", {{{"index", 0}, {"text", text.substr(k, 1)}, {"finish_reason", nullptr}}}}}.dump() + "\n\n";
      } else if (k == text.size()) {
        event = "data: " + Json{{"choices", {{{"index", 0}, {"text", ""}, {"finish_reason", "length"}}}}}.dump() + "\n\n";
      } else if (k == text.size() + 1) {
        event = "data: " + Json{{"choices", Json::array()}, {"usage", {{"prompt_tokens", prompt_tokens}, {"completion_tokens", text.size()}}}}.dump() + "\n\n";
      } else {
        if (!faults_.no_done && !sink.write("data: [DONE]\n\n", 14)) return false;
        ++done_;
        sink.done();
        return true;
      }
      const std::size_t half = k % 3 == 0 ? event.size() / 2 : event.size();
      if (!sink.write(event.data(), half) || (half < event.size() && !sink.write(event.data() + half, event.size() - half))) {
        ++cut_;
        return false;
      }
      return true;
    }, [this](bool) { --open_; });
  }

  Faults faults_;
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<int> cut_{0}, done_{0}, calls_{0}, open_{0};
};

Options stub_options(const StubServer& s) {
  Options o;
  o.target = s.target();
  o.model = "stub";
  o.request_timeout_s = 30;
  return o;
}

DatasetConfig small_dataset(std::uint64_t seed = 0) {
  DatasetConfig d;
  d.input_len = 12;
  d.output_len = 20;
  d.range_ratio = 0.5;
  d.seed = seed;
  return d;
}

// --- parts -----------------------------------------------------------------------------------

TEST_CASE("percentile: numpy's linear interpolation") {
  CHECK(percentile({}, 99) == 0);
  CHECK(percentile({5}, 99) == 5);
  CHECK(percentile({4, 1, 3, 2}, 50) == doctest::Approx(2.5));
  CHECK(percentile({4, 1, 3, 2}, 99) == doctest::Approx(3.97));  // numpy.percentile([1,2,3,4], 99)
  CHECK(percentile({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 90) == doctest::Approx(9.1));
  CHECK(mean_of({1, 2, 3, 6}) == doctest::Approx(3));
  CHECK(std_of({1, 2, 3, 6}) == doctest::Approx(std::sqrt(3.5)));  // numpy.std, ddof = 0
}

TEST_CASE("SSE parser: the same events whatever the stream is cut into") {
  const std::string stream =
      ": a comment\r\n"
      "data: {\"a\": 1}\r\n\r\n"
      "event: message\n"
      "data:{\"b\": 2}\n\n"
      "data: line one\n"
      "data: line two\n\n"
      "\n"
      "data: [DONE]\n\n";
  const std::vector<std::string> expected = {"{\"a\": 1}", "{\"b\": 2}", "line one\nline two", "[DONE]"};
  for (std::size_t cut1 = 0; cut1 <= stream.size(); ++cut1)
    for (std::size_t cut2 = cut1; cut2 <= stream.size(); cut2 += 7) {
      SseParser parser;
      std::vector<std::string> events;
      const auto collect = [&](std::string_view d) {
        events.emplace_back(d);
        return true;
      };
      parser.feed(std::string_view(stream).substr(0, cut1), collect);
      parser.feed(std::string_view(stream).substr(cut1, cut2 - cut1), collect);
      parser.feed(std::string_view(stream).substr(cut2), collect);
      parser.finish(collect);
      REQUIRE(events == expected);
    }
  SseParser parser;  // a last event without its blank line, and a stop asked by the callback
  std::vector<std::string> events;
  CHECK_FALSE(parser.feed("data: 1\n\ndata: 2\n\ndata: 3\n\n", [&](std::string_view d) {
    events.emplace_back(d);
    return events.size() < 2;
  }));
  CHECK(events == std::vector<std::string>{"1", "2"});
  SseParser tail;
  events.clear();
  tail.feed("data: [DONE]", [&](std::string_view d) { return events.emplace_back(d), true; });
  CHECK(events.empty());
  tail.finish([&](std::string_view d) { return events.emplace_back(d), true; });
  CHECK(events == std::vector<std::string>{"[DONE]"});
}

TEST_CASE("base URL: loopback only, plain HTTP") {
  const Target t = parse_base_url("http://127.0.0.1:8123/");
  CHECK(t.host == "127.0.0.1");
  CHECK(t.port == 8123);
  CHECK(t.base_path.empty());
  CHECK(parse_base_url("http://localhost:9000/prefix").base_path == "/prefix");
  CHECK(parse_base_url("http://[::1]:9000").host == "::1");
  CHECK(parse_base_url("http://127.0.0.1").port == 80);
  CHECK_THROWS_WITH_AS(parse_base_url("http://10.0.0.1:8000"), doctest::Contains("not a loopback address"), dsp::InputError);
  CHECK_THROWS_AS(parse_base_url("http://example.com:8000"), dsp::InputError);
  CHECK_THROWS_AS(parse_base_url("http://127.0.0.1.example.com:80"), dsp::InputError);
  CHECK_THROWS_AS(parse_base_url("https://127.0.0.1:8000"), dsp::InputError);
  CHECK_THROWS_AS(parse_base_url("http://127.0.0.1:80x"), dsp::InputError);
}

TEST_CASE("prompts: seeded, lengths within the range, corpus cuts at character boundaries") {
  const std::vector<Prompt> a = make_prompts(small_dataset(3), 200), b = make_prompts(small_dataset(3), 200);
  std::set<std::size_t> lens;
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].text == b[i].text);
    CHECK(a[i].text.size() >= 6);
    CHECK(a[i].text.size() <= 18);
    CHECK(a[i].output_len >= 10);
    CHECK(a[i].output_len <= 30);
    for (char c : a[i].text) CHECK((c >= 32 && c <= 126));
    lens.insert(a[i].text.size());
  }
  CHECK(lens.size() == 13);  // every length of [6, 18] drawn
  CHECK(make_prompts(small_dataset(4), 1)[0].text != a[0].text);

  const std::filesystem::path file = std::filesystem::temp_directory_path() / ("bench_serving_test_corpus_" + std::to_string(::getpid()));
  {
    std::ofstream out(file);
    for (int k = 0; k < 200; ++k) out << "h\xC3\xA9llo w\xC3\xB6rld \xE2\x82\xAC ";  // é ö €
  }
  DatasetConfig d = small_dataset();
  d.name = "corpus";
  d.path = file.string();
  for (const Prompt& p : make_prompts(d, 300)) {
    CHECK(is_utf8(p.text));
    CHECK(!p.text.empty());
    CHECK(p.text.size() <= 18);
  }
  {
    std::ofstream out(file);
    out << "ab\xC3";
  }
  CHECK_THROWS_WITH_AS(make_prompts(d, 1), doctest::Contains("not UTF-8"), dsp::InputError);
  std::filesystem::remove(file);
  d.path = "/nonexistent/corpus.txt";
  CHECK_THROWS_AS(make_prompts(d, 1), dsp::InputError);
  CHECK(!is_utf8("\xED\xA0\x80"));  // a surrogate
  CHECK(!is_utf8("\xC0\x80"));      // overlong
}

TEST_CASE("plan: fractions, kinds cycling, Poisson arrivals") {
  Options o;
  o.num_prompts = 1000;
  o.malformed_fraction = 0.1;
  o.disconnect_fraction = 0.1;
  o.max_model_len = 64;
  o.request_rate = 50;
  const std::vector<PlannedRequest> plan = plan_requests(o, 7);
  std::map<RequestKind, int> kinds;
  std::map<MalformedKind, int> bad;
  std::map<int, int> cuts;
  for (std::size_t i = 0; i < plan.size(); ++i) {
    ++kinds[plan[i].kind];
    if (plan[i].kind == RequestKind::Malformed) ++bad[plan[i].malformed];
    if (plan[i].kind == RequestKind::Disconnect) ++cuts[plan[i].disconnect_after];
    CHECK(plan[i].prompt == i % 7);
    if (i > 0) CHECK(plan[i].arrival >= plan[i - 1].arrival);
  }
  CHECK(kinds[RequestKind::Malformed] == 100);
  CHECK(kinds[RequestKind::Disconnect] == 100);
  CHECK(bad.size() == 5);
  for (const auto& [kind, n] : bad) CHECK(n == 20);
  CHECK(cuts == std::map<int, int>{{1, 34}, {2, 33}, {3, 33}});
  CHECK(plan.back().arrival / 999 == doctest::Approx(1.0 / 50).epsilon(0.1));  // mean gap 1/rate
  o.max_model_len = 0;  // no over-length kind without a max model len
  for (const PlannedRequest& q : plan_requests(o, 7)) CHECK(q.malformed != MalformedKind::OverLength);
  o.request_rate = std::numeric_limits<double>::infinity();
  for (const PlannedRequest& q : plan_requests(o, 7)) CHECK(q.arrival == 0);
  o.malformed_fraction = 0.95;
  CHECK_THROWS_AS(plan_requests(o, 7), dsp::InputError);
}

TEST_CASE("request bodies: valid, token ids, chat, and each malformed kind") {
  Options o;
  o.model = "m";
  o.max_model_len = 32;
  o.ignore_eos = true;
  const Prompt p{"ab\xC3\xA9", 5};
  const Json v = valid_body(o, p);
  CHECK(v["prompt"] == "ab\xC3\xA9");
  CHECK(v["max_tokens"] == 5);
  CHECK(v["stream"] == true);
  CHECK(v["stream_options"]["include_usage"] == true);
  CHECK(v["temperature"] == 0.0);
  CHECK(v["ignore_eos"] == true);
  o.prompt_token_ids = true;
  CHECK(valid_body(o, p)["prompt"] == Json::array({97, 98, 0xC3, 0xA9}));
  CHECK(Json::parse(malformed_body(o, p, MalformedKind::EmptyPrompt))["prompt"] == Json::array());
  CHECK(Json::parse(malformed_body(o, p, MalformedKind::OverLength))["prompt"].size() == 32);
  o.prompt_token_ids = false;
  CHECK(!Json::accept(malformed_body(o, p, MalformedKind::NotJson)));
  CHECK(Json::parse(malformed_body(o, p, MalformedKind::WrongType))["max_tokens"] == "ten");
  const Json over = Json::parse(malformed_body(o, p, MalformedKind::OverLength));
  CHECK(over["prompt"].get<std::string>().size() == 32);
  CHECK(over["max_tokens"] == 32);
  CHECK(Json::parse(malformed_body(o, p, MalformedKind::UnknownModel))["model"] == "no-such-model");
  CHECK(Json::parse(malformed_body(o, p, MalformedKind::EmptyPrompt))["prompt"] == "");
  o.endpoint = "/v1/chat/completions";
  const Json chat = valid_body(o, p);
  CHECK(chat["messages"][0]["content"] == "ab\xC3\xA9");
  CHECK(!chat.contains("prompt"));
  CHECK(Json::parse(malformed_body(o, p, MalformedKind::EmptyPrompt))["messages"] == Json::array());
}

TEST_CASE("metrics: Prometheus text, one series or a metric's sum") {
  const std::string text =
      "# HELP dsp:kv_cache_used_blocks KV cache blocks in use.\n"
      "# TYPE dsp:kv_cache_used_blocks gauge\n"
      "dsp:kv_cache_used_blocks{rank=\"0\"} 3\n"
      "dsp:kv_cache_used_blocks{rank=\"1\",note=\"a b\"} 4 1700000000\r\n"
      "dsp:kv_cache_used_blocks_total 9\n"
      "dsp:num_requests_running 0\n"
      "bad_value x\n";
  CHECK(metric_value(text, "dsp:kv_cache_used_blocks") == 7.0);
  CHECK(metric_value(text, "dsp:kv_cache_used_blocks{rank=\"1\",note=\"a b\"}") == 4.0);
  CHECK(metric_value(text, "dsp:num_requests_running") == 0.0);
  CHECK_FALSE(metric_value(text, "dsp:num_requests").has_value());
  CHECK_FALSE(metric_value(text, "bad_value").has_value());
}

TEST_CASE("error JSON: OpenAI's four members") {
  std::string why;
  CHECK(is_openai_error(R"({"error": {"message": "m", "type": "t", "param": null, "code": 400}})", &why));
  CHECK_FALSE(is_openai_error(R"({"error": {"message": "m", "type": "t"}})", &why));
  CHECK(why == "error.param or error.code missing");
  CHECK_FALSE(is_openai_error(R"({"detail": "x"})", &why));
  CHECK_FALSE(is_openai_error("Bad Request", &why));
  CHECK(why == "the body is not JSON");
}

// --- runs against the stub ---------------------------------------------------------------------

TEST_CASE("run: every request streamed, measured and right") {
  StubServer server;
  CHECK(discover_model(server.target()) == "stub");
  CHECK(discover_max_model_len(server.target()) == 64);
  Options o = stub_options(server);
  o.num_prompts = 24;
  o.max_concurrency = 4;
  std::vector<Prompt> prompts = make_prompts(small_dataset(), o.num_prompts);
  for (const bool ids : {false, true}) {
    o.prompt_token_ids = ids;
    const Run run = run_requests(o, prompts, plan_requests(o, prompts.size()));
    const Summary s = summarize(run, nullptr, {99});
    CHECK(s.completed == 24);
    CHECK(s.failed == 0);
    CHECK(s.passed());
    CHECK(run.peak_concurrency == 4);
    std::int64_t out = 0, in = 0;
    for (std::size_t i = 0; i < run.results.size(); ++i) {
      const RequestResult& r = run.results[i];
      const Prompt& p = prompts[run.plan[i].prompt];
      REQUIRE(r.success);
      CHECK(r.text == stub_output(p.text, p.output_len));
      CHECK(r.token_chunks == p.output_len);
      CHECK(r.completion_tokens == p.output_len);
      CHECK(r.prompt_tokens == static_cast<std::int64_t>(p.text.size()));
      CHECK(r.itl.size() == static_cast<std::size_t>(p.output_len - 1));
      CHECK(r.ttft > 0);
      CHECK(r.latency > r.ttft);
      CHECK(r.finish_reason == "length");
      double sum = r.ttft;
      for (double g : r.itl) sum += g;
      CHECK(sum == doctest::Approx(r.latency));  // TTFT + the ITLs = E2E
      out += p.output_len;
      in += static_cast<std::int64_t>(p.text.size());
    }
    CHECK(s.total_output == out);
    CHECK(s.total_input == in);
    CHECK(s.output_throughput == doctest::Approx(out / run.duration));
    CHECK(s.request_throughput == doctest::Approx(24 / run.duration));
    CHECK(s.itl.mean >= 0.9);  // ms: the stub sleeps 1 ms before each event
    CHECK(s.tpot.mean >= 0.9);
    CHECK(s.ttft.percentiles.at(0).first == 99);
    CHECK(s.peak_output_throughput >= s.output_throughput * run.duration / std::ceil(run.duration + 1));  // some bucket holds the mean
    CHECK(s.peak_output_throughput <= static_cast<double>(out));
  }
}

TEST_CASE("run: load-test mode, malformed and disconnecting requests, references") {
  StubServer server;
  Options o = stub_options(server);
  o.num_prompts = 60;
  o.max_concurrency = 8;
  o.malformed_fraction = 0.25;
  o.disconnect_fraction = 0.2;
  o.max_model_len = 64;
  const std::vector<Prompt> prompts = make_prompts(small_dataset(1), 6);
  const std::vector<PlannedRequest> plan = plan_requests(o, prompts.size());
  const Run run = run_requests(o, prompts, plan);
  const Summary s = summarize(run, nullptr, {99});
  CHECK(s.malformed_sent == 15);
  CHECK(s.malformed_ok == 15);
  CHECK(s.malformed_other == 0);
  CHECK(s.malformed_statuses.size() == 5);
  CHECK(s.malformed_statuses.at("unknown_model").begin()->first == 404);
  CHECK(s.disconnect_sent == 12);
  CHECK(s.disconnect_done == 12);
  CHECK(s.completed == 33);
  CHECK(s.repeat_mismatches == 0);
  CHECK(s.passed());
  for (std::size_t i = 0; i < plan.size(); ++i)
    if (plan[i].kind == RequestKind::Disconnect) CHECK(run.results[i].token_chunks == plan[i].disconnect_after);
  // the stub saw each disconnect as a write that failed (bounded wait: its next write is <= 1 ms on)
  for (int k = 0; k < 2000 && server.streams_cut() < 12; ++k) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(server.streams_cut() == 12);
  CHECK(server.streams_done() == 33);
  std::vector<MetricExpectation> open = {{"stub:streams_open", 0, std::nullopt}};
  CHECK(wait_for_metrics(server.target(), open, 5));
  CHECK(open[0].seen == 0.0);
  std::vector<MetricExpectation> missing = {{"stub:nothing", 0, std::nullopt}};
  CHECK_FALSE(wait_for_metrics(server.target(), missing, 0.3));
  CHECK_FALSE(missing[0].seen.has_value());

  // references: written from this run, checked by the next; a changed one is a mismatch
  References refs = references_of(run);
  CHECK(refs.size() == 6);
  const std::string file = (std::filesystem::temp_directory_path() / ("bench_serving_test_refs_" + std::to_string(::getpid()))).string();
  write_references(file, refs);
  const References read = read_references(file);
  CHECK(read.size() == 6);
  for (const auto& [prompt, ref] : refs) CHECK(read.at(prompt).text == ref.text);
  std::filesystem::remove(file);
  const Run again = run_requests(o, prompts, plan);
  CHECK(summarize(again, &read, {99}).outputs_checked == 33);
  CHECK(summarize(again, &read, {99}).passed());
  References wrong = read;
  wrong.begin()->second.text.back() ^= 1;
  const Summary bad = summarize(again, &wrong, {99});
  CHECK(bad.output_mismatches > 0);
  CHECK_FALSE(bad.passed());
  References longer = read;
  longer.begin()->second.max_tokens += 1;  // asked with another max_tokens: not comparable
  CHECK(summarize(again, &longer, {99}).outputs_unchecked > 0);
  CHECK_FALSE(summarize(again, &longer, {99}).passed());
}

TEST_CASE("run: the server's faults are reported and fail the run") {
  const auto load_run = [](const Faults& faults) {
    StubServer server(faults);
    Options o = stub_options(server);
    o.num_prompts = 20;
    o.max_concurrency = 4;
    o.malformed_fraction = 0.5;
    o.max_model_len = 64;
    const std::vector<Prompt> prompts = make_prompts(small_dataset(2), 3);
    return summarize(run_requests(o, prompts, plan_requests(o, prompts.size())), nullptr, {99});
  };
  const Summary wrong_type = load_run({.accept_wrong_type = true});
  CHECK(wrong_type.malformed_other == 2);  // the two wrong_type requests of 10 malformed
  CHECK(wrong_type.malformed_statuses.at("wrong_type").begin()->first == 200);
  CHECK_FALSE(wrong_type.passed());
  const Summary plain = load_run({.plain_404 = true});
  CHECK(plain.malformed_other == 2);
  CHECK(plain.problems.at(0).find("HTTP 404 but the body is not JSON") != std::string::npos);
  CHECK_FALSE(plain.passed());
  const Summary no_done = load_run({.no_done = true});
  CHECK(no_done.failed == 10);
  CHECK(no_done.completed == 0);
  CHECK(no_done.problems.at(0).find("without data: [DONE]") != std::string::npos);
  const Summary drift = load_run({.drift = true});
  CHECK(drift.repeat_mismatches > 0);
  CHECK_FALSE(drift.passed());
}

TEST_CASE("run: no server, an error answer, a timeout") {
  Options o;
  {
    StubServer server;
    o = stub_options(server);
  }  // stopped: nothing listens on its port now
  RequestSpec spec{"/v1/completions", valid_body(o, Prompt{"abc", 3}).dump(), false, 0, 5};
  RequestResult r = send_request(o.target, spec, Clock::now());
  CHECK_FALSE(r.success);
  CHECK(r.status == 0);
  CHECK(r.error.starts_with("no answer"));

  httplib::Server slow;
  slow.Post("/v1/completions", [](const httplib::Request&, httplib::Response& res) {
    res.set_chunked_content_provider("text/event-stream", [](std::size_t, httplib::DataSink& sink) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      const std::string event = "data: {\"choices\": [{\"text\": \"x\"}]}\n\n";
      return sink.write(event.data(), event.size());
    });
  });
  const int port = slow.bind_to_any_port("127.0.0.1");
  std::thread t([&] { slow.listen_after_bind(); });
  for (int k = 0; k < 500 && !slow.is_running(); ++k) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  spec.timeout_s = 0.5;  // the stream never ends: cut at the timeout
  const auto start = Clock::now();
  r = send_request(Target{"127.0.0.1", port, "", ""}, spec, start);
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  CHECK(r.timed_out);
  CHECK_FALSE(r.success);
  CHECK(r.token_chunks >= 3);
  CHECK(took < 2);
  slow.stop();
  t.join();
}

}  // namespace bench_serving_test
