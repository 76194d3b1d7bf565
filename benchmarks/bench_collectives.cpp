// Collectives (all_reduce, reduce_scatter, all_gather) at 2 and 4 ranks over message sizes
// 4 KiB .. 256 MiB, fp32 (and bf16 for all_reduce), in place and out of place, reported with
// nccl-tests' definitions, plus the machine's copy-bandwidth ceiling (copy_bandwidth) to read
// them against. Communicators: ThreadComm (threads of this process) always; MpiComm too when
// the program was built with MPI (DSP_BENCH_HAVE_MPI, CMake: DSP_ENABLE_MPI) and runs under
// mpiexec. The per-rank body is a template on the communicator and a Harness says how to start
// n ranks of one, so both communicators run the same cases and land in the same tables.
//
// Usage: bench_collectives [Google Benchmark flags] [--tables=FILE]
//        mpiexec --allow-run-as-root --oversubscribe --bind-to none -n 4 bench_collectives [same]
//   --tables=FILE  also writes the results as Markdown tables (one per collective, rank count
//                  and type; rows = sizes, column groups = communicator x in/out of place, and
//                  ThreadComm's speed-up over MpiComm), the collectives section of
//                  benchmarks/RESULTS.md. With --benchmark_repetitions=R, each row is the
//                  median of the R runs by time. The console output is Google Benchmark's
//                  console reporter with a column per counter and no colours
//                  (--benchmark_format, --benchmark_color and --benchmark_counters_tabular
//                  do not apply to it; --benchmark_out and --benchmark_out_format do).
// Under mpiexec (OMPI_COMM_WORLD_SIZE set) with a world of W processes: MpiComm cases run at
// n = 2 and 4 ranks (n <= W) on processes 0..n-1 (a communicator split off the world), and the
// ThreadComm cases on n threads of process 0. Only process 0 runs Google Benchmark, prints and
// writes the tables; before every case it broadcasts the case (MPI_Ibcast on the world) and the
// other processes, parked in that broadcast, run their part of it. Processes without a part (all
// of them during ThreadComm cases, processes n..W-1 during MpiComm cases) wait by MPI_Test
// every 10 ms with a sleep in between, so they leave the cores to the ranks being measured
// (1 ms sleeps cost 3000 wake-ups per second on the 2 cores of the development machine
// while microsecond-sized cases were being timed).
// Pass --bind-to none: OpenMPI otherwise may pin process 0, and with it all ThreadComm rank
// threads, to one core.
//
// Timing, as nccl-tests (https://github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md: it times a
// loop of back-to-back operations and divides by their number). Every benchmark iteration is
// one *batch* of K back-to-back collectives of the size on every rank:
//     control (untimed): the ranks send rank 0 their last batch's start and end; rank 0 records
//         it and decides whether to go on (Google Benchmark) and K; it tells the others
//         (ThreadComm: shared memory + 2 barriers; MpiComm: MPI_Reduce + MPI_Bcast)
//     barrier                                       (the common start)
//     start[rank] = now; K x collective; end[rank] = now
// batch time = max over ranks of end - min over ranks of start (until the last rank has its
// last result; some ThreadComm paths return without a closing barrier), and time per
// collective = sum of batch times / (batches x K). (nccl-tests by default averages the per-rank
// times instead; ours is >= that.) K: per case, on the first run, one warm-up batch of 1
// collective and then doubling K until a batch takes >= 1 ms (the faster of two batches at each
// K below that, so that one preemption does not end the search; at most K = 1024); later runs of
// the same case (Google Benchmark's iteration estimation) reuse that K after one untimed
// warm-up batch. So small sizes are timed over ~1-2 ms batches of up to 1024 back-to-back
// operations, sizes whose single operation takes >= 1 ms one operation at a time.
// The inputs are not restored between the timed operations (in-place operations keep reducing
// their own results; fp32 values may overflow to inf, which costs the same); after the last
// batch the input is restored, the collective runs once more and that result is checked.
// Google Benchmark's own "Time" column is per batch (the manual time given to it); the
// counters below are per collective.
//
// Counters, as nccl-tests defines them:
//   size    bytes of the operation: all_reduce: the buffer (per rank); all_gather: the whole
//           output (n x per-rank input); reduce_scatter: the whole input (n x per-rank output)
//   count   elements per rank as nccl-tests prints it: all_reduce: size/sizeof(T); all_gather:
//           the per-rank input count; reduce_scatter: the per-rank output count
//   time_us mean time of one collective (above), microseconds
//   algbw   size / time, GB/s with 1 GB = 1e9 B
//   busbw   algbw x factor: all_reduce 2(n-1)/n; all_gather and reduce_scatter (n-1)/n. The
//           factor makes busbw comparable to the hardware's bandwidth whatever n is (the bytes
//           each rank must send or receive in an optimal ring algorithm, over time).
//   wrong   elements (summed over all ranks) that differ from the closed form in the checked
//           run after the timed batches. Inputs are rank-valued and exact, so the check is exact
//           equality: fp32 v(r, i) = (r + 1) + 16 (i mod 1024) (sums < 2^24); bf16
//           v(r, i) = (r + 1) 2^(i mod 16) (sums n(n+1)/2 2^(i mod 16) have at most 4
//           significant bits for n <= 4).
//   batches, K   timed batches and collectives per batch (tables: "ops" = batches x K)
// In place: all_reduce always (both communicators' all_reduce is in place); reduce_scatter
// with out = in + rank x count; all_gather with in = out + rank x count.
//
// copy_bandwidth/threads:T/streaming:S: a 256 MiB buffer copied into another, split into T
// contiguous slices copied by T threads at once. Reported `GBps` = bytes read + bytes written
// (2 x 256 MiB per iteration) / time / 1e9 -- the same convention as STREAM's "Copy".
//   S = 0: std::memcpy. Measured on the development machine, glibc's memcpy here stores through
//          the caches: each destination line is read for ownership before it is written, so
//          the memory moves 3 x 256 MiB while GBps counts 2.
//   S = 1 (x86, SSE2 only): non-temporal stores (comm/detail/streaming_copy.hpp), which
//          write the destination without reading it: what the memory delivers when every byte
//          is read once and written once. This is the ceiling of the direct all_reduce, which
//          writes back the lines it has just read (no read for ownership either): it reads and
//          writes every rank's buffer once (2 n size bytes), so its busbw is at most
//          GBps(S = 1) x (n-1)/n^2 (see RESULTS.md).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "dsp/comm/detail/streaming_copy.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/core/dtype.hpp"
#ifdef DSP_BENCH_HAVE_MPI
#include "dsp/comm/mpi_launch.hpp"
#endif

