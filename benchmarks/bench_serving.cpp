// bench_serving: a load client for OpenAI-compatible HTTP servers on this machine (dsp-serve,
// llama.cpp's llama-server, vLLM), with `vllm bench serve`'s flags and definitions: N streamed
// requests, sent all at once, at Poisson arrivals of --request-rate, and/or at most
// --max-concurrency in flight; it prints vllm's summary (throughput; mean, median and
// percentiles of TTFT, TPOT, ITL) and writes it with the per-request figures as JSON.
// The definitions are in serving_client.hpp's header; percentiles are numpy's default (linear
// interpolation), as vllm's.
//
// Load-test mode (the fault test of dsp-serve): --malformed-fraction F replaces requests by bad
// ones (not JSON, a field of the wrong type, over --max-model-len, an unknown model, an empty
// prompt), each of which must get a 4xx with OpenAI's error JSON; --disconnect-fraction F makes
// requests close their connection after 1-3 chunks; --write-outputs records every prompt's
// output, --expected-outputs checks a later run against it (greedy decoding: the same prompt
// gives the same text whatever else runs); --expect-metric dsp:kv_cache_used_blocks=0 checks
// /metrics after the run. The exit status is 1 when a valid request failed, a malformed one got
// anything but a 4xx with error JSON, an output differed, or an expected metric was not seen.
//
//   bench_serving --base-url http://127.0.0.1:8000 --model demo --num-prompts 200
//       --max-concurrency 16 --random-input-len 64 --random-output-len 32
//       --save-result --result-filename out.json
//
// Sends to 127.0.0.1 (loopback) only; every request has a timeout and the run a fixed number
// of requests.
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <sstream>

#include <CLI/CLI.hpp>

#include "serving_client.hpp"

