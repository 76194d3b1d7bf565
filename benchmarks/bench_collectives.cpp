// Collectives (all_reduce, reduce_scatter, all_gather) at 2 and 4 ranks over message sizes
// 4 KiB .. 256 MiB, fp32 (and bf16 for all_reduce), in place and out of place, reported with
// nccl-tests' definitions, plus the machine's copy-bandwidth ceiling (copy_bandwidth) to read
// them against. Communicators: ThreadComm (threads of this process). The per-rank body is a
// template on the communicator and a Harness says how to start n ranks of one, so another
// communicator (MpiComm under mpiexec) registers the same cases and its figures land in the
// same tables as an extra group of columns.
//
// Usage: bench_collectives [Google Benchmark flags] [--tables=FILE]
//   --tables=FILE  also writes the results as Markdown tables (one per collective, rank count
//                  and type; rows = sizes, column groups = communicator x in/out of place),
//                  the collectives section of benchmarks/RESULTS.md.
//
// How one collective benchmark runs: one Harness::run (comm::launch) per benchmark run; inside
// the rank threads every iteration is
//     barrier                                   (publishes the previous iteration's timestamps)
//     rank 0: records the previous iteration, asks Google Benchmark whether to go on
//     barrier                                   (publishes the answer)
//     restore the input where the operation overwrote it     (untimed)
//     barrier                                   (all ranks start together)
//     t_start[rank] = now -> collective -> t_end[rank] = now
// and the iteration's time is max over ranks of t_end - min over ranks of t_start: from the
// common start until the last rank has its result (some ThreadComm paths return without a
// closing barrier, so one rank's return does not mean all are done). It is passed to
// state.SetIterationTime (UseManualTime), so Google Benchmark's "Time" column is that too.
//
// Counters, as nccl-tests defines them (https://github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md):
//   size    bytes of the operation: all_reduce: the buffer (per rank); all_gather: the whole
//           output (n x per-rank input); reduce_scatter: the whole input (n x per-rank output)
//   count   elements per rank as nccl-tests prints it: all_reduce: size/sizeof(T); all_gather:
//           the per-rank input count; reduce_scatter: the per-rank output count
//   time_us mean time of one collective (as above), microseconds
//   algbw   size / time, GB/s with 1 GB = 1e9 B
//   busbw   algbw x factor: all_reduce 2(n-1)/n; all_gather and reduce_scatter (n-1)/n. The
//           factor makes busbw comparable to the hardware's bandwidth whatever n is (the bytes
//           each rank must send or receive in an optimal ring algorithm, over time).
//   wrong   elements (summed over all ranks) that differ from the closed form after the last
//           iteration. Inputs are rank-valued and exact, so the check is exact equality:
//           fp32 v(r, i) = (r + 1) + 16 (i mod 1024) (sums < 2^24); bf16 v(r, i) = (r + 1) 2^(i mod 16)
//           (sums n(n+1)/2 2^(i mod 16) have at most 4 significant bits for n <= 4).
// In place: all_reduce always (ThreadComm's all_reduce is in place; the input is restored
// before every iteration, untimed); reduce_scatter with out = in + rank x count (the own block
// is restored, untimed); all_gather with in = out + rank x count.
//
// copy_bandwidth/threads:T: std::memcpy of a 256 MiB buffer into another, split into T
// contiguous slices copied by T threads at once. Reported `GBps` = bytes read + bytes written
// (2 x 256 MiB per iteration) / time / 1e9 -- the same convention as STREAM's "Copy". (glibc's
// memcpy uses non-temporal stores at this size, so the destination is not read first.)
// A shared-memory all_reduce must read and write every rank's buffer once (2 n size bytes), so
// its busbw is at most copy GB/s x (n-1)/n^2 (see RESULTS.md).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "dsp/comm/launch.hpp"
#include "dsp/core/dtype.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

enum class Op { AllReduce, ReduceScatter, AllGather };
const char* op_name(Op op) {
  return op == Op::AllReduce ? "all_reduce" : op == Op::ReduceScatter ? "reduce_scatter" : "all_gather";
}

