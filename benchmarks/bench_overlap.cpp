// How much of a ThreadComm all-reduce hides behind computation on this machine: a synthetic
// GEMM stream concurrent with one all-reduce, and a real training step with the data-parallel
// gradient all-reduce overlapped with backward (--overlap-grad-reduce) or not.
//
// ## overlap: a GEMM stream on every rank concurrent with an all-reduce of G bytes
//
// One comm::launch of n ranks per benchmark run. The compute is a stream of K products
// C = A B of N x N fp32 matrices (dsp::backend::gemm: OpenBLAS with dsp::threads_per_rank()
// threads, i.e. 1 at 2 or 4 ranks on 2 cores); the communication is an in-place all-reduce
// (sum) of a buffer of G bytes of fp32. Every Google Benchmark iteration measures, in order,
//     t_compute  the K GEMMs alone
//     t_comm     comm.all_reduce(buffer) alone (on the rank's own thread)
//     t_both     w = comm.all_reduce_async(buffer); the K GEMMs; w.wait()
//                (the all-reduce runs on the rank's communication thread meanwhile)
// each as the max over ranks of the wall time from a common start (a barrier; the buffer is
// restored to its input, untimed, before each all-reduce), so a phase ends when its slowest
// rank ends. Counters are means over the iterations; Google Benchmark's "Time" column is
// t_both (UseManualTime).
//
// K is chosen at run time so that t_compute is about `ratio` x t_comm: before timing, all
// ranks time one all-reduce 3 times and one GEMM 3 times (each from a common start, max over
// ranks, so every rank gets the same figures) and K = max(1, round(ratio x fastest all-reduce
// / fastest GEMM)). This keeps the grid meaningful on another machine or after the all-reduce
// got faster; the ratio achieved is the counter compute_over_comm.
//
// Overlap efficiency (the definition of issue 3, item 4):
//     efficiency = (t_compute + t_comm - t_both) / min(t_compute, t_comm)
//   = the time saved by running both at once, as a fraction of the most that could be saved.
//   1: the shorter of the two is completely hidden (t_both = max(t_compute, t_comm));
//   0: no gain, the two are serialised (t_both = t_compute + t_comm);
//   < 0: running them together is slower than running them one after the other.
//
// overlap_idle: the same with the GEMM stream replaced by std::this_thread::sleep_for of
// ratio x t_comm (a rank that waits for an accelerator kernel or for I/O: compute that does
// not occupy a CPU core). It is the control: here nothing competes with the communication
// thread, so efficiency should be ~1 and anything less is the cost of the mechanism itself.
//
// Counters (overlap, overlap_idle):
//   ranks, bytes         n and G (bytes of the all-reduce buffer, per rank)
//   gemm_n, gemms        N and K of the GEMM stream (overlap only)
//   t_compute_ms         mean t_compute, milliseconds
//   t_comm_ms            mean t_comm, milliseconds
//   t_both_ms            mean t_both, milliseconds
//   t_compute_in_both_ms within t_both, the time until the compute returned (max over ranks,
//                        mean, milliseconds): above t_compute_ms by what the communication
//                        thread took from the compute
//   compute_over_comm    t_compute / t_comm (below 1: the GEMMs are the shorter part)
//   efficiency           from the three means, as above (dimensionless)
//   wrong                elements (all ranks) of the last overlapped all-reduce that differ
//                        from the closed form; inputs v(r, i) = (r + 1) + 16 (i mod 1024), as
//                        in bench_collectives, exact in fp32
//
// ## train_step: the Trainer with overlap off and on
//
// One comm::launch of tp x dp ranks; the demo model (samples/configs/demo.json: 4 layers,
// hidden 128, 4 heads / 2 query groups, SwiGLU 384, seq 128, vocabulary 256, tied) on tiny
// Shakespeare (data/tinyshakespeare.txt, found from this file's path), micro-batch 2 per DP
// rank and no gradient accumulation (the demo's 8 / 16 makes a step 0.6-1 s; 2 gives ~150 ms,
// so 20 pairs of steps fit in a few seconds). Two Trainers are built
// from the same seed and data, identical except for TrainConfig::ddp.overlap_grad_reduce
// (false, true) with the same bucket size. After 2 warm-up steps each, every Google Benchmark
// iteration runs one step of the overlap-off trainer and then one of the overlap-on trainer
// (the same batch: the two samplers are identical), so slow drifts of the shared machine's
// load hit both alike. A step's time is the max over ranks of StepResult::seconds (wall time
// of train_step from a common barrier). "Time" column: the off step + the on step.
// Afterwards, from a common barrier, 10 times each (max over ranks, mean):
//   one all-reduce over the data-parallel group of all this rank's gradients, and
//   the bucket all-reduces back to back (synchronous calls; with overlap off, finish() queues
//   the same sequence on the communication thread).
//
// Counters (train_step):
//   tp, dp, bucket_bytes       layout and --ddp-bucket-size (bytes)
//   micro_batch, global_batch  sequences per micro-batch per DP rank, per step
//   step_off_ms, step_off_sd_ms  mean and sample standard deviation of the step time with
//                              overlap off, milliseconds
//   step_on_ms, step_on_sd_ms  the same with overlap on
//   on_over_off                step_on_ms / step_off_ms (< 1: overlap made the step faster)
//   on_minus_off_ms, on_minus_off_se_ms  mean of the per-pair differences (on step - off step
//                              of the same iteration) and its standard error (sd / sqrt(pairs)),
//                              milliseconds: overlap is "not slower" when the mean is below ~2 se
//   buckets                    gradient buckets per rank
//   grad_bytes                 bytes of this rank's gradients (fp32), = what each step
//                              all-reduces over the DP group
//   grad_allreduce_ms          one all-reduce of grad_bytes, milliseconds: the communication
//                              there is to hide
//   bucket_allreduces_ms       the bucket all-reduces one after another, milliseconds; minus
//                              grad_allreduce_ms it is the cost of bucketing
//
// What limits overlap on the development machine (2 vCPUs; figures in benchmarks/RESULTS.md,
// "Overlap"). ThreadComm moves data with CPU instructions: an all-reduce is a reduction loop
// and copies executed by each rank's communication thread. With 2 ranks on 2 cores each core
// already runs one rank's single-threaded GEMM stream, so the communication thread has no core
// of its own and the scheduler time-slices it with the GEMMs: the GEMMs finish later by about
// the all-reduce's own time (t_compute_in_both ~ t_compute + t_comm when the compute is the
// longer part) and t_both ~ t_compute + t_comm, i.e. efficiency ~0 (-0.25 .. +0.1 from 16 MiB
// up on a quiet machine, lower under load). At 1-4 MiB it is negative (-0.15 .. -0.95): the
// two ranks' communication threads must both be running to pass the all-reduce's barriers,
// and while one waits for its turn on its core the other stalls, so a 0.1-0.3 ms collective
// costs more than its own time. Memory bandwidth is not what limits: the Prescott-kernel
// GEMMs are compute-bound, and an all-reduce could use the bandwidth they leave only on a core
// of its own, which there is not. 4 ranks (2 per core) only add threads to the same 2 cores:
// efficiency -0.3 .. -1. When the compute leaves the cores free (overlap_idle, a stand-in for
// waiting on a device) efficiency is ~0.8; the rest is the hand-off (waking the communication
// thread, then the waiting rank). In a training step the DP gradient all-reduce is ~0.2-0.3 ms
// of a ~120-140 ms step (0.2 %), so --overlap-grad-reduce can neither gain nor lose measurably
// here; it pays where the communication is done by other hardware (NCCL on GPUs, MPI with a
// NIC) or by spare cores.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <thread>
#include <vector>

