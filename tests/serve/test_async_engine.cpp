// AsyncEngine: requests submitted from client threads while the engine steps on a TP2 group
// get exactly the tokens they get served alone (serve::Engine, TP2, nothing else in the batch); an abort ends its
// request and frees its blocks; a full queue and a draining engine refuse requests; drain ends
// run() on every rank once the last request finished; the metrics count what happened.
#include <doctest/doctest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dsp/serve/async_engine.hpp"
#include "engine_harness.hpp"

using namespace dsp;

namespace {

struct AsyncClientResult {
  std::vector<std::int32_t> tokens;
  std::string text;
  std::optional<serve::FinishReason> finish;
  int outputs = 0;
};

// Reads one request's outputs from `queue` until it finished (bounded: 60 s).
AsyncClientResult collect_outputs(serve::OutputQueue& queue, const std::function<void(const AsyncClientResult&)>& after_output = {}) {
  AsyncClientResult r;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!r.finish && std::chrono::steady_clock::now() < deadline) {
    for (const auto& out : queue.pop(std::chrono::milliseconds(100))) {
      r.tokens.insert(r.tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
      r.text += out.new_text;
      ++r.outputs;
      if (out.finish) r.finish = out.finish;
      if (after_output) after_output(r);
    }
  }
  return r;
}

}  // namespace

TEST_CASE("AsyncEngine: concurrent clients on TP2 get their solo tokens; abort, queue limit, drain, metrics") {
  serve::EngineConfig config;
  config.block_size = 4;
  config.max_num_seqs = 5;
  config.max_num_batched_tokens = 24;  // prompts are chunked while others decode
  constexpr int clients = 10, aborted = 3;
  std::vector<test::Arrival> solo;
  for (int i = 0; i < clients; ++i) {
    test::Arrival a;
    a.id = test::request_id(i);
    for (int t = 0; t < 3 + 7 * i; ++t) a.prompt.push_back(static_cast<std::int32_t>((5 * i + 3 * t) % 120));
    // The clients that hang up after 2 tokens ask for many more, so that the abort normally
    // lands first; one that lands after the last token finds the request finished by length.
    a.params.max_tokens = i >= clients - aborted ? 60 : 6 + i;
    if (i % 3 == 1) {
      a.params.temperature = 0.8f;
      a.params.seed = 11 + i;
    }
    solo.push_back(a);
  }
  std::map<std::string, std::vector<std::int32_t>> alone;
  for (const auto& a : solo) alone[a.id] = test::serve_requests(2, config, {a}).requests.at(a.id).tokens;

  std::map<int, AsyncClientResult> results;
  bool queue_full_refused = false, drain_refused = false;
  std::string metrics;
  std::int64_t used_blocks = -1;
  comm::launch(2, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = 2});
    model::CausalLM<test::ServeP> model(test::tiny_serving_model(), mesh, test::kServingSeed);
    serve::Engine<test::ServeP> engine(model, world, config);
    serve::AsyncEngine<test::ServeP> async(engine, world, {.max_queue = 8});
    std::thread driver_clients;
    if (world.rank() == 0) {
      driver_clients = std::thread([&] {
        // Three requests at once over a queue of 8 with nothing waiting fit; nine do not.
        std::vector<serve::NewRequest> nine(9, serve::NewRequest{{1, 2, 3}, {}});
        try {
          (void)async.submit(nine, std::make_shared<serve::OutputQueue>());
        } catch (const serve::ServerBusy&) {
          queue_full_refused = true;
        }
        std::vector<std::thread> threads;
        std::mutex m;
        for (int i = 0; i < clients; ++i)
          threads.emplace_back([&, i] {
            std::this_thread::sleep_for(std::chrono::milliseconds(3 * i));  // arrivals spread over steps
            auto queue = std::make_shared<serve::OutputQueue>();
            test::Arrival& a = solo[static_cast<std::size_t>(i)];
            // A full queue (a slow machine: 8 requests still without a first token) is retried,
            // as an OpenAI client retries a 503; bounded: 60 s.
            std::vector<std::string> ids;
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
            while (ids.empty() && std::chrono::steady_clock::now() < deadline) {
              try {
                ids = async.submit({{a.prompt, a.params}}, queue);
              } catch (const serve::ServerBusy&) {
                std::this_thread::sleep_for(std::chrono::milliseconds(2));
              }
            }
            if (ids.empty()) return;  // no result: the checks below fail
            const bool abort_it = i >= clients - aborted;
            AsyncClientResult r = collect_outputs(*queue, [&](const AsyncClientResult& so_far) {
              if (abort_it && so_far.tokens.size() == 2) async.abort(ids);  // a client that hangs up
            });
            const std::lock_guard lock(m);
            results[i] = std::move(r);
          });
        for (auto& t : threads) t.join();
        async.drain();
        try {
          (void)async.submit({{{1}, {}}}, std::make_shared<serve::OutputQueue>());
        } catch (const serve::ServerBusy&) {
          drain_refused = true;
        }
      });
    }
    async.run();  // every rank, until the drain
    if (world.rank() == 0) {
      driver_clients.join();
      metrics = async.metrics_text();
      used_blocks = async.stats().used_blocks;
    }
  });
  CHECK(queue_full_refused);
  CHECK(drain_refused);
  REQUIRE(results.size() == static_cast<std::size_t>(clients));
  int aborts = 0;
  for (int i = 0; i < clients; ++i) {
    CAPTURE(i);
    const AsyncClientResult& r = results.at(i);
    const auto& ref = alone.at(test::request_id(i));
    REQUIRE(r.finish.has_value());
    if (i >= clients - aborted && *r.finish == serve::FinishReason::Abort) {
      ++aborts;
      REQUIRE(r.tokens.size() >= 2);
      REQUIRE(r.tokens.size() <= ref.size());
      CHECK(std::equal(r.tokens.begin(), r.tokens.end(), ref.begin()));  // a prefix of its solo tokens
    } else {
      CHECK(*r.finish == serve::FinishReason::Length);
      CHECK(r.tokens == ref);
    }
  }
  CHECK(aborts >= 1);  // 58 tokens after the second: an abort lands first but on a stalled machine
  CHECK(used_blocks == 0);
  const auto has = [&](const std::string& line) { return metrics.find(line + "\n") != std::string::npos; };
  CHECK(has("dsp:request_success_total{finished_reason=\"length\"} " + std::to_string(clients - aborts)));
  CHECK(has("dsp:request_success_total{finished_reason=\"abort\"} " + std::to_string(aborts)));
  CHECK(has("dsp:time_to_first_token_seconds_count " + std::to_string(clients)));
  CHECK(has("dsp:e2e_request_latency_seconds_count " + std::to_string(clients)));
  CHECK(has("dsp:kv_cache_used_blocks 0"));
  CHECK(has("dsp:num_requests_running 0"));
}

