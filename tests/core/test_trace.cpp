// core/trace: the timeline recorder (spans, recording window, Chrome trace, gathering every
// rank's events into one file) and the spans the communicator records (collectives on the
// calling or worker thread, blocking waits).
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "dsp/comm/launch.hpp"
#include "dsp/core/trace.hpp"

namespace trace = dsp::trace;

namespace core_trace_test {

namespace {

// Records the calling thread's rank for the scope of a test, starting from no events.
struct Recording {
  Recording() {
    trace::clear();
    trace::start();
  }
  ~Recording() {
    trace::stop();
    trace::clear();
  }
};

std::vector<std::string> names(const std::vector<trace::Event>& evs) {
  std::vector<std::string> n;
  for (const auto& e : evs) n.push_back(e.name);
  return n;
}

const trace::Event* find(const std::vector<trace::Event>& evs, int rank, const std::string& name) {
  for (const auto& e : evs)
    if (e.rank == rank && e.name == name) return &e;
  return nullptr;
}

}  // namespace

TEST_CASE("spans nest and carry the thread's rank, track, kind, name and args") {
  trace::set_thread_rank(3, "main");
  {
    Recording rec;
    {
      trace::Span outer("outer", trace::Kind::Compute, {{"bytes", 7}});
      trace::Span inner("inner", trace::Kind::Comm);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const auto evs = trace::events();
    REQUIRE(evs.size() == 2);
    const auto& inner = evs[0];  // ends first
    const auto& outer = evs[1];
    CHECK(inner.name == "inner");
    CHECK(outer.name == "outer");
    CHECK(inner.kind == trace::Kind::Comm);
    CHECK(outer.kind == trace::Kind::Compute);
    CHECK(inner.rank == 3);
    CHECK(outer.rank == 3);
    CHECK(inner.track == "main");
    CHECK(inner.tid == outer.tid);
    CHECK(outer.begin_us <= inner.begin_us);
    CHECK(inner.end_us <= outer.end_us);
    CHECK(inner.end_us - inner.begin_us >= 2000.0);  // microseconds
    REQUIRE(outer.args.size() == 1);
    CHECK(std::string(outer.args[0].key) == "bytes");
    CHECK(outer.args[0].value == 7);
    CHECK(inner.args.empty());
  }
  trace::set_thread_rank(0);
}

TEST_CASE("nothing is recorded while tracing is off") {
  trace::clear();
  CHECK_FALSE(trace::enabled());
  { trace::Span s("ignored", trace::Kind::Compute); }
  CHECK(trace::events().empty());
}

TEST_CASE("start and stop bound the recording window of the calling thread's rank") {
  trace::set_thread_rank(0);
  trace::clear();
  { trace::Span s("before", trace::Kind::Compute); }
  trace::start();
  CHECK(trace::enabled());
  { trace::Span s("during", trace::Kind::Compute); }
  std::optional<trace::Span> open;
  open.emplace("open_at_stop", trace::Kind::Compute);
  trace::stop();
  open.reset();  // ends after stop: dropped
  CHECK_FALSE(trace::enabled());
  { trace::Span s("after", trace::Kind::Compute); }
  trace::start();
  trace::start();  // already recording: no effect
  { trace::Span s("again", trace::Kind::Compute); }
  std::thread other([] {  // rank 1 does not record while only rank 0 does
    trace::set_thread_rank(1);
    trace::Span s("other_rank", trace::Kind::Compute);
  });
  other.join();
  trace::stop();
  CHECK(names(trace::events()) == std::vector<std::string>{"during", "again"});
  trace::clear();
}

TEST_CASE("the Chrome trace parses and has the Trace Event Format fields") {
  trace::set_thread_rank(2, "main");
  const std::string path = "/tmp/dsp_test_trace_" + std::to_string(::getpid()) + ".json";
  {
    Recording rec;
    {
      trace::Span outer("forward", trace::Kind::Compute);
      trace::Span inner("all_reduce", trace::Kind::Comm, {{"bytes", 64}});
    }
    { trace::Span idle("wait", trace::Kind::Idle); }
    trace::write_chrome_trace(path);
  }
  trace::set_thread_rank(0);
  std::ifstream f(path);
  const auto j = nlohmann::json::parse(f);
  std::remove(path.c_str());
  REQUIRE(j.contains("traceEvents"));
  std::vector<nlohmann::json> complete, meta;
  for (const auto& e : j["traceEvents"]) (e["ph"] == "X" ? complete : meta).push_back(e);
  REQUIRE(complete.size() == 3);
  for (const auto& e : complete) {
    for (const char* key : {"name", "cat", "ts", "dur", "pid", "tid", "args"}) CHECK(e.contains(key));
    CHECK(e["pid"] == 2);
    CHECK(e["dur"].get<double>() >= 0.0);
  }
  // sorted by start, parents before the children they contain
  CHECK(complete[0]["name"] == "forward");
  CHECK(complete[0]["cat"] == "compute");
  CHECK(complete[1]["name"] == "all_reduce");
  CHECK(complete[1]["cat"] == "comm");
  CHECK(complete[1]["args"]["bytes"] == 64);
  CHECK(complete[2]["cat"] == "idle");
  CHECK(complete[0]["ts"].get<double>() <= complete[1]["ts"].get<double>());
  auto has_meta = [&](const std::string& what, const std::string& value) {
    return std::any_of(meta.begin(), meta.end(), [&](const nlohmann::json& e) {
      return e["ph"] == "M" && e["name"] == what && e["pid"] == 2 && e["args"]["name"] == value;
    });
  };
  CHECK(has_meta("process_name", "rank 2"));
  CHECK(has_meta("thread_name", "main"));
}

TEST_CASE("ThreadComm records collectives on the worker track and blocking waits as idle") {
  trace::clear();
  constexpr std::size_t n = 1000;
  dsp::comm::launch(2, [&](dsp::comm::ThreadComm& world) {
    CHECK(trace::thread_rank() == world.rank());  // launch set it
    trace::start();
    std::vector<float> data(n, 1.0f);
    if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 0 must wait
    auto work = world.all_reduce_async(std::span<float>(data));
    work.wait();
    CHECK(data[0] == 2.0f);
    world.barrier();  // synchronous: on the calling thread
    std::vector<float> msg(4, 1.0f);
    if (world.rank() == 0) world.send(std::span<const float>(msg), 1);
    else world.recv_async(std::span<float>(msg), 0).wait();
    trace::stop();
  });
  const auto evs = trace::events();
  trace::clear();
  for (int rank : {0, 1}) {
    CAPTURE(rank);
    const auto* ar = find(evs, rank, "all_reduce");
    const auto* bar = find(evs, rank, "barrier");
    REQUIRE(ar);
    REQUIRE(bar);
    CHECK(ar->kind == trace::Kind::Comm);
    CHECK(ar->track == "comm");
    REQUIRE(ar->args.size() == 1);
    CHECK(ar->args[0].value == static_cast<std::int64_t>(n * sizeof(float)));
    CHECK(bar->track == "main");
    CHECK(bar->tid != ar->tid);
  }
  const auto* wait = find(evs, 0, "wait:all_reduce");
  REQUIRE(wait);
  CHECK(wait->kind == trace::Kind::Idle);
  CHECK(wait->track == "main");
  CHECK(wait->end_us - wait->begin_us > 100e3);  // rank 1 joined 200 ms late
  const auto* recv = find(evs, 1, "recv");
  REQUIRE(recv);
  CHECK(recv->track == "p2p");
  CHECK(recv->args[0].value == static_cast<std::int64_t>(4 * sizeof(float)));
}

TEST_CASE("writing the trace to an unwritable path throws InputError naming the path") {
  const std::string path = "/nonexistent-dsp-dir/trace.json";
  CHECK_THROWS_WITH_AS(trace::write_chrome_trace(path), doctest::Contains(path.c_str()), dsp::InputError);
}

TEST_CASE("events survive serialisation for the gather: every field, argument keys included") {
  trace::Event e{"layers.1.forward", trace::Kind::Idle, 5, 17, "comm", 1.5e12, 1.5e12 + 250.25, {}};
  e.args.push_back({"bytes", 1LL << 40});
  e.args.push_back({"some_key", -3});
  const auto back = trace::detail::deserialize(trace::detail::serialize({e, trace::Event{}}));
  REQUIRE(back.size() == 2);
  const auto& b = back[0];
  CHECK(b.name == e.name);
  CHECK(b.kind == e.kind);
  CHECK(b.rank == 5);
  CHECK(b.tid == 17);
  CHECK(b.track == "comm");
  CHECK(b.begin_us == e.begin_us);  // doubles travel exactly
  CHECK(b.end_us == e.end_us);
  REQUIRE(b.args.size() == 2);
  CHECK(std::string(b.args[0].key) == "bytes");
  CHECK(b.args[0].value == (1LL << 40));
  CHECK(std::string(b.args[1].key) == "some_key");
  CHECK(b.args[1].value == -3);
  CHECK(back[1].args.empty());
}

TEST_CASE("write_chrome_trace(world, path) with ThreadComm: every rank once, nothing duplicated") {
  const std::string path = "/tmp/dsp_test_trace_world_" + std::to_string(::getpid()) + ".json";
  trace::clear();
  constexpr int ranks = 3;
  dsp::comm::launch(ranks, [&](dsp::comm::ThreadComm& world) {
    trace::start();
    {
      trace::Span outer("step", trace::Kind::Compute, {{"rank", world.rank()}});
      trace::Span inner("inner", trace::Kind::Compute);
    }
    trace::stop();
    trace::write_chrome_trace(world, path);  // collective: rank 0 writes
  });
  trace::clear();
  std::ifstream f(path);
  REQUIRE(f.good());
  const auto j = nlohmann::json::parse(f);
  std::remove(path.c_str());
  std::vector<int> step_pids;
  int complete = 0;
  double min_ts = 1e300;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] != "X") continue;
    ++complete;
    min_ts = std::min(min_ts, e["ts"].get<double>());
    if (e["name"] == "step") {
      step_pids.push_back(e["pid"].get<int>());
      CHECK(e["args"]["rank"] == e["pid"]);
    }
  }
  std::sort(step_pids.begin(), step_pids.end());
  CHECK(step_pids == std::vector<int>{0, 1, 2});
  CHECK(complete == 2 * ranks);  // two spans per rank, each once
  CHECK(min_ts == 0.0);          // ts counts from the earliest event
}

}  // namespace core_trace_test