#include "../tests/data_dir.hpp"
#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/trainer.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using dsp::comm::ThreadComm;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// The max over the ranks of comm of a per-rank value; every rank gets it.
double max_over_ranks(ThreadComm& comm, double v) {
  std::vector<double> x{v};
  comm.all_reduce(std::span(x), dsp::comm::ReduceOp::Max);
  return x[0];
}

// Wall time of fn() from a common start, max over the ranks of comm.
double timed(ThreadComm& comm, const std::function<void()>& fn) {
  comm.barrier();
  const auto t0 = clock_type::now();
  fn();
  return max_over_ranks(comm, seconds_since(t0));
}

// Rank-valued input and its sum over n ranks (exact in fp32), as in bench_collectives.
float value(int rank, std::int64_t i) { return float(rank + 1) + 16.0f * float(i % 1024); }
float sum_value(int n, std::int64_t i) { return float(n * (n + 1) / 2) + 16.0f * float(n) * float(i % 1024); }

double efficiency(double t_compute, double t_comm, double t_both) {
  return (t_compute + t_comm - t_both) / std::min(t_compute, t_comm);
}

enum class Compute { Gemm, Idle };

// overlap / overlap_idle: see the header comment.
void run_overlap(benchmark::State& state, Compute kind) {
  const int n = static_cast<int>(state.range(0));
  const std::int64_t bytes = state.range(1);
  const std::int64_t gemm_n = kind == Compute::Gemm ? state.range(2) : 0;
  const double ratio = double(state.range(kind == Compute::Gemm ? 3 : 2)) / 100.0;
  const std::int64_t count = bytes / 4;

  std::atomic<bool> go{false};
  std::atomic<std::int64_t> wrong{0};
  std::int64_t gemms = 0;
  double sum_compute = 0, sum_comm = 0, sum_both = 0, sum_compute_in_both = 0;
  std::int64_t iterations = 0;

  try {
    dsp::comm::launch(n, [&](ThreadComm& comm) {
      const int r = comm.rank();
      const auto nn = static_cast<std::size_t>(gemm_n * gemm_n);
      std::vector<float> a(nn, 0.5f), b(nn, 0.25f), c(nn);
      std::vector<float> buffer(static_cast<std::size_t>(count)), pristine(buffer.size());
      for (std::int64_t i = 0; i < count; ++i) pristine[std::size_t(i)] = value(r, i);
      auto restore = [&] { std::copy(pristine.begin(), pristine.end(), buffer.begin()); };
      auto gemm = [&] {
        dsp::backend::gemm(dsp::backend::Host{}, false, false, gemm_n, gemm_n, gemm_n, 1.0f, a.data(), gemm_n,
                           b.data(), gemm_n, 0.0f, c.data(), gemm_n);
      };

      // Calibration (also warms the BLAS and creates the communication thread).
      auto fastest_of_3 = [&](const std::function<void()>& fn) {
        double t = timed(comm, fn);
        for (int i = 0; i < 2; ++i) t = std::min(t, timed(comm, fn));
        return t;
      };
      restore();
      comm.all_reduce_async(std::span(buffer)).wait();
      const double t_allreduce = fastest_of_3([&] { comm.all_reduce(std::span(buffer)); });
      std::function<void()> compute;
      if (kind == Compute::Gemm) {
        gemm();
        const double t_gemm = fastest_of_3(gemm);
        const auto k = std::max<std::int64_t>(1, std::llround(ratio * t_allreduce / t_gemm));
        if (r == 0) gemms = k;
        compute = [&, k] {
          for (std::int64_t i = 0; i < k; ++i) gemm();
        };
      } else {
        const auto pause = std::chrono::duration<double>(ratio * t_allreduce);
        compute = [pause] { std::this_thread::sleep_for(pause); };
      }

      for (;;) {
        if (r == 0) go.store(state.KeepRunning());
        comm.barrier();
        if (!go.load()) break;
        const double t_compute = timed(comm, compute);
        restore();
        const double t_comm = timed(comm, [&] { comm.all_reduce(std::span(buffer)); });
        restore();
        double compute_done = 0;  // this rank's compute() return within t_both, seconds
        const double t_both = timed(comm, [&] {
          const auto t0 = clock_type::now();
          auto work = comm.all_reduce_async(std::span(buffer));
          compute();
          compute_done = seconds_since(t0);
          work.wait();
        });
        const double t_compute_in_both = max_over_ranks(comm, compute_done);
        if (r == 0) {
          state.SetIterationTime(t_both);
          sum_compute += t_compute;
          sum_comm += t_comm;
          sum_both += t_both;
          sum_compute_in_both += t_compute_in_both;
          ++iterations;
        }
      }
      std::int64_t bad = 0;
      for (std::int64_t i = 0; i < count; ++i) bad += buffer[std::size_t(i)] != sum_value(n, i);
      wrong += bad;
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }

  const double it = double(std::max<std::int64_t>(1, iterations));
  const double tc = sum_compute / it, tm = sum_comm / it, tb = sum_both / it;
  state.counters["ranks"] = n;
  state.counters["bytes"] = double(bytes);
  if (kind == Compute::Gemm) {
    state.counters["gemm_n"] = double(gemm_n);
    state.counters["gemms"] = double(gemms);
  }
  state.counters["t_compute_ms"] = tc * 1e3;
  state.counters["t_comm_ms"] = tm * 1e3;
  state.counters["t_both_ms"] = tb * 1e3;
  state.counters["t_compute_in_both_ms"] = sum_compute_in_both / it * 1e3;
  state.counters["compute_over_comm"] = tc / tm;
  state.counters["efficiency"] = efficiency(tc, tm, tb);
  state.counters["wrong"] = double(wrong.load());
}

void BM_overlap(benchmark::State& state) { run_overlap(state, Compute::Gemm); }
void BM_overlap_idle(benchmark::State& state) { run_overlap(state, Compute::Idle); }

constexpr std::int64_t MiB = 1 << 20;

// (ranks, G, N) x ratio in percent. N grows with G so that one GEMM stays below ~t_comm;
// 4 ranks (2 per core) only at one size: see RESULTS.md.
void overlap_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"ranks", "bytes", "gemm_n", "ratio_pct"});
  struct Case {
    int ranks;
    std::int64_t bytes, gemm_n;
  };
  for (Case c : {Case{2, 1 * MiB, 64}, Case{2, 4 * MiB, 128}, Case{2, 16 * MiB, 128}, Case{2, 16 * MiB, 256},
                 Case{2, 64 * MiB, 256}, Case{2, 64 * MiB, 512}, Case{4, 16 * MiB, 128}})
    for (int ratio : {25, 100, 400}) b->Args({c.ranks, c.bytes, c.gemm_n, ratio});
}