namespace {

using clock_type = std::chrono::steady_clock;
// Seconds on the steady clock (CLOCK_MONOTONIC: one clock for all processes of the machine).
double now_s() { return std::chrono::duration<double>(clock_type::now().time_since_epoch()).count(); }

enum class Op : std::int32_t { AllReduce, ReduceScatter, AllGather };
const char* op_name(Op op) {
  return op == Op::AllReduce ? "all_reduce" : op == Op::ReduceScatter ? "reduce_scatter" : "all_gather";
}
enum class Type : std::int32_t { Float, Bf16 };

// One benchmark case; trivially copyable (MpiComm's process 0 broadcasts it).
struct Case {
  Op op = Op::AllReduce;
  Type type = Type::Float;
  std::int32_t in_place = 0;
  std::int32_t ranks = 0;  // 0: no case (the followers' signal to finish)
  std::int64_t bytes = 0;
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

// Rank 0's side of the control step: records batches for Google Benchmark and chooses K (see
// the header comment). next() is given the last batch's time and returns the next batch's K,
// 0 to stop.
struct Driver {
  static constexpr double kMinBatchSeconds = 1e-3;
  static constexpr std::int64_t kMaxK = 1024;

  Driver(benchmark::State& s, std::int64_t& k_of_case) : state(s), cached_k(k_of_case) {}
  benchmark::State& state;
  std::int64_t& cached_k;  // 0 until calibrated; kept across the runs of one case
  enum class Phase { First, Calibrate, Warm, Measure } phase = Phase::First;
  std::int64_t k = 1, batches = 0;
  double seconds = 0;
  double first_try = 0;  // Calibrate: time of the first of the two batches at this K, or 0