namespace {

using namespace bench_serving;

struct Flags {
  std::string base_url, host = "127.0.0.1";
  int port = 8000;
  std::string request_rate = "inf";
  std::string save_dir, result_filename, label, expected_outputs, write_outputs;
  bool save_result = false;
  double ready_check_timeout_s = 600;
  std::vector<std::string> expect_metrics;
  double expect_metric_timeout_s = 10;
  std::string percentile_metrics = "ttft,tpot,itl", metric_percentiles = "99";
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

// "99" -> "99", "99.9" -> "99.9" (vllm's p_word)
std::string p_word(double p) {
  std::ostringstream os;
  os << p;
  return os.str();
}

// vllm's lines: "{:<40} {:<10}" and a title centred in 50 characters of `fill`.
void line(const std::string& name, const std::string& value) { std::printf("%-40s %-10s\n", name.c_str(), value.c_str()); }
std::string fixed(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}
void title(const std::string& s, char fill) {
  const std::size_t width = 50, left = s.size() >= width ? 0 : (width - s.size()) / 2;
  const std::size_t right = s.size() >= width ? 0 : width - s.size() - left;
  std::printf("%s%s%s\n", std::string(left, fill).c_str(), s.c_str(), std::string(right, fill).c_str());
}

void print_summary(const Run& run, const Summary& s, const std::vector<std::string>& metrics) {
  const Options& o = run.options;
  title(" Serving Benchmark Result ", '=');
  line("Successful requests:", std::to_string(s.completed));
  line("Failed requests:", std::to_string(s.failed));
  if (o.max_concurrency > 0) line("Maximum request concurrency:", std::to_string(o.max_concurrency));
  if (std::isfinite(o.request_rate)) line("Request rate configured (RPS):", fixed(o.request_rate));
  line("Benchmark duration (s):", fixed(run.duration));
  line("Total input tokens:", std::to_string(s.total_input));
  line("Total generated tokens:", std::to_string(s.total_output));
  line("Request throughput (req/s):", fixed(s.request_throughput));
  line("Output token throughput (tok/s):", fixed(s.output_throughput));
  line("Peak output token throughput (tok/s):", fixed(s.peak_output_throughput));
  line("Peak concurrent requests:", std::to_string(run.peak_concurrency));
  line("Total Token throughput (tok/s):", fixed(s.total_token_throughput));
  const auto section = [&](const std::string& key, const std::string& heading, const std::string& name, const Distribution& d) {
    if (std::find(metrics.begin(), metrics.end(), key) == metrics.end()) return;
    title(heading, '-');
    line("Mean " + name + " (ms):", fixed(d.mean));
    line("Median " + name + " (ms):", fixed(d.median));
    for (const auto& [p, v] : d.percentiles) line("P" + p_word(p) + " " + name + " (ms):", fixed(v));
  };
  section("ttft", "Time to First Token", "TTFT", s.ttft);
  section("tpot", "Time per Output Token (excl. 1st token)", "TPOT", s.tpot);
  section("itl", "Inter-token Latency", "ITL", s.itl);
  section("e2el", "End-to-end Latency", "E2EL", s.e2el);
  if (s.malformed_sent > 0 || s.disconnect_sent > 0) {
    title("Load test", '-');
    line("Malformed requests sent:", std::to_string(s.malformed_sent));
    line("  answered 4xx with error JSON:", std::to_string(s.malformed_ok));
    line("  answered otherwise:", std::to_string(s.malformed_other));
    for (const auto& [kind, statuses] : s.malformed_statuses) {
      std::string counts;
      for (const auto& [status, count] : statuses)
        counts += (counts.empty() ? "" : ", ") + (status == 0 ? std::string("none") : std::to_string(status)) + " x" + std::to_string(count);
      line("    " + kind + ":", counts);
    }
    line("Disconnecting requests sent:", std::to_string(s.disconnect_sent));
    line("  closed after 1-3 chunks:", std::to_string(s.disconnect_done));
    line("  finished before their cut:", std::to_string(s.disconnect_finished_first));
    line("  failed before their cut:", std::to_string(s.disconnect_failed));
  }
  if (s.reference_given || s.repeat_mismatches > 0 || o.num_distinct_prompts > 0) {
    title("Outputs", '-');
    if (s.reference_given) {
      line("Checked against the reference:", std::to_string(s.outputs_checked));
      line("Mismatches against the reference:", std::to_string(s.output_mismatches));
      line("Without a reference:", std::to_string(s.outputs_unchecked));
    }
    line("Repeats differing from the first:", std::to_string(s.repeat_mismatches));
  }
  title("", '=');
}

void distribution_json(const std::string& key, const Distribution& d, Json& j) {
  j["mean_" + key + "_ms"] = d.mean;
  j["median_" + key + "_ms"] = d.median;
  j["std_" + key + "_ms"] = d.std;
  for (const auto& [p, v] : d.percentiles) j["p" + p_word(p) + "_" + key + "_ms"] = v;
}

Json result_json(const Run& run, const Summary& s, const std::string& label, const std::string& date,
                 const DatasetConfig& dataset) {
  const Options& o = run.options;
  Json j;
  j["date"] = date;
  j["endpoint_type"] = o.chat() ? "openai-chat" : "openai";
  j["label"] = label;
  j["model_id"] = o.model;
  j["base_url"] = "http://" + o.target.host + ":" + std::to_string(o.target.port) + o.target.base_path;
  j["endpoint"] = o.endpoint;
  j["num_prompts"] = o.num_prompts;
  j["num_distinct_prompts"] = o.num_distinct_prompts > 0 ? o.num_distinct_prompts : o.num_prompts;
  j["request_rate"] = std::isfinite(o.request_rate) ? Json(o.request_rate) : Json("inf");
  j["burstiness"] = o.burstiness;
  j["max_concurrency"] = o.max_concurrency > 0 ? Json(o.max_concurrency) : Json(nullptr);
  j["seed"] = o.seed;
  j["dataset_name"] = dataset.name;
  j["dataset_path"] = dataset.path;
  j["random_input_len"] = dataset.input_len;
  j["random_output_len"] = dataset.output_len;
  j["random_range_ratio"] = dataset.range_ratio;
  j["prompt_token_ids"] = o.prompt_token_ids;
  j["ignore_eos"] = o.ignore_eos;
  j["duration"] = run.duration;
  j["completed"] = s.completed;
  j["failed"] = s.failed;
  j["total_input_tokens"] = s.total_input;
  j["total_output_tokens"] = s.total_output;
  j["request_throughput"] = s.request_throughput;
  j["request_goodput"] = nullptr;
  j["output_throughput"] = s.output_throughput;
  j["total_token_throughput"] = s.total_token_throughput;
  j["max_output_tokens_per_s"] = s.peak_output_throughput;
  j["max_concurrent_requests"] = run.peak_concurrency;
  j["percentile_method"] = "numpy.percentile default (linear interpolation between closest ranks)";
  distribution_json("ttft", s.ttft, j);
  distribution_json("tpot", s.tpot, j);
  distribution_json("itl", s.itl, j);
  distribution_json("e2el", s.e2el, j);
  // per request, in the order of the plan (seconds, as vllm)
  Json kinds = Json::array(), statuses = Json::array(), starts = Json::array(), input_lens = Json::array(),
       output_lens = Json::array(), ttfts = Json::array(), itls = Json::array(), e2els = Json::array(),
       texts = Json::array(), errors = Json::array(), elapsed = Json::array();
  for (std::size_t i = 0; i < run.plan.size(); ++i) {
    const PlannedRequest& q = run.plan[i];
    const RequestResult& r = run.results[i];
    kinds.push_back(q.kind == RequestKind::Malformed ? std::string("malformed:") + malformed_name(q.malformed) : kind_name(q.kind));
    statuses.push_back(r.status);
    starts.push_back(r.start);
    const bool valid = q.kind != RequestKind::Malformed;
    input_lens.push_back(!valid ? 0 : r.prompt_tokens >= 0 ? r.prompt_tokens : static_cast<std::int64_t>(run.prompts[q.prompt].text.size()));
    output_lens.push_back(r.success ? r.output_tokens() : 0);
    ttfts.push_back(r.ttft);
    itls.push_back(r.itl);
    e2els.push_back(r.latency);
    elapsed.push_back(r.elapsed);
    texts.push_back(r.text);
    errors.push_back(r.success ? std::string() : r.error);
  }
  j["kinds"] = kinds;
  j["statuses"] = statuses;
  j["start_times"] = starts;
  j["input_lens"] = input_lens;
  j["output_lens"] = output_lens;
  j["ttfts"] = ttfts;
  j["itls"] = itls;
  j["e2els"] = e2els;
  j["request_durations"] = elapsed;  // send -> the end of the answer or the failure, every request
  j["generated_texts"] = texts;
  j["errors"] = errors;
  j["load_test"] = {{"malformed_sent", s.malformed_sent},
                    {"malformed_answered_4xx_error_json", s.malformed_ok},
                    {"malformed_answered_otherwise", s.malformed_other},
                    {"disconnect_sent", s.disconnect_sent},
                    {"disconnect_done", s.disconnect_done},
                    {"disconnect_finished_first", s.disconnect_finished_first},
                    {"disconnect_failed", s.disconnect_failed}};
  Json by_kind = Json::object();
  for (const auto& [kind, st] : s.malformed_statuses)
    for (const auto& [status, count] : st) by_kind[kind][std::to_string(status)] = count;
  j["load_test"]["malformed_statuses"] = by_kind;
  j["outputs"] = {{"reference_given", s.reference_given},
                  {"checked", s.outputs_checked},
                  {"mismatches", s.output_mismatches},
                  {"without_reference", s.outputs_unchecked},
                  {"repeat_mismatches", s.repeat_mismatches}};
  j["passed"] = s.passed();
  return j;
}

std::string now_string() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", &tm);
  return buf;
}

// Waits until the server answers a valid request (vllm's initial test run, with its
// --ready-check-timeout-sec): retries while nothing listens, the server answers 503 (or,
// without --model, /v1/models lists no model), once a second, until the timeout; throws when it passes or when
// the server answers the test request with an error.
void wait_until_ready(Options& o, const Prompt& prompt, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  std::string last;
  for (int attempt = 0;; ++attempt) {
    if (o.model.empty()) o.model = discover_model(o.target);
    if (!o.model.empty()) {
      RequestSpec spec{o.endpoint, valid_body(o, prompt).dump(), o.chat(), 0, o.request_timeout_s};
      const RequestResult r = send_request(o.target, spec, Clock::now());
      if (r.success) return;
      // nothing listening yet, or 503 (llama-server while it loads the model): try again
      DSP_CHECK_AS(dsp::InputError, r.status == 0 || r.status == 503, "the initial test request failed (is --model right? the ",
                   "lengths within --max-model-len?): ", r.error);
      last = r.error;
    } else {
      last = "no --model given and GET /v1/models lists none";
    }
    DSP_CHECK_AS(dsp::InputError, Clock::now() < deadline, "the server at ", o.target.host, ":", o.target.port,
                 " is not ready after ", timeout_s, " s (--ready-check-timeout-sec): ", last);
    if (attempt == 0) std::fprintf(stderr, "waiting for the server at %s:%d ...\n", o.target.host.c_str(), o.target.port);
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // a server that closes first must not end this process
  CLI::App app{"Load client for OpenAI-compatible servers on 127.0.0.1 (vllm bench serve's flags and definitions)"};
  app.name("bench_serving");
  Flags f;
  Options o;
  DatasetConfig dataset;
  app.add_option("--base-url", f.base_url, "server URL, http://127.0.0.1:PORT (overrides --host/--port)");
  app.add_option("--host", f.host, "server host (loopback only)")->capture_default_str();
  app.add_option("--port", f.port, "server port")->capture_default_str();
  app.add_option("--endpoint", o.endpoint, "/v1/completions or /v1/chat/completions")->capture_default_str();
  app.add_option("--model", o.model, "model name sent (default: the first of GET /v1/models)");
  app.add_option("--api-key", o.target.api_key, "sent as 'Authorization: Bearer KEY'");
  app.add_option("--num-prompts", o.num_prompts, "requests to send")->capture_default_str()->check(CLI::Range(1, 10000000));
  app.add_option("--request-rate", f.request_rate, "requests per second, Poisson arrivals; inf: all at once")->capture_default_str();
  app.add_option("--burstiness", o.burstiness, "gamma shape of the arrival gaps (1: Poisson; smaller: burstier)")->capture_default_str();
  app.add_option("--max-concurrency", o.max_concurrency, "requests in flight at most (default: all, at most 1024)")
      ->check(CLI::Range(1, 100000));
  app.add_option("--seed", o.seed, "seed of the prompts, lengths, arrivals and fault choice")->capture_default_str();
  app.add_option("--dataset-name", dataset.name, "random (printable ASCII) or corpus (cuts of --dataset-path)")
      ->capture_default_str()
      ->check(CLI::IsMember({"random", "corpus"}));
  app.add_option("--dataset-path", dataset.path, "corpus: a UTF-8 text file, e.g. data/tinyshakespeare.txt");
  app.add_option("--random-input-len", dataset.input_len, "prompt length in bytes (byte-level models: tokens)")->capture_default_str();
  app.add_option("--random-output-len", dataset.output_len, "max_tokens of each request")->capture_default_str();
  app.add_option("--random-range-ratio", dataset.range_ratio, "lengths uniform in [L(1-r), L(1+r)]")->capture_default_str();
  app.add_option("--num-distinct-prompts", o.num_distinct_prompts, "prompt pool size, cycled (default: one per request)");
  app.add_flag("--prompt-token-ids", o.prompt_token_ids, "send prompts as arrays of token ids (the bytes: byte-level models)");
  app.add_flag("--ignore-eos", o.ignore_eos, "send ignore_eos: true");
  app.add_option("--request-timeout", o.request_timeout_s, "seconds a request may take at most")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--ready-check-timeout-sec", f.ready_check_timeout_s, "seconds to wait for the server to answer a test request")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--save-result", f.save_result, "write the result JSON");
  app.add_option("--result-dir", f.save_dir, "folder of the result JSON");
  app.add_option("--result-filename", f.result_filename, "result JSON file (default: LABEL-RATEqps[-concurrencyC]-MODEL-DATE.json)");
  app.add_option("--label", f.label, "name of the server in the results (e.g. dsp-serve, llama-server)");
  app.add_option("--percentile-metrics", f.percentile_metrics, "metrics printed: of ttft,tpot,itl,e2el")->capture_default_str();
  app.add_option("--metric-percentiles", f.metric_percentiles, "percentiles printed and saved, e.g. 50,90,99")->capture_default_str();
  app.add_option("--malformed-fraction", o.malformed_fraction, "fraction of requests replaced by malformed ones (load test)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--disconnect-fraction", o.disconnect_fraction, "fraction of requests that disconnect after 1-3 chunks (load test)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--max-model-len", o.max_model_len, "the server's max model len, for over-length requests (default: /v1/models')");
  app.add_option("--expected-outputs", f.expected_outputs, "JSON of reference outputs to check the outputs against");
  app.add_option("--write-outputs", f.write_outputs, "write the outputs as reference JSON (prompt -> {max_tokens, text})");
  app.add_option("--expect-metric", f.expect_metrics,
                 "NAME=VALUE: after the run, GET /metrics must show this (e.g. dsp:kv_cache_used_blocks=0; a name without "
                 "labels sums its series); repeatable");
  app.add_option("--expect-metric-timeout", f.expect_metric_timeout_s, "seconds to wait for --expect-metric to hold")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (f.base_url.empty()) f.base_url = "http://" + (f.host.find(':') != std::string::npos ? "[" + f.host + "]" : f.host) + ":" + std::to_string(f.port);
    const std::string key = o.target.api_key;
    o.target = parse_base_url(f.base_url);
    o.target.api_key = key;
    DSP_CHECK_AS(dsp::InputError, o.endpoint.starts_with("/"), "--endpoint must start with '/', got '", o.endpoint, "'");
    DSP_CHECK_AS(dsp::InputError, !(o.prompt_token_ids && o.chat()), "--prompt-token-ids needs /v1/completions (chat messages are text)");
    if (f.request_rate == "inf" || f.request_rate == "Infinity") {
      o.request_rate = std::numeric_limits<double>::infinity();
    } else {
      std::size_t used = 0;
      try {
        o.request_rate = std::stod(f.request_rate, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      DSP_CHECK_AS(dsp::InputError, used == f.request_rate.size() && o.request_rate > 0, "--request-rate must be > 0 or inf, got '",
                   f.request_rate, "'");
    }
    const std::vector<std::string> metrics = split(f.percentile_metrics, ',');
    for (const std::string& m : metrics)
      DSP_CHECK_AS(dsp::InputError, m == "ttft" || m == "tpot" || m == "itl" || m == "e2el", "--percentile-metrics: unknown metric '", m,
                   "' (ttft, tpot, itl, e2el)");
    std::vector<double> ps;
    for (const std::string& p : split(f.metric_percentiles, ',')) {
      std::size_t used = 0;
      double v = -1;
      try {
        v = std::stod(p, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      DSP_CHECK_AS(dsp::InputError, used == p.size() && v > 0 && v < 100, "--metric-percentiles: '", p, "' is not in (0, 100)");
      ps.push_back(v);
    }
    std::vector<MetricExpectation> expectations;
    for (const std::string& e : f.expect_metrics) {
      const std::size_t eq = e.rfind('=');
      std::size_t used = 0;
      double v = 0;
      try {
        if (eq != std::string::npos) v = std::stod(e.substr(eq + 1), &used);
      } catch (const std::exception&) {
        used = 0;
      }
      DSP_CHECK_AS(dsp::InputError, eq != std::string::npos && eq > 0 && used > 0 && used == e.size() - eq - 1,
                   "--expect-metric must be NAME=VALUE, got '", e, "'");
      expectations.push_back({e.substr(0, eq), v, std::nullopt});
    }
    dataset.seed = o.seed;
    const std::size_t pool = o.num_distinct_prompts > 0 ? std::min(o.num_distinct_prompts, o.num_prompts) : o.num_prompts;
    std::vector<Prompt> prompts = make_prompts(dataset, pool);
    const References references = f.expected_outputs.empty() ? References{} : read_references(f.expected_outputs);

    wait_until_ready(o, prompts[0], f.ready_check_timeout_s);
    const std::int64_t server_len = discover_max_model_len(o.target);
    if (o.max_model_len == 0 && o.malformed_fraction > 0) {
      o.max_model_len = server_len;
      if (o.max_model_len == 0)
        std::fprintf(stderr, "note: no --max-model-len and /v1/models reports none: no over-length requests among the malformed\n");
    }
    if (const std::int64_t len = o.max_model_len > 0 ? o.max_model_len : server_len; len > 0) {
      std::size_t over = 0;
      for (const Prompt& p : prompts) over += static_cast<std::int64_t>(p.text.size()) + p.output_len > len;
      if (over > 0)
        std::fprintf(stderr, "warning: %zu of %zu prompts have bytes + max_tokens over max model len %lld: a byte-level server refuses them\n",
                     over, prompts.size(), static_cast<long long>(len));
    }
    const std::vector<PlannedRequest> plan = plan_requests(o, prompts.size());

    std::printf("Model: %s, endpoint %s%s, %zu prompts (%zu distinct)\n", o.model.c_str(), f.base_url.c_str(), o.endpoint.c_str(),
                o.num_prompts, prompts.size());
    std::printf("Traffic request rate: %s\n", std::isfinite(o.request_rate) ? fixed(o.request_rate).c_str() : "inf");
    std::printf("Burstiness factor: %s%s\n", fixed(o.burstiness).c_str(), o.burstiness == 1 ? " (Poisson process)" : "");
    std::printf("Maximum request concurrency: %s\n", o.max_concurrency > 0 ? std::to_string(o.max_concurrency).c_str() : "None");
    std::fflush(stdout);

    const Run run = run_requests(o, std::move(prompts), plan);
    const Summary s = summarize(run, f.expected_outputs.empty() ? nullptr : &references, ps);
    print_summary(run, s, metrics);
    const bool metrics_met = expectations.empty() || wait_for_metrics(o.target, expectations, f.expect_metric_timeout_s);
    for (const MetricExpectation& e : expectations)
      line("Metric " + e.name + ":", (e.seen ? fixed(*e.seen) : std::string("not found")) + " (expected " + fixed(e.expected) +
                                          (e.met() ? ")" : ", NOT MET)"));
    std::fflush(stdout);  // the summary before the problems when both go to one file
    for (const std::string& p : s.problems) std::fprintf(stderr, "problem: %s\n", p.c_str());

    const std::string date = now_string();
    if (f.save_result || !f.result_filename.empty()) {
      std::string name = f.result_filename;
      if (name.empty()) {
        std::string model = o.model;
        std::replace(model.begin(), model.end(), '/', '_');
        name = (f.label.empty() ? "dsp" : f.label) + "-" + (std::isfinite(o.request_rate) ? p_word(o.request_rate) : "inf") + "qps" +
               (o.max_concurrency > 0 ? "-concurrency" + std::to_string(o.max_concurrency) : "") + "-" + model + "-" + date + ".json";
      }
      const std::filesystem::path path = f.save_dir.empty() ? std::filesystem::path(name) : std::filesystem::path(f.save_dir) / name;
      if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
      std::ofstream out(path);
      DSP_CHECK_AS(dsp::InputError, out.good(), "result file '", path.string(), "' cannot be written");
      out << result_json(run, s, f.label, date, dataset).dump(1, ' ', false, Json::error_handler_t::replace) << '\n';
      DSP_CHECK_AS(dsp::InputError, out.good(), "result file '", path.string(), "': write failed");
      std::printf("result written to %s\n", path.string().c_str());
    }
    if (!f.write_outputs.empty()) {
      const References refs = references_of(run);
      write_references(f.write_outputs, refs);
      std::printf("%zu reference outputs written to %s\n", refs.size(), f.write_outputs.c_str());
    }
    if (!metrics_met) {
      std::fprintf(stderr, "bench_serving: FAILED (--expect-metric not met after %g s)\n", f.expect_metric_timeout_s);
      return 1;
    }
    if (!s.passed()) {
      std::fprintf(stderr, "bench_serving: FAILED (%zu failed, %zu malformed answered otherwise, %zu disconnecting failed, "
                   "%zu mismatches, %zu repeat mismatches, %zu without reference)\n",
                   s.failed, s.malformed_other, s.disconnect_failed, s.output_mismatches, s.repeat_mismatches, s.outputs_unchecked);
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