// How to run n ranks of a communicator and give each the per-rank body.
template <class Comm>
struct Harness;
template <>
struct Harness<dsp::comm::ThreadComm> {
  static constexpr const char* name = "ThreadComm";
  template <class Body>
  static void run(int n, Body&& body) {
    dsp::comm::launch(n, [&](dsp::comm::ThreadComm& comm) { body(comm); });
  }
};

template <class T>
const char* type_name() {
  return std::is_same_v<T, dsp::bf16> ? "bf16" : "float";
}
// Rank-valued inputs and their sums over ranks 0..n-1, exact in T (see the header comment).
template <class T>
float value(int rank, std::int64_t i) {
  if constexpr (std::is_same_v<T, dsp::bf16>) return float(rank + 1) * float(1 << (i % 16));
  else return float(rank + 1) + 16.0f * float(i % 1024);
}
template <class T>
float sum_value(int n, std::int64_t i) {
  if constexpr (std::is_same_v<T, dsp::bf16>) return float(n * (n + 1) / 2) * float(1 << (i % 16));
  else return float(n * (n + 1) / 2) + 16.0f * float(n) * float(i % 1024);
}

// nccl-tests' bus-bandwidth factors.
double bus_factor(Op op, int n) { return op == Op::AllReduce ? 2.0 * (n - 1) / n : double(n - 1) / n; }

// One measured case; collected for --tables (the last run of a benchmark is the reported one).
struct Row {
  double time_us = 0, algbw = 0, busbw = 0;
  std::int64_t wrong = 0, iterations = 0, count = 0;
};
struct TableKey {  // one table per (op, ranks, type); rows by size
  Op op;
  int ranks;
  std::string type;
  auto operator<=>(const TableKey&) const = default;
};
struct ColumnKey {  // column group: communicator, in place
  std::string comm;
  bool in_place;
  auto operator<=>(const ColumnKey&) const = default;
};
std::map<TableKey, std::map<std::int64_t, std::map<ColumnKey, Row>>>& results() {
  static std::map<TableKey, std::map<std::int64_t, std::map<ColumnKey, Row>>> r;
  return r;
}

// Shared between the rank threads of one benchmark run.
struct Shared {
  explicit Shared(int n) : start(std::size_t(n)), end(std::size_t(n)) {}
  std::atomic<bool> go{false};
  std::atomic<std::int64_t> wrong{0};
  std::vector<clock_type::time_point> start, end;  // per rank, of the current iteration
  double seconds = 0;                              // rank 0: sum of the recorded iterations
  std::int64_t iterations = 0;
};

// The per-rank body: buffers, the timed loop, the closed-form check.
template <class T, class Comm>
void rank_body(Comm& comm, benchmark::State& state, Shared& sh, Op op, bool in_place, std::int64_t count) {
  const int r = comm.rank(), n = comm.size();
  const auto cnt = std::size_t(count);
  auto fill = [&](std::span<T> s, std::int64_t first) {
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = dsp::from_accum<T>(value<T>(r, first + std::int64_t(i)));
  };
  // all_reduce: buf (count) is the operand; reduce_scatter: in (n x count) -> out (count);
  // all_gather: in (count) -> out (n x count). In place, the operand is a view into buf.
  std::vector<T> buf, pristine, other;
  std::span<T> in, out;
  switch (op) {
    case Op::AllReduce:
      buf.resize(cnt);
      pristine.resize(cnt);
      fill(pristine, 0);
      out = in = buf;
      break;
    case Op::ReduceScatter:
      buf.resize(cnt * std::size_t(n));
      fill(buf, 0);
      in = buf;
      if (in_place) {
        out = in.subspan(std::size_t(r) * cnt, cnt);
        pristine.assign(out.begin(), out.end());
      } else {
        other.resize(cnt);
        out = other;
      }
      break;
    case Op::AllGather:
      buf.resize(cnt * std::size_t(n));
      out = buf;
      if (in_place) {
        in = out.subspan(std::size_t(r) * cnt, cnt);
      } else {
        other.resize(cnt);
        in = other;
      }
      fill(in, 0);
      break;
  }
  for (std::int64_t it = 0;; ++it) {
    comm.barrier();
    if (r == 0) {
      if (it > 0) {
        const auto t0 = *std::min_element(sh.start.begin(), sh.start.end());
        const auto t1 = *std::max_element(sh.end.begin(), sh.end.end());
        const double dt = std::chrono::duration<double>(t1 - t0).count();
        state.SetIterationTime(dt);
        sh.seconds += dt;
        ++sh.iterations;
      }
      sh.go.store(state.KeepRunning());
    }
    comm.barrier();
    if (!sh.go.load()) break;
    if (!pristine.empty()) std::copy(pristine.begin(), pristine.end(), out.begin());
    comm.barrier();
    sh.start[std::size_t(r)] = clock_type::now();
    switch (op) {
      case Op::AllReduce: comm.all_reduce(out); break;
      case Op::ReduceScatter: comm.reduce_scatter(std::span<const T>(in), out); break;
      case Op::AllGather: comm.all_gather(std::span<const T>(in), out); break;
    }
    sh.end[std::size_t(r)] = clock_type::now();
  }
  std::int64_t bad = 0;
  auto differs = [](T got, float want) { return dsp::to_accum(got) != want; };
  switch (op) {
    case Op::AllReduce:
      for (std::int64_t i = 0; i < count; ++i) bad += differs(out[std::size_t(i)], sum_value<T>(n, i));
      break;
    case Op::ReduceScatter:  // out[i] = sum_q v(q, r count + i)
      for (std::int64_t i = 0; i < count; ++i) bad += differs(out[std::size_t(i)], sum_value<T>(n, r * count + i));
      break;
    case Op::AllGather:  // out[q count + i] = v(q, i)
      for (int q = 0; q < n; ++q)
        for (std::int64_t i = 0; i < count; ++i) bad += differs(out[std::size_t(q * count + i)], value<T>(q, i));
      break;
  }
  sh.wrong += bad;
}