void overlap_idle_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"ranks", "bytes", "ratio_pct"});
  for (int ratio : {25, 100, 400}) b->Args({2, 16 * MiB, ratio});
}

BENCHMARK(BM_overlap)->Name("overlap")->Apply(overlap_args)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_overlap_idle)
    ->Name("overlap_idle")
    ->Apply(overlap_idle_args)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// train_step: see the header comment.
using HostPolicy = dsp::Policy<dsp::backend::Host, ThreadComm>;

const dsp::train::TokenDataset& shakespeare(std::int64_t seq_length) {
  static const auto data = dsp::train::TokenDataset::from_file(
      dsp::test::data_dir() + "/tinyshakespeare.txt", seq_length);
  return data;
}

struct MeanSd {
  double mean = 0, sd = 0;
};
MeanSd mean_sd(const std::vector<double>& x) {
  MeanSd m;
  for (double v : x) m.mean += v / double(x.size());
  for (double v : x) m.sd += (v - m.mean) * (v - m.mean);
  m.sd = x.size() > 1 ? std::sqrt(m.sd / double(x.size() - 1)) : 0.0;
  return m;
}

void BM_train_step(benchmark::State& state) {
  const int tp = static_cast<int>(state.range(0)), dp = static_cast<int>(state.range(1));
  const std::int64_t bucket_bytes = state.range(2), micro_batch = state.range(3);
  const dsp::model::ModelConfig model{.vocab_size = 256, .hidden_size = 128, .num_layers = 4,
                                      .num_attention_heads = 4, .num_query_groups = 2, .ffn_hidden_size = 384,
                                      .seq_length = 128, .tie_word_embeddings = true};
  dsp::train::TrainConfig off;
  off.micro_batch_size = micro_batch;
  off.global_batch_size = micro_batch * dp;
  off.train_iters = 1000;  // only shapes the learning-rate schedule
  off.ddp.bucket_size_bytes = bucket_bytes;
  off.ddp.overlap_grad_reduce = false;
  dsp::train::TrainConfig on = off;
  on.ddp.overlap_grad_reduce = true;

  std::atomic<bool> go{false};
  std::vector<double> t_off, t_on;
  double grad_bytes = 0, buckets = 0, t_grad = 0, t_buckets = 0;

  try {
    const auto& data = shakespeare(model.seq_length);
    dsp::comm::launch(tp * dp, [&](ThreadComm& world) {
      dsp::DeviceMesh mesh(world, dsp::ParallelLayout{.tensor = tp});
      dsp::train::Trainer<HostPolicy> trainer_off(model, off, mesh, data);
      dsp::train::Trainer<HostPolicy> trainer_on(model, on, mesh, data);
      auto step = [&](dsp::train::Trainer<HostPolicy>& t) {
        world.barrier();
        return max_over_ranks(world, t.train_step().seconds);
      };
      for (int i = 0; i < 2; ++i) {
        step(trainer_off);
        step(trainer_on);
      }
      for (;;) {
        if (world.rank() == 0) go.store(state.KeepRunning());
        world.barrier();
        if (!go.load()) break;
        const double s_off = step(trainer_off);
        const double s_on = step(trainer_on);
        if (world.rank() == 0) {
          state.SetIterationTime(s_off + s_on);
          t_off.push_back(s_off);
          t_on.push_back(s_on);
        }
      }

      // The communication there is to hide: all gradients at once, and bucket by bucket.
      auto& dp_comm = mesh.data_group();
      const auto& bk = trainer_off.grad_buckets();
      std::vector<std::int64_t> bucket_elements;
      for (std::size_t i = 0; i < bk.size(); ++i) {
        std::int64_t e = 0;
        for (const auto* p : bk.bucket(i)) e += p->grad.numel();
        bucket_elements.push_back(e);
      }
      std::int64_t elements = 0;
      for (auto e : bucket_elements) elements += e;
      std::vector<float> grads(static_cast<std::size_t>(elements), 1.0f);
      constexpr int reps = 10;
      double s_grad = 0, s_buckets = 0;
      for (int i = 0; i < reps; ++i) {
        s_grad += timed(world, [&] { dp_comm.all_reduce(std::span(grads)); });
        s_buckets += timed(world, [&] {
          std::int64_t off_e = 0;
          for (auto e : bucket_elements) {
            dp_comm.all_reduce(std::span(grads).subspan(std::size_t(off_e), std::size_t(e)));
            off_e += e;
          }
        });
      }
      if (world.rank() == 0) {
        grad_bytes = 4.0 * double(elements);
        buckets = double(bk.size());
        t_grad = s_grad / reps;
        t_buckets = s_buckets / reps;
      }
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }

  std::vector<double> diff(t_on.size());
  for (std::size_t i = 0; i < diff.size(); ++i) diff[i] = t_on[i] - t_off[i];
  const MeanSd m_off = mean_sd(t_off), m_on = mean_sd(t_on), m_diff = mean_sd(diff);
  state.counters["tp"] = tp;
  state.counters["dp"] = dp;
  state.counters["bucket_bytes"] = double(bucket_bytes);
  state.counters["micro_batch"] = double(micro_batch);
  state.counters["global_batch"] = double(micro_batch * dp);
  state.counters["step_off_ms"] = m_off.mean * 1e3;
  state.counters["step_off_sd_ms"] = m_off.sd * 1e3;
  state.counters["step_on_ms"] = m_on.mean * 1e3;
  state.counters["step_on_sd_ms"] = m_on.sd * 1e3;
  state.counters["on_over_off"] = m_on.mean / m_off.mean;
  state.counters["on_minus_off_ms"] = m_diff.mean * 1e3;
  state.counters["on_minus_off_se_ms"] = m_diff.sd / std::sqrt(double(diff.size())) * 1e3;
  state.counters["buckets"] = buckets;
  state.counters["grad_bytes"] = grad_bytes;
  state.counters["grad_allreduce_ms"] = t_grad * 1e3;
  state.counters["bucket_allreduces_ms"] = t_buckets * 1e3;
}

// (tp, dp) x bucket size x micro-batch; 20 pairs of steps each.
void train_step_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"tp", "dp", "bucket_bytes", "micro_batch"});
  for (auto [tp, dp] : {std::pair{1, 2}, std::pair{2, 2}})
    for (std::int64_t bucket : {256 << 10, 4 << 20}) b->Args({tp, dp, bucket, 2});
}

BENCHMARK(BM_train_step)
    ->Name("train_step")
    ->Apply(train_step_args)
    ->Iterations(20)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
