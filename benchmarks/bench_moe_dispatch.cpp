// MoE token dispatch and combine (ep::ExpertDispatcher over ThreadComm): throughput in GB/s of
// token payload against tokens per rank, hidden size, top-k and expert-parallel (EP) size, with
// balanced and skewed routing.
//
// Setup of one case (one comm::launch of n = EP ranks; the EP group is the whole world): every
// rank has T tokens x [H] fp32 activations x (x[t, h] = g + 1 + h / (2H), g = r T + t the global
// token: every token's row is distinct) and routes them with ep::route (softmax top-k, E = 64
// experts, no renormalisation, no capacity dropping: every assignment is kept) from logits that
// are 0 except 10 - j/2 at the expert wanted for slot j, so the router picks exactly these:
//   balanced  slot j of token g -> expert (g k + j) mod E: every expert, hence every EP rank,
//             gets the same number of rows (T k / E per expert per source rank).
//   skewed    assignment a = g k + j is "hot" when a mod 5 != 4 (80 %), and hot assignments go to
//             the E / n experts of EP rank 0 (round-robin over them), cold ones to the other
//             ranks' experts: rank 0 receives 80 % of all rows of the group (n x 0.8 x T k),
//             every other rank 20 % / (n - 1). Only at n >= 2 (at n = 1 every row stays local
//             and the dispatcher's work does not depend on which expert a row goes to).
// The experts are the identity: the combine input is the dispatch output.
//
// Timed phases, each on every rank from a common barrier (comm.barrier(); start = now):
//   dispatch    plan(routing) [counting sort + count all_to_all_v] + permute + dispatch
//               [payload all_to_all_v + regroup to expert-major]
//   combine     undispatch [regroup + payload all_to_all_v back] + combine [weighted sum into y]
//               of the rows that phase "dispatch" of the same iteration produced
//   round_trip  the five calls back to back: one MoE layer's forward without the experts
// phase time = max over ranks of its end - min over ranks of its start (as bench_collectives: until
// the last rank has its result), mean over the iterations. Tensors the calls return are freed
// after the phase's end, outside the timed span; the tensors the calls allocate (zero-filled,
// dsp::Tensor) are inside it. Google Benchmark's "Time" column is the round trip (manual time).
// One untimed round trip before the timed iterations warms up threads and allocator and is the
// checked run (below).
//
// Counters (GB = 1e9 B):
//   payload_MiB      per-rank token payload = assignments x H x 4 bytes, assignments = T k (all
//                    kept); MiB = 2^20 B
//   dispatch_GBps    payload / dispatch time   (PER RANK: each rank moves its own payload in
//   combine_GBps     payload / combine time     that time, so the group moves n x this; the
//   round_trip_GBps  payload / round-trip time  tables in RESULTS.md also show n x round trip)
//   dispatch_us, combine_us, round_trip_us   the mean phase times
//   plan_us, permute_us, a2a_us (dispatch()), undispatch_us, combine_rows_us (combine()): the
//                    calls inside the dispatch and combine phases, each timed on every rank, max
//                    over ranks, mean over iterations (a rank's collective call includes waiting
//                    for its peers, so on the ranks that wait these overlap the slow rank's work)
//   r0_share         rows EP rank 0's experts run / all assignments of the group (1/n balanced,
//                    ~0.8 skewed)
//   wrong            elements of y that differ from the closed form in the checked run, summed
//                    over ranks: with identity experts y[t] = (sum_j w[t, j]) x[t]; tolerance
//                    1e-5 relative (the k products are summed in plan order, the reference in
//                    slot order)
// Read the GB/s against the machine's copy bandwidth (bench_collectives' copy_bandwidth, in
// RESULTS.md): one dispatch copies the payload three times (permute, all_to_all_v, regroup) and
// zero-fills three payload-sized tensors: 9 bytes of memory traffic per payload byte; one combine
// zero-fills two and copies twice (undispatch), then reads every row and adds it into y
// (read + write), y [T, H] zero-filled: 9 + 1/k bytes per payload byte.
//
// Usage: bench_moe_dispatch [Google Benchmark flags]; --benchmark_counters_tabular=true for a
// table. Iterations are fixed per case (~256 MiB of group payload per case, 3..40 iterations;
// --benchmark_min_time does not change them): the default run takes ~50 s on 2 cores.
// The dispatcher allocates (and zero-fills) its outputs on every call, so glibc's malloc and the
// kernel's page faults are part of what this measures; RESULTS.md also shows a run with
//   GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736:glibc.malloc.arena_max=1
// (freed memory stays in the process and is reused: no fresh pages after the warm-up).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsp/comm/launch.hpp"
#include "dsp/ep/expert_dispatcher.hpp"
#include "dsp/ep/router.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using dsp::comm::ThreadComm;
double now_s() { return std::chrono::duration<double>(clock_type::now().time_since_epoch()).count(); }

