// ThreadComm collectives (all_reduce, all_gather, reduce_scatter) at 2 and 4 ranks over
// message sizes 1 KiB .. 256 MiB of fp32, reported with nccl-tests' definitions, plus the
// machine's copy-bandwidth ceiling (copy_bandwidth) to read them against.
//
// How one collective benchmark runs: one comm::launch per benchmark run; inside the rank
// threads every iteration is
//     rank 0 asks Google Benchmark whether to go on      (state.KeepRunning(), rank 0 only)
//     barrier                                            (publishes the answer)
//     [all_reduce only] restore the input                (untimed: all_reduce is in place)
//     barrier                                            (all ranks start together)
//     t0 = now  ->  collective  ->  t1 = now             (timed on rank 0)
// so the time is rank 0's wall time of one collective, from a common start to its return.
// Every ThreadComm collective ends with a rank-wide barrier (reduce_scatter: then copies its
// own chunk), so rank 0's return means the whole collective finished, except reduce_scatter's
// final local copy on the other ranks. The time is passed to state.SetIterationTime
// (UseManualTime), so Google Benchmark's "Time" column is this per-iteration time.
//
// Counters, as nccl-tests defines them (https://github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md):
//   size    bytes of the operation: all_reduce: the buffer (per rank); all_gather: the whole
//           output (n x per-rank input); reduce_scatter: the whole input (n x per-rank output)
//   count   elements per rank as nccl-tests prints it: all_reduce: size/4; all_gather: the
//           per-rank input count = size/(4n); reduce_scatter: the per-rank output count
//   time_us mean time of one collective (rank 0), microseconds
//   algbw   size / time, GB/s with 1 GB = 1e9 B
//   busbw   algbw x factor: all_reduce 2(n-1)/n; all_gather and reduce_scatter (n-1)/n. The
//           factor makes busbw comparable to the hardware's bandwidth whatever n is (it is the
//           bytes each rank must send or receive in an optimal ring algorithm, over time).
//   wrong   elements (summed over all ranks) that differ from the closed form after the last
//           iteration; inputs are rank-valued: v(r, i) = (r + 1) + 16 (i mod 1024), exact in
//           fp32 at these sizes, so the check is exact equality.
//
// copy_bandwidth/threads:T: std::memcpy of a 256 MiB buffer into another, split into T
// contiguous slices copied by T threads at once. Reported `GBps` = bytes read + bytes written
// (2 x 256 MiB per iteration) / time / 1e9 -- the same convention as STREAM's "Copy". (With
// ordinary stores the hardware also reads the destination before writing it, so DRAM moves
// up to 3 x 256 MiB; glibc's memcpy uses non-temporal stores at this size, which avoid that.)
// A shared-memory collective can move no faster than this: e.g. ThreadComm's all_reduce
// reads n x size and writes size in its reduce phase, then reads and writes (n-1)/n x size
// per rank in its gather phase.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "dsp/comm/launch.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

enum class Op { AllReduce, AllGather, ReduceScatter };

// Rank-valued input: exact in fp32 (< 2^24 even summed over 4 ranks).
inline float value(int rank, std::int64_t i) { return float(rank + 1) + 16.0f * float(i % 1024); }

// sum over q < n of value(q, i)
inline float sum_value(int n, std::int64_t i) { return float(n * (n + 1) / 2) + 16.0f * float(n) * float(i % 1024); }

// nccl-tests' bus-bandwidth factors.
double bus_factor(Op op, int n) {
  return op == Op::AllReduce ? 2.0 * (n - 1) / n : double(n - 1) / n;
}