template <class Comm, class T>
void run_collective(benchmark::State& state, Op op, bool in_place) {
  const int n = static_cast<int>(state.range(0));
  const auto size = static_cast<std::int64_t>(state.range(1));  // bytes, nccl-tests' `size`
  const std::int64_t count = op == Op::AllReduce ? size / std::int64_t(sizeof(T)) : size / std::int64_t(sizeof(T) * n);
  Shared sh(n);
  try {
    Harness<Comm>::run(n, [&](Comm& comm) { rank_body<T>(comm, state, sh, op, in_place, count); });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  Row row;
  row.time_us = sh.iterations > 0 ? sh.seconds / double(sh.iterations) * 1e6 : 0.0;
  row.algbw = row.time_us > 0 ? double(size) / row.time_us / 1e3 : 0.0;
  row.busbw = row.algbw * bus_factor(op, n);
  row.wrong = sh.wrong.load();
  row.iterations = sh.iterations;
  row.count = count;
  results()[{op, n, type_name<T>()}][size][{Harness<Comm>::name, in_place}] = row;
  state.counters["size"] = double(size);
  state.counters["count"] = double(count);
  state.counters["time_us"] = row.time_us;
  state.counters["algbw"] = row.algbw;  // GB/s
  state.counters["busbw"] = row.busbw;  // GB/s
  state.counters["wrong"] = double(row.wrong);
}

// ranks {2, 4} x size {4 KiB, 16 KiB, ..., 256 MiB}
void collective_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"ranks", "bytes"});
  for (int n : {2, 4})
    for (std::int64_t bytes = 4 << 10; bytes <= (std::int64_t{1} << 28); bytes *= 4) b->Args({n, bytes});
}

// Registers the cases of one communicator, named "<comm>/<op>/<type>/<in_place|out_of_place>".
template <class Comm>
void register_collectives() {
  auto add = [](Op op, bool in_place, auto type_tag) {
    using T = decltype(type_tag);
    const std::string name = std::string(Harness<Comm>::name) + "/" + op_name(op) + "/" + type_name<T>() + "/" +
                             (in_place ? "in_place" : "out_of_place");
    benchmark::RegisterBenchmark(name.c_str(), [op, in_place](benchmark::State& s) { run_collective<Comm, T>(s, op, in_place); })
        ->Apply(collective_args)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  };
  add(Op::AllReduce, true, float{});
  add(Op::AllReduce, true, dsp::bf16{});
  for (bool in_place : {false, true}) {
    add(Op::ReduceScatter, in_place, float{});
    add(Op::AllGather, in_place, float{});
  }
}