constexpr std::int64_t kExperts = 64;  // E
constexpr double MiB = 1024.0 * 1024.0;
enum class Skew { Balanced, Skewed };

// Expert of slot j of global token g (see the header comment).
std::int32_t wanted_expert(Skew skew, int n, std::int64_t g, std::int64_t k, std::int64_t j) {
  if (skew == Skew::Balanced) return static_cast<std::int32_t>((g * k + j) % kExperts);
  const std::int64_t hot = kExperts / n, cold = kExperts - hot;
  // Hot slots of this token before j (and cold ones): consecutive indices, so a token's experts
  // are distinct (k <= hot, cold).
  std::int64_t before = 0;
  for (std::int64_t i = 0; i < j; ++i) before += (g * k + i) % 5 != 4;
  if ((g * k + j) % 5 != 4) return static_cast<std::int32_t>((g * k + before) % hot);
  return static_cast<std::int32_t>(hot + (g * k + (j - before)) % cold);
}

// Phases and the calls inside them (indices into the per-rank timing arrays).
enum Phase { kDispatch, kCombine, kRoundTrip, kPhases };
enum Call { kPlan, kPermute, kA2A, kUndispatch, kCombineRows, kCalls };

void moe_dispatch(benchmark::State& state, Skew skew) {
  const int n = static_cast<int>(state.range(0));
  const std::int64_t tokens = state.range(1), hidden = state.range(2), k = state.range(3);
  const std::int64_t assignments = tokens * k;
  const double payload = double(assignments) * double(hidden) * 4.0;  // bytes per rank

  // Shared between the rank threads: per-rank start / end of each phase and duration of each call.
  std::vector<double> start(std::size_t(n * kPhases)), end(std::size_t(n * kPhases)), call(std::size_t(n * kCalls));
  std::atomic<bool> go{false};
  std::atomic<std::int64_t> wrong{0}, r0_rows{0};
  double sum_phase[kPhases] = {0, 0, 0}, sum_call[kCalls] = {0, 0, 0, 0, 0};
  std::int64_t iterations = 0;
  try {
    dsp::comm::launch(n, [&](ThreadComm& world) {
      const int r = world.rank();
      // Inputs and routing (untimed).
      std::vector<float> logits(static_cast<std::size_t>(tokens * kExperts), 0.0f);
      std::vector<std::int32_t> want(static_cast<std::size_t>(assignments));
      for (std::int64_t t = 0; t < tokens; ++t)
        for (std::int64_t j = 0; j < k; ++j) {
          const std::int32_t e = wanted_expert(skew, n, r * tokens + t, k, j);
          want[std::size_t(t * k + j)] = e;
          logits[std::size_t(t * kExperts + e)] = 10.0f - 0.5f * float(j);
        }
      const dsp::ep::RouterConfig rc{.num_experts = kExperts, .top_k = k};
      const dsp::ep::Routing routing = dsp::ep::route(rc, std::span<const float>(logits));
      DSP_CHECK(routing.experts == std::vector<std::int32_t>(want), "bench_moe_dispatch: the router did not pick the intended experts");
      dsp::Tensor x({tokens, hidden});
      for (std::int64_t t = 0; t < tokens; ++t)
        for (std::int64_t h = 0; h < hidden; ++h)
          x[t * hidden + h] = float(r * tokens + t + 1) + 0.5f * float(h) / float(hidden);
      dsp::ep::ExpertDispatcher<ThreadComm> dispatcher(world, kExperts, hidden);

      // Warm-up round trip, checked.
      {
        const auto plan = dispatcher.plan(routing);
        const auto local = dispatcher.dispatch(plan, dispatcher.permute(plan, x));
        if (r == 0) r0_rows = plan.local_rows();
        const auto y = dispatcher.combine(plan, routing, dispatcher.undispatch(plan, local));
        std::int64_t bad = 0;
        for (std::int64_t t = 0; t < tokens; ++t) {
          double s = 0;
          for (std::int64_t j = 0; j < k; ++j) s += routing.weights[std::size_t(t * k + j)];
          for (std::int64_t h = 0; h < hidden; ++h) {
            const double want_y = s * double(x[t * hidden + h]);
            bad += !(std::abs(double(y[t * hidden + h]) - want_y) <= 1e-5 * std::abs(want_y));
          }
        }
        wrong += bad;
      }

      auto mark = [&](Phase p, double s, double e) {
        start[std::size_t(r * kPhases + p)] = s;
        end[std::size_t(r * kPhases + p)] = e;
      };
      double* my_call = call.data() + r * kCalls;
      for (;;) {
        if (r == 0) go.store(state.KeepRunning());
        world.barrier();
        if (!go.load()) break;
        // dispatch
        double t0 = now_s();
        auto plan = dispatcher.plan(routing);
        const double t1 = now_s();
        auto rows = dispatcher.permute(plan, x);
        const double t2 = now_s();
        auto local = dispatcher.dispatch(plan, rows);
        const double t3 = now_s();
        mark(kDispatch, t0, t3);
        my_call[kPlan] = t1 - t0, my_call[kPermute] = t2 - t1, my_call[kA2A] = t3 - t2;
        rows = dsp::Tensor();
        world.barrier();
        // combine (of this iteration's dispatched rows; the experts are the identity)
        t0 = now_s();
        auto back = dispatcher.undispatch(plan, local);
        const double t4 = now_s();
        auto y = dispatcher.combine(plan, routing, back);
        const double t5 = now_s();
        mark(kCombine, t0, t5);
        my_call[kUndispatch] = t4 - t0, my_call[kCombineRows] = t5 - t4;
        back = local = y = dsp::Tensor();
        world.barrier();
        // round trip
        t0 = now_s();
        {
          auto plan2 = dispatcher.plan(routing);
          auto rows2 = dispatcher.permute(plan2, x);
          auto local2 = dispatcher.dispatch(plan2, rows2);
          auto back2 = dispatcher.undispatch(plan2, local2);
          auto y2 = dispatcher.combine(plan2, routing, back2);
          mark(kRoundTrip, t0, now_s());
          benchmark::DoNotOptimize(y2.data());
        }  // freed here, after the end mark
        world.barrier();
        if (r != 0) continue;
        double phase[kPhases];
        for (int p = 0; p < kPhases; ++p) {
          double s = start[std::size_t(p)], e = end[std::size_t(p)];
          for (int q = 1; q < n; ++q) {
            s = std::min(s, start[std::size_t(q * kPhases + p)]);
            e = std::max(e, end[std::size_t(q * kPhases + p)]);
          }
          phase[p] = e - s;
          sum_phase[p] += phase[p];
        }
        for (int c = 0; c < kCalls; ++c) {
          double m = 0;
          for (int q = 0; q < n; ++q) m = std::max(m, call[std::size_t(q * kCalls + c)]);
          sum_call[c] += m;
        }
        state.SetIterationTime(phase[kRoundTrip]);
        ++iterations;
      }
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  const double it = double(std::max<std::int64_t>(iterations, 1));
  auto& c = state.counters;
  auto gbps = [&](int p) { return sum_phase[p] > 0 ? payload / (sum_phase[p] / it) / 1e9 : 0.0; };
  c["payload_MiB"] = payload / MiB;
  c["dispatch_GBps"] = gbps(kDispatch);
  c["combine_GBps"] = gbps(kCombine);
  c["round_trip_GBps"] = gbps(kRoundTrip);
  c["dispatch_us"] = 1e6 * sum_phase[kDispatch] / it;
  c["combine_us"] = 1e6 * sum_phase[kCombine] / it;
  c["round_trip_us"] = 1e6 * sum_phase[kRoundTrip] / it;
  c["plan_us"] = 1e6 * sum_call[kPlan] / it;
  c["permute_us"] = 1e6 * sum_call[kPermute] / it;
  c["a2a_us"] = 1e6 * sum_call[kA2A] / it;
  c["undispatch_us"] = 1e6 * sum_call[kUndispatch] / it;
  c["combine_rows_us"] = 1e6 * sum_call[kCombineRows] / it;
  c["r0_share"] = double(r0_rows.load()) / double(assignments * n);
  c["wrong"] = double(wrong.load());
}

// The grid: a base point (T 4096, H 256, k 2: 8 MiB per rank) and one axis varied at a time --
// tokens {1024, 4096, 16384}, hidden {256, 1024}, top-k {2, 8} -- each at EP 1, 2, 4 balanced
// and EP 2, 4 skewed. Payload per rank 2-32 MiB. (T 16384 x H 1024 and H 1024 x k 8, 128 MiB
// per rank, take seconds per round trip at EP 4 on 2 cores: add them to kPoints to run them.)
struct Point {
  std::int64_t tokens, hidden, k;
};
constexpr Point kPoints[] = {{1024, 256, 2}, {4096, 256, 2}, {16384, 256, 2}, {4096, 1024, 2}, {4096, 256, 8}};

void register_all() {
  for (Skew skew : {Skew::Balanced, Skew::Skewed}) {
    const char* name = skew == Skew::Balanced ? "moe_dispatch/balanced" : "moe_dispatch/skewed";
    for (const Point& p : kPoints)
      for (int n : {1, 2, 4}) {
        if (skew == Skew::Skewed && n == 1) continue;
        // ~256 MiB of group payload per case (n x payload x iterations), 3..40 iterations.
        const double group_payload = double(n) * double(p.tokens * p.k * p.hidden) * 4.0;
        const auto iters = static_cast<benchmark::IterationCount>(
            std::clamp(std::llround(256.0 * MiB / group_payload), 3LL, 40LL));
        benchmark::RegisterBenchmark(name, moe_dispatch, skew)
            ->ArgNames({"ep", "tokens", "hidden", "topk"})
            ->Args({n, p.tokens, p.hidden, p.k})
            ->Iterations(iters)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
