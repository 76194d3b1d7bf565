// MpiComm's trace spans (named and sized as ThreadComm's; async: the issuing call and the
// idle wait) and trace::write_chrome_trace(world, path): rank 0 writes one file that holds
// every process's events, on one time base.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "dsp/comm/mpi_launch.hpp"
#include "dsp/core/trace.hpp"

using dsp::comm::MpiComm;
namespace trace = dsp::trace;

namespace {

const trace::Event* find(const std::vector<trace::Event>& evs, const std::string& name) {
  for (const auto& e : evs)
    if (e.name == name) return &e;
  return nullptr;
}

}  // namespace

TEST_CASE("MpiComm records every call as a comm span; a blocking async wait as wait:<op>") {
  MpiComm world = MpiComm::world();
  const int r = world.rank(), p = world.size();
  trace::set_thread_rank(r);
  trace::clear();
  trace::start();
  std::vector<float> x(100, 1.0f);
  world.all_reduce(std::span<float>(x));
  std::vector<float> gathered(x.size() * static_cast<std::size_t>(p));
  world.all_gather(std::span<const float>(x), std::span<float>(gathered));
  std::vector<float> part(4);
  std::vector<float> whole(part.size() * static_cast<std::size_t>(p), 1.0f);
  world.reduce_scatter(std::span<const float>(whole), std::span<float>(part));
  world.broadcast(std::span<float>(x), 0);
  std::vector<std::int64_t> ones(static_cast<std::size_t>(p), 1);
  std::vector<float> a2a_in(static_cast<std::size_t>(p), 1.0f), a2a_out(a2a_in.size());
  world.all_to_all_v(std::span<const float>(a2a_in), ones, std::span<float>(a2a_out), ones);
  std::vector<std::int32_t> msg(3, r);
  world.send(std::span<const std::int32_t>(msg), (r + 1) % p, 5);
  world.recv(std::span<std::int32_t>(msg), (r + p - 1) % p, 5);
  {
    MpiComm half = world.split(r % 2, r);
  }
  // rank 0 waits on an all-reduce that rank 1 joins 200 ms late: an idle span on rank 0
  if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  world.all_reduce_async(std::span<float>(x)).wait();
  world.barrier();
  trace::stop();
  const auto evs = trace::events();
  trace::clear();
  for (const char* name : {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all_v", "send", "recv",
                           "split", "barrier"}) {
    CAPTURE(name);
    const auto* e = find(evs, name);
    REQUIRE(e);
    CHECK(e->kind == trace::Kind::Comm);
    CHECK(e->rank == r);
    CHECK(e->track == "main");
    REQUIRE(e->args.size() == 1);
    CHECK(std::string(e->args[0].key) == "bytes");
  }
  CHECK(find(evs, "all_reduce")->args[0].value == 400);
  CHECK(find(evs, "all_gather")->args[0].value == 400 * p);  // the output, as ThreadComm
  CHECK(find(evs, "reduce_scatter")->args[0].value == 16 * p);  // the input, as ThreadComm
  CHECK(find(evs, "send")->args[0].value == 12);
  CHECK(find(evs, "barrier")->args[0].value == 0);
  CHECK(std::count_if(evs.begin(), evs.end(), [](const trace::Event& e) { return e.name == "all_reduce"; }) == 2);
  if (r == 0) {
    const auto* wait = find(evs, "wait:all_reduce");
    REQUIRE(wait);
    CHECK(wait->kind == trace::Kind::Idle);
    CHECK(wait->end_us - wait->begin_us > 100e3);
  }
}

TEST_CASE("write_chrome_trace(world, path): rank 0 writes every rank's events, on one time base") {
  MpiComm world = MpiComm::world();
  const int r = world.rank(), p = world.size();
  trace::set_thread_rank(r);
  std::int64_t pid = ::getpid();  // rank 0's: one path for every rank
  world.broadcast(std::span<std::int64_t>(&pid, 1), 0);
  const std::string path = "/tmp/dsp_mpi_trace_" + std::to_string(pid) + ".json";
  trace::clear();
  trace::start();
  {
    trace::Span work("work", trace::Kind::Compute, {{"rank", r}});
    std::this_thread::sleep_for(std::chrono::milliseconds(5 * r));
  }
  world.barrier();
  { trace::Span after("after_barrier", trace::Kind::Compute); }
  trace::stop();
  trace::write_chrome_trace(world, path);
  trace::clear();
  if (r != 0) return;
  std::ifstream f(path);
  REQUIRE(f.good());
  const auto j = nlohmann::json::parse(f);
  std::remove(path.c_str());
  std::map<int, std::multiset<std::string>> names;  // pid -> span names
  std::map<int, double> after_ts;
  double min_ts = 1e300;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const int q = e["pid"].get<int>();
    names[q].insert(e["name"].get<std::string>());
    min_ts = std::min(min_ts, e["ts"].get<double>());
    if (e["name"] == "work") CHECK(e["args"]["rank"] == q);
    if (e["name"] == "after_barrier") after_ts[q] = e["ts"].get<double>();
  }
  REQUIRE(static_cast<int>(names.size()) == p);  // every rank, each as its own process
  for (int q = 0; q < p; ++q) {
    CAPTURE(q);
    CHECK(names[q].count("work") == 1);  // once: nothing duplicated
    CHECK(names[q].count("after_barrier") == 1);
    CHECK(names[q].count("barrier") == 1);  // MpiComm's span, carried over too
  }
  CHECK(min_ts == 0.0);  // counted from the earliest event
  // one time base: every rank left the barrier at about the same time
  const auto [lo, hi] = std::minmax_element(after_ts.begin(), after_ts.end(),
                                            [](const auto& a, const auto& b) { return a.second < b.second; });
  CHECK(hi->second - lo->second < 50e3);  // microseconds
}