TEST_CASE("AsyncEngine: the queue bound counts every request without its first token, across steps") {
  // --max-num-seqs 1 --max-queue 3: three requests fit before any step, a fourth does not;
  // once the first has its first token, one more fits (not before), and so on.
  serve::EngineConfig config;
  config.block_size = 4;
  config.max_num_seqs = 1;
  comm::launch(1, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{});
    model::CausalLM<test::ServeP> model(test::tiny_serving_model(), mesh, test::kServingSeed);
    serve::Engine<test::ServeP> engine(model, world, config);
    serve::AsyncEngine<test::ServeP> async(engine, world, {.max_queue = 3});
    auto queue = std::make_shared<serve::OutputQueue>();
    const serve::NewRequest r{{1, 2, 3}, {.max_tokens = 2}};
    CHECK(async.submit({r, r, r}, queue).size() == 3);
    CHECK(async.waiting() == 3);
    CHECK_THROWS_AS((void)async.submit({r}, queue), serve::ServerBusy);
    CHECK_THROWS_AS((void)async.submit({r, r, r, r}, std::make_shared<serve::OutputQueue>()), serve::ServerBusy);
    std::thread client([&] {
      std::int64_t accepted = 0;
      for (int tries = 0; tries < 20000 && accepted < 3; ++tries) {  // bounded: each try a few microseconds
        try {
          (void)async.submit({r}, queue);
          ++accepted;
          CHECK(async.waiting() <= 3);
        } catch (const serve::ServerBusy&) {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      }
      CHECK(accepted == 3);
      int finished = 0;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (finished < 6 && std::chrono::steady_clock::now() < deadline)
        for (const auto& out : queue->pop(std::chrono::milliseconds(50))) finished += out.finished() ? 1 : 0;
      CHECK(finished == 6);
      CHECK(async.waiting() == 0);
      async.drain();
    });
    async.run();
    client.join();
  });
}