// copy_bandwidth: see the header comment. GBps = 2 x bytes / time / 1e9.
double copy_gbps[2] = {0, 0};  // threads 1, 2 (for --tables)
void BM_copy_bandwidth(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  constexpr std::size_t bytes = std::size_t{256} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);  // value-initialised: pages are touched
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        const std::size_t b = bytes * std::size_t(t) / std::size_t(threads);
        const std::size_t e = bytes * std::size_t(t + 1) / std::size_t(threads);
        std::memcpy(dst.data() + b, src.data() + b, e - b);
      });
    for (auto& th : pool) th.join();
    const double dt = std::chrono::duration<double>(clock_type::now() - t0).count();
    state.SetIterationTime(dt);
    seconds += dt;
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  if (dst[bytes / 2] != 1) state.SkipWithError("copy_bandwidth: destination is wrong");
  state.counters["size"] = double(bytes);
  state.counters["GBps"] = seconds > 0 ? 2.0 * double(bytes) * double(state.iterations()) / seconds / 1e9 : 0.0;
  if (threads <= 2) copy_gbps[threads - 1] = state.counters["GBps"];
}

void copy_args(benchmark::internal::Benchmark* b) {
  b->ArgName("threads");
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  b->Arg(1);
  if (cores > 1) b->Arg(cores);
}
BENCHMARK(BM_copy_bandwidth)->Name("copy_bandwidth")->Apply(copy_args)->UseManualTime()->Unit(benchmark::kMillisecond);

std::string human(std::int64_t bytes) {
  if (bytes >= (1 << 20) && bytes % (1 << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (1 << 10) && bytes % (1 << 10) == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

// Markdown, nccl-tests' layout: size, count, type, then per column group time, algbw, busbw, #wrong.
void write_tables(const std::string& path) {
  std::ofstream f(path);
  char cell[160];
  for (const auto& [key, rows] : results()) {
    std::set<ColumnKey> cols;  // by communicator, out of place first (as nccl-tests)
    for (const auto& [size, row] : rows)
      for (const auto& [col, r] : row) cols.insert(col);
    f << "\n#### " << op_name(key.op) << ", " << key.ranks << " ranks, " << key.type << (key.op == Op::AllGather ? "" : ", sum")
      << "\n\n| size | count | type |";
    std::string rule = "| ---: | ---: | --- |";
    for (const auto& c : cols) {
      const std::string g = c.comm + (c.in_place ? " in-place" : " out-of-place");
      f << ' ' << g << " time (us) | algbw (GB/s) | busbw (GB/s) | #wrong | iters |";
      rule += " ---: | ---: | ---: | ---: | ---: |";
    }
    f << '\n' << rule << '\n';
    for (const auto& [size, row] : rows) {
      f << "| " << human(size) << " | " << row.begin()->second.count << " | " << key.type << " |";
      for (const auto& c : cols) {
        auto it = row.find(c);
        if (it == row.end()) {
          f << " | | | | |";
          continue;
        }
        const Row& r = it->second;
        std::snprintf(cell, sizeof cell, " %.1f | %.3f | %.3f | %lld | %lld |", r.time_us, r.algbw, r.busbw,
                      static_cast<long long>(r.wrong), static_cast<long long>(r.iterations));
        f << cell;
      }
      f << '\n';
    }
  }
  if (copy_gbps[0] > 0) {
    f << "\n#### copy_bandwidth (memcpy of 256 MiB; GB/s = (bytes read + written) / time / 1e9)\n\n"
      << "| threads | GB/s |\n| ---: | ---: |\n";
    for (int t = 0; t < 2; ++t)
      if (copy_gbps[t] > 0) {
        std::snprintf(cell, sizeof cell, "| %d | %.2f |\n", t + 1, copy_gbps[t]);
        f << cell;
      }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string tables;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--tables=", 0) == 0) tables = a.substr(9);
    else argv[kept++] = argv[i];
  }
  argc = kept;
  register_collectives<dsp::comm::ThreadComm>();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (!tables.empty()) write_tables(tables);
  return 0;
}