  std::int64_t next(double batch_seconds) {
    switch (phase) {
      case Phase::First:  // no batch yet: a warm-up batch
        phase = cached_k > 0 ? Phase::Warm : Phase::Calibrate;
        k = cached_k > 0 ? cached_k : 1;
        return k;
      case Phase::Calibrate:  // two batches per K, the faster counts (one preemption must not end it)
        if (first_try == 0 && batch_seconds < kMinBatchSeconds) {
          first_try = batch_seconds;
          return k;
        }
        if (std::min(first_try > 0 ? first_try : batch_seconds, batch_seconds) < kMinBatchSeconds && k < kMaxK) {
          first_try = 0;
          return k *= 2;
        }
        cached_k = k;
        break;
      case Phase::Warm: break;
      case Phase::Measure:
        state.SetIterationTime(batch_seconds);
        seconds += batch_seconds;
        ++batches;
        break;
    }
    phase = Phase::Measure;
    return state.KeepRunning() ? k : 0;
  }
};

// One measured case, as Google Benchmark reports it (TableReporter); for --tables.
struct Row {
  double time_us = 0, algbw = 0, busbw = 0;
  std::int64_t wrong = 0, batches = 0, k = 0, count = 0;
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
// Every reported run (one per repetition) of every case; the tables show the median by time.
std::map<TableKey, std::map<std::int64_t, std::map<ColumnKey, std::vector<Row>>>>& results() {
  static std::map<TableKey, std::map<std::int64_t, std::map<ColumnKey, std::vector<Row>>>> r;
  return r;
}
// Registered collective families by name ("ThreadComm/all_reduce/float/in_place"): the table
// and column their runs go to (the row: the run's `ranks` and `size` counters).
struct Family {
  Op op;
  std::string type, comm;
  bool in_place;
};
std::map<std::string, Family>& families() {
  static std::map<std::string, Family> f;
  return f;
}

// How to run n ranks of a communicator. Harness<Comm>::run(case, body) calls body(link) on
// every rank of the case, where `link` offers the untimed control steps of the per-rank body:
//   comm()                  the rank's communicator
//   exchange(start, end, d) rank 0 gets min start / max end over ranks, calls d->next(batch
//                           time) and every rank returns its answer (d: non-null on rank 0 only)
//   sum_to_root(v)          the sum of v over ranks, on rank 0
template <class Comm>
struct Harness;

// ThreadComm: n threads of this process (comm::launch); control through shared memory.
template <>
struct Harness<dsp::comm::ThreadComm> {
  static constexpr const char* name = "ThreadComm";
  struct Shared {
    explicit Shared(int n) : start(std::size_t(n)), end(std::size_t(n)) {}
    std::vector<double> start, end;
    std::int64_t next = 0;
    std::atomic<std::int64_t> sum{0};
  };
  struct Link {
    dsp::comm::ThreadComm& c;
    Shared& sh;
    dsp::comm::ThreadComm& comm() { return c; }
    std::int64_t exchange(double start, double end, Driver* d) {
      sh.start[std::size_t(c.rank())] = start;
      sh.end[std::size_t(c.rank())] = end;
      c.barrier();
      if (d)
        sh.next = d->next(*std::max_element(sh.end.begin(), sh.end.end()) -
                          *std::min_element(sh.start.begin(), sh.start.end()));
      c.barrier();
      return sh.next;
    }
    std::int64_t sum_to_root(std::int64_t v) {
      sh.sum += v;
      c.barrier();
      return sh.sum.load();
    }
  };
  template <class Body>
  static void run(const Case& cs, Body&& body) {
    Shared sh(cs.ranks);
    dsp::comm::launch(cs.ranks, [&](dsp::comm::ThreadComm& comm) {
      Link link{comm, sh};
      body(link);
    });
  }
};

#ifdef DSP_BENCH_HAVE_MPI
// MpiComm: processes 0..n-1 of the MPI world; control through MPI_Reduce / MPI_Bcast.
struct MpiWorld {
  dsp::comm::MpiComm* world = nullptr;
  std::map<int, dsp::comm::MpiComm> first;  // n -> communicator of world ranks 0..n-1
};
MpiWorld& mpi() {
  static MpiWorld w;
  return w;
}
// Every process: the next case from process 0 (MPI_Ibcast on the world). Processes other than 0
// wait in MPI_Test with 10 ms sleeps (see the header comment).
Case next_case(Case cs = {}) {
  MPI_Request request = MPI_REQUEST_NULL;
  DSP_MPI_CHECK(MPI_Ibcast(&cs, sizeof cs, MPI_BYTE, 0, mpi().world->native(), &request));
  for (int done = 0;;) {
    DSP_MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
    if (done) return cs;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

template <>
struct Harness<dsp::comm::MpiComm> {
  static constexpr const char* name = "MpiComm";
  struct Link {
    dsp::comm::MpiComm& c;
    dsp::comm::MpiComm& comm() { return c; }
    std::int64_t exchange(double start, double end, Driver* d) {
      const double mine[2] = {-start, end};
      double all[2] = {0, 0};
      DSP_MPI_CHECK(MPI_Reduce(mine, all, 2, MPI_DOUBLE, MPI_MAX, 0, c.native()));
      std::int64_t next = d ? d->next(all[1] + all[0]) : 0;
      DSP_MPI_CHECK(MPI_Bcast(&next, 1, MPI_INT64_T, 0, c.native()));
      return next;
    }
    std::int64_t sum_to_root(std::int64_t v) {
      std::int64_t sum = 0;
      DSP_MPI_CHECK(MPI_Reduce(&v, &sum, 1, MPI_INT64_T, MPI_SUM, 0, c.native()));
      return sum;
    }
  };
  // On process 0 (Google Benchmark): announces the case, then runs rank 0's part.
  template <class Body>
  static void run(const Case& cs, Body&& body) {
    next_case(cs);
    Link link{mpi().first.at(cs.ranks)};
    body(link);
  }
};
#endif

// The per-rank body: buffers, the timed batches, the checked run. d: the Driver, on rank 0 only.
// Returns the wrong count summed over ranks (on rank 0).
template <class T, class Link>
std::int64_t rank_body(Link& link, Driver* d, const Case& cs) {
  auto& comm = link.comm();
  const int r = comm.rank(), n = comm.size();
  const std::int64_t count =
      cs.op == Op::AllReduce ? cs.bytes / std::int64_t(sizeof(T)) : cs.bytes / std::int64_t(sizeof(T) * n);
  const auto cnt = std::size_t(count);
  auto fill = [&](std::span<T> s) {
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = dsp::from_accum<T>(value<T>(r, std::int64_t(i)));
  };
  // all_reduce: buf (count) is the operand; reduce_scatter: in (n x count) -> out (count);
  // all_gather: in (count) -> out (n x count). In place, the operand is a view into buf.
  std::vector<T> buf, other;
  std::span<T> in, out;
  switch (cs.op) {
    case Op::AllReduce:
      buf.resize(cnt);
      out = in = buf;
      break;
    case Op::ReduceScatter:
      buf.resize(cnt * std::size_t(n));
      in = buf;
      if (cs.in_place) {
        out = in.subspan(std::size_t(r) * cnt, cnt);
      } else {
        other.resize(cnt);
        out = other;
      }
      break;
    case Op::AllGather:
      buf.resize(cnt * std::size_t(n));
      out = buf;
      if (cs.in_place) {
        in = out.subspan(std::size_t(r) * cnt, cnt);
      } else {
        other.resize(cnt);
        in = other;
      }
      break;
  }
  auto collective = [&] {
    switch (cs.op) {
      case Op::AllReduce: comm.all_reduce(out); break;
      case Op::ReduceScatter: comm.reduce_scatter(std::span<const T>(in), out); break;
      case Op::AllGather: comm.all_gather(std::span<const T>(in), out); break;
    }
  };
  // reduce_scatter: in[j] = v(r, j) over the whole input, so block r holds v(r, r count + i).
  fill(in);
  double start = 0, end = 0;
  for (;;) {
    const std::int64_t k = link.exchange(start, end, d);
    if (k == 0) break;
    comm.barrier();
    start = now_s();
    for (std::int64_t j = 0; j < k; ++j) collective();
    end = now_s();
  }
  fill(in);
  comm.barrier();
  collective();
  std::int64_t bad = 0;
  auto differs = [](T got, float want) { return dsp::to_accum(got) != want; };
  switch (cs.op) {
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
  return link.sum_to_root(bad);
}

// Runs this rank's part of a case, dispatching on the element type.
template <class Link>
std::int64_t run_rank(Link& link, Driver* d, const Case& cs) {
  return cs.type == Type::Bf16 ? rank_body<dsp::bf16>(link, d, cs) : rank_body<float>(link, d, cs);
}

template <class Comm>
void run_collective(benchmark::State& state, Case cs, std::int64_t& k_of_case) {
  cs.ranks = static_cast<std::int32_t>(state.range(0));
  cs.bytes = static_cast<std::int64_t>(state.range(1));  // nccl-tests' `size`
  const std::int64_t elem = cs.type == Type::Bf16 ? 2 : 4;
  const std::int64_t count = cs.op == Op::AllReduce ? cs.bytes / elem : cs.bytes / (elem * cs.ranks);
  Driver driver(state, k_of_case);
  std::int64_t wrong = 0;
  try {
    Harness<Comm>::run(cs, [&](auto& link) {
      const bool root = link.comm().rank() == 0;
      const std::int64_t w = run_rank(link, root ? &driver : nullptr, cs);
      if (root) wrong = w;
    });
  } catch (const std::exception& e) {
    // MpiComm: the other processes wait inside the case; mpi_launch aborts the job instead.
    if constexpr (!std::is_same_v<Comm, dsp::comm::ThreadComm>) throw;
    state.SkipWithError(e.what());
    return;
  }
  Row row;
  const double ops = double(driver.batches) * double(driver.k);
  row.time_us = ops > 0 ? driver.seconds / ops * 1e6 : 0.0;
  row.algbw = row.time_us > 0 ? double(cs.bytes) / row.time_us / 1e3 : 0.0;
  row.busbw = row.algbw * bus_factor(cs.op, cs.ranks);
  row.wrong = wrong;
  row.batches = driver.batches;
  row.k = driver.k;
  row.count = count;
  state.counters["ranks"] = double(cs.ranks);
  state.counters["size"] = double(cs.bytes);
  state.counters["count"] = double(count);
  state.counters["time_us"] = row.time_us;
  state.counters["algbw"] = row.algbw;  // GB/s
  state.counters["busbw"] = row.busbw;  // GB/s
  state.counters["wrong"] = double(row.wrong);
  state.counters["K"] = double(row.k);
  state.counters["batches"] = double(row.batches);
}

// Registers the cases of one communicator at the given rank counts, sizes 4 KiB, 16 KiB, ...,
// 256 MiB, named "<comm>/<op>/<type>/<in_place|out_of_place>/ranks:R/bytes:B".
template <class Comm>
void register_collectives(const std::vector<int>& rank_counts) {
  auto add = [&](Op op, bool in_place, Type type) {
    const std::string name = std::string(Harness<Comm>::name) + "/" + op_name(op) + "/" +
                             (type == Type::Bf16 ? "bf16" : "float") + "/" + (in_place ? "in_place" : "out_of_place");
    Case cs{op, type, in_place ? 1 : 0, 0, 0};
    families()[name] = {op, type == Type::Bf16 ? "bf16" : "float", Harness<Comm>::name, in_place};
    auto* b = benchmark::RegisterBenchmark(name.c_str(), [cs, name](benchmark::State& s) {
      static std::map<std::tuple<std::string, std::int64_t, std::int64_t>, std::int64_t> k_of;  // calibrated K
      run_collective<Comm>(s, cs, k_of[{name, s.range(0), s.range(1)}]);
    });
    b->ArgNames({"ranks", "bytes"})->UseManualTime()->Unit(benchmark::kMicrosecond);
    for (int n : rank_counts)
      for (std::int64_t bytes = 4 << 10; bytes <= (std::int64_t{1} << 28); bytes *= 4) b->Args({n, bytes});
  };
  add(Op::AllReduce, true, Type::Float);
  add(Op::AllReduce, true, Type::Bf16);
  for (bool in_place : {false, true}) {
    add(Op::ReduceScatter, in_place, Type::Float);
    add(Op::AllGather, in_place, Type::Float);
  }
}

// copy_bandwidth: see the header comment. GBps = 2 x bytes / time / 1e9.
std::vector<double> copy_gbps[2][2];  // [streaming][threads - 1]: every reported run (for --tables)

void BM_copy_bandwidth(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const bool streaming = state.range(1) != 0;
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
        if (streaming) dsp::comm::detail::streaming_copy(dst.data() + b, src.data() + b, e - b);
        else std::memcpy(dst.data() + b, src.data() + b, e - b);
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
  state.counters["threads"] = threads;
  state.counters["streaming"] = streaming;
}

void copy_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"threads", "streaming"});
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
#ifdef __SSE2__
  const std::vector<std::int64_t> kinds = {0, 1};
#else
  const std::vector<std::int64_t> kinds = {0};
#endif
  for (std::int64_t streaming : kinds) {
    b->Args({1, streaming});
    if (cores > 1) b->Args({cores, streaming});
  }
}

std::string human(std::int64_t bytes) {
  if (bytes >= (1 << 20) && bytes % (1 << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (1 << 10) && bytes % (1 << 10) == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

// The median of the reported runs by time (the lower middle one of an even count): with
// --benchmark_repetitions=R, one slow repetition (a preemption on a loaded 2-core machine) does
// not make the row.
const Row& median(const std::vector<Row>& runs) {
  std::vector<const Row*> by_time;
  for (const Row& r : runs) by_time.push_back(&r);
  std::sort(by_time.begin(), by_time.end(), [](const Row* a, const Row* b) { return a->time_us < b->time_us; });
  return *by_time[(by_time.size() - 1) / 2];
}
// GB/s of the run with the median time, as median(runs) picks it (higher GB/s = less time).
double median_gbps(std::vector<double> gbps) {
  if (gbps.empty()) return 0;
  std::sort(gbps.begin(), gbps.end());
  return gbps[gbps.size() / 2];
}

// The console output, plus every reported run (not the aggregates, not runs that failed)
// recorded for --tables from its counters.
class TableReporter : public benchmark::ConsoleReporter {
 public:
  TableReporter() : ConsoleReporter(OO_Tabular) {}  // a column per counter; no colour codes
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration || run.error_occurred) continue;
      auto counter = [&](const char* name) {
        auto it = run.counters.find(name);
        return it == run.counters.end() ? 0.0 : double(it->second.value);
      };
      const std::string& fn = run.run_name.function_name;
      if (fn == "copy_bandwidth") {
        const int t = static_cast<int>(counter("threads"));
        if (t >= 1 && t <= 2) copy_gbps[counter("streaming") != 0][t - 1].push_back(counter("GBps"));
        continue;
      }
      auto family = families().find(fn);
      if (family == families().end()) continue;
      const Family& f = family->second;
      Row row;
      row.time_us = counter("time_us");
      row.algbw = counter("algbw");
      row.busbw = counter("busbw");
      row.wrong = static_cast<std::int64_t>(counter("wrong"));
      row.batches = static_cast<std::int64_t>(counter("batches"));
      row.k = static_cast<std::int64_t>(counter("K"));
      row.count = static_cast<std::int64_t>(counter("count"));
      results()[{f.op, static_cast<int>(counter("ranks")), f.type}][static_cast<std::int64_t>(counter("size"))]
               [{f.comm, f.in_place}].push_back(row);
    }
  }
};

// Markdown, nccl-tests' layout: size, count, type, then per column group time, algbw, busbw,
// #wrong and ops (batches x K) of the median run; when both communicators ran a variant, a last
// column per variant: MpiComm's time / ThreadComm's time.
void write_tables(const std::string& path) {
  std::ofstream f(path);
  char cell[160];
  for (const auto& [key, rows] : results()) {
    std::set<ColumnKey> cols;  // by communicator (MpiComm first), out of place first (as nccl-tests)
    for (const auto& [size, row] : rows)
      for (const auto& [col, r] : row) cols.insert(col);
    std::vector<bool> ratios;  // in_place values that both communicators ran
    for (bool ip : {false, true})
      if (cols.count({"MpiComm", ip}) && cols.count({"ThreadComm", ip})) ratios.push_back(ip);
    f << "\n#### " << op_name(key.op) << ", " << key.ranks << " ranks, " << key.type << (key.op == Op::AllGather ? "" : ", sum")
      << "\n\n| size | count | type |";
    std::string rule = "| ---: | ---: | --- |";
    for (const auto& c : cols) {
      const std::string g = c.comm + (c.in_place ? " in-place" : " out-of-place");
      f << ' ' << g << " time (us) | algbw (GB/s) | busbw (GB/s) | #wrong | ops |";
      rule += " ---: | ---: | ---: | ---: | ---: |";
    }
    for (bool ip : ratios) {
      f << " ThreadComm speed-up" << (ip ? " in-place" : " out-of-place") << " |";
      rule += " ---: |";
    }
    f << '\n' << rule << '\n';
    for (const auto& [size, row] : rows) {
      f << "| " << human(size) << " | " << median(row.begin()->second).count << " | " << key.type << " |";
      for (const auto& c : cols) {
        auto it = row.find(c);
        if (it == row.end()) {
          f << " | | | | |";
          continue;
        }
        const Row& r = median(it->second);
        std::snprintf(cell, sizeof cell, " %.1f | %.3f | %.3f | %lld | %lldx%lld |", r.time_us, r.algbw, r.busbw,
                      static_cast<long long>(r.wrong), static_cast<long long>(r.batches), static_cast<long long>(r.k));
        f << cell;
      }
      for (bool ip : ratios) {
        auto m = row.find({"MpiComm", ip}), t = row.find({"ThreadComm", ip});
        if (m != row.end() && t != row.end() && median(t->second).time_us > 0) {
          std::snprintf(cell, sizeof cell, " %.2fx |", median(m->second).time_us / median(t->second).time_us);
          f << cell;
        } else {
          f << " |";
        }
      }
      f << '\n';
    }
  }
  if (!copy_gbps[0][0].empty()) {
    f << "\n#### copy_bandwidth (256 MiB; GB/s = (bytes read + written) / time / 1e9)\n\n"
      << "| threads | memcpy GB/s | non-temporal stores GB/s |\n| ---: | ---: | ---: |\n";
    for (int t = 0; t < 2; ++t)
      if (!copy_gbps[0][t].empty()) {
        std::snprintf(cell, sizeof cell, "| %d | %.2f | ", t + 1, median_gbps(copy_gbps[0][t]));
        f << cell;
        if (!copy_gbps[1][t].empty()) {
          std::snprintf(cell, sizeof cell, "%.2f", median_gbps(copy_gbps[1][t]));
          f << cell;
        }
        f << " |\n";
      }
  }
}

// Google Benchmark on this process: registers the cases (ThreadComm at 2 and 4 ranks, MpiComm at
// mpi_ranks) and the copy benchmark, runs, writes the tables.
int run_benchmarks(int argc, char** argv, const std::string& tables, const std::vector<int>& mpi_ranks) {
  register_collectives<dsp::comm::ThreadComm>({2, 4});
#ifdef DSP_BENCH_HAVE_MPI
  if (!mpi_ranks.empty()) register_collectives<dsp::comm::MpiComm>(mpi_ranks);
#else
  (void)mpi_ranks;
#endif
  benchmark::RegisterBenchmark("copy_bandwidth", BM_copy_bandwidth)
      ->Apply(copy_args)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  TableReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  if (!tables.empty()) write_tables(tables);
  return 0;
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
  // The tables are built from the individual runs, which these flags keep from the reporter.
  for (int i = 1; i < kept; ++i) {
    const std::string a = argv[i];
    for (const char* flag : {"--benchmark_report_aggregates_only", "--benchmark_display_aggregates_only"})
      if (!tables.empty() && a.rfind(flag, 0) == 0 && a != std::string(flag) + "=false") {
        std::fprintf(stderr, "bench_collectives: --tables needs the individual runs; drop %s\n", flag);
        return 2;
      }
  }
  argc = kept;
#ifdef DSP_BENCH_HAVE_MPI
  if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) {
    int rc = 0;
    dsp::comm::mpi_launch([&](dsp::comm::MpiComm& world) {
      mpi().world = &world;
      std::vector<int> mpi_ranks;
      for (int n : {2, 4})
        if (n <= world.size()) {
          mpi_ranks.push_back(n);
          mpi().first.emplace(n, world.split(world.rank() < n ? 0 : 1, world.rank()));
        }
      if (world.rank() == 0) {
        rc = run_benchmarks(argc, argv, tables, mpi_ranks);
        next_case(Case{});  // ranks 0: the followers finish
      } else {
        for (Case cs; (cs = next_case()).ranks > 0;)
          if (world.rank() < cs.ranks) {
            Harness<dsp::comm::MpiComm>::Link link{mpi().first.at(cs.ranks)};
            run_rank(link, nullptr, cs);
          }
      }
      mpi().first.clear();
    });
    return rc;
  }
#endif
  return run_benchmarks(argc, argv, tables, {});
}