void run_collective(benchmark::State& state, Op op) {
  const int n = static_cast<int>(state.range(0));
  const auto size = static_cast<std::int64_t>(state.range(1));  // bytes, nccl-tests' `size`
  // Elements per rank of the per-rank buffer that defines nccl-tests' `count`.
  const std::int64_t count = op == Op::AllReduce ? size / 4 : size / (4 * n);

  std::atomic<bool> go{false};
  std::atomic<std::int64_t> wrong{0};
  double seconds = 0;  // sum of rank 0's timed iterations
  std::int64_t iterations = 0;

  try {
    dsp::comm::launch(n, [&](dsp::comm::ThreadComm& comm) {
      const int r = comm.rank();
      std::vector<float> in, out, pristine;
      switch (op) {
        case Op::AllReduce:  // in place: `out` is the buffer, `pristine` restores it
          out.resize(std::size_t(count));
          pristine.resize(std::size_t(count));
          for (std::int64_t i = 0; i < count; ++i) pristine[std::size_t(i)] = value(r, i);
          break;
        case Op::AllGather:  // in: count, out: n x count
          in.resize(std::size_t(count));
          out.resize(std::size_t(count * n));
          for (std::int64_t i = 0; i < count; ++i) in[std::size_t(i)] = value(r, i);
          break;
        case Op::ReduceScatter:  // in: n x count, out: count
          in.resize(std::size_t(count * n));
          out.resize(std::size_t(count));
          for (std::int64_t i = 0; i < count * n; ++i) in[std::size_t(i)] = value(r, i);
          break;
      }
      for (;;) {
        if (r == 0) go.store(state.KeepRunning());
        comm.barrier();
        if (!go.load()) break;
        if (op == Op::AllReduce) std::copy(pristine.begin(), pristine.end(), out.begin());
        comm.barrier();
        const auto t0 = clock_type::now();
        switch (op) {
          case Op::AllReduce: comm.all_reduce(std::span(out)); break;
          case Op::AllGather: comm.all_gather(std::span<const float>(in), std::span(out)); break;
          case Op::ReduceScatter: comm.reduce_scatter(std::span<const float>(in), std::span(out)); break;
        }
        if (r == 0) {
          const double dt = std::chrono::duration<double>(clock_type::now() - t0).count();
          state.SetIterationTime(dt);
          seconds += dt;
          ++iterations;
        }
      }
      // Closed forms of the last iteration's result.
      std::int64_t bad = 0;
      switch (op) {
        case Op::AllReduce:
          for (std::int64_t i = 0; i < count; ++i) bad += out[std::size_t(i)] != sum_value(n, i);
          break;
        case Op::AllGather:  // out[q*count + i] = value(q, i)
          for (int q = 0; q < n; ++q)
            for (std::int64_t i = 0; i < count; ++i) bad += out[std::size_t(q * count + i)] != value(q, i);
          break;
        case Op::ReduceScatter:  // out[i] = sum_q value(q, r*count + i)
          for (std::int64_t i = 0; i < count; ++i) bad += out[std::size_t(i)] != sum_value(n, r * count + i);
          break;
      }
      wrong += bad;
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }

  const double t = iterations > 0 ? seconds / double(iterations) : 0.0;
  const double algbw = t > 0 ? double(size) / t / 1e9 : 0.0;
  state.counters["size"] = double(size);
  state.counters["count"] = double(count);
  state.counters["time_us"] = t * 1e6;
  state.counters["algbw"] = algbw;                     // GB/s
  state.counters["busbw"] = algbw * bus_factor(op, n);  // GB/s
  state.counters["wrong"] = double(wrong.load());
}

void BM_all_reduce(benchmark::State& state) { run_collective(state, Op::AllReduce); }
void BM_all_gather(benchmark::State& state) { run_collective(state, Op::AllGather); }
void BM_reduce_scatter(benchmark::State& state) { run_collective(state, Op::ReduceScatter); }

// ranks {2, 4} x size {1 KiB, 4 KiB, ..., 256 MiB}
void collective_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"ranks", "bytes"});
  for (int n : {2, 4})
    for (std::int64_t bytes = 1 << 10; bytes <= (std::int64_t{1} << 28); bytes *= 4) b->Args({n, bytes});
}

BENCHMARK(BM_all_reduce)->Name("all_reduce")->Apply(collective_args)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_all_gather)->Name("all_gather")->Apply(collective_args)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_reduce_scatter)->Name("reduce_scatter")->Apply(collective_args)->UseManualTime()->Unit(benchmark::kMicrosecond);

// copy_bandwidth: see the header comment. GBps = 2 x bytes / time / 1e9.
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
}

void copy_args(benchmark::internal::Benchmark* b) {
  b->ArgName("threads");
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  b->Arg(1);
  if (cores > 1) b->Arg(cores);
}
BENCHMARK(BM_copy_bandwidth)->Name("copy_bandwidth")->Apply(copy_args)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
