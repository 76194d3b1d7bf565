// Pipeline bubble and activation stash of the schedules (pp::Engine) on p = 4 pipeline ranks.
//
// ## pipeline_synthetic: uniform stages of simulated compute
//
// One comm::launch of 4 ranks (DeviceMesh, pipeline = 4) per case. The hooks do no arithmetic:
// a forward of a micro-batch on one of the rank's v model chunks lasts t_f / v, a backward
// 2 t_f / v (t_f = 4 ms; v = 1 for gpipe and 1f1b, 2 for interleaved: every rank does 3 t_f of
// work per micro-batch in every schedule). The cost is a SLEEP, sleep_until(hook entry + cost),
// not a busy loop: 4 rank threads share 2 cores, and spinning would measure the CPU scheduler
// instead of the schedule (a sleeping rank is a rank waiting for its accelerator). The deadline
// is taken at hook entry, so the hook's own work (allocating / freeing the stash) is inside the
// cost; the wake-up latency (~50-100 us) lengthens busy and wall time alike. Boundary tensors
// (activations, gradients) are [64, 64] fp32.
//
// Stash, MEASURED: each forward allocates an activation Tensor [512, 256 / v] fp32 (the rank's
// layers keep 512 KiB per micro-batch, each chunk 1/v of it), holds it until that (micro-batch,
// chunk)'s backward frees it, and keeps a per-rank live sum of the bytes held; stash = its
// maximum over the run. Expected: peak in-flight (micro-batch, chunk) pairs x 512 KiB / v:
// m for GPipe, min(p - r, m) on rank r for 1F1B, min(2 (p - r - 1) + (v - 1) p + 1, v m)
// for interleaved.
//
// Bubble: pp::pipeline_bubble_fraction, 1 - sum_r busy_r / (p x max_r wall_r), busy_r = time
// in rank r's hooks, wall_r = rank r's Engine::run from a common barrier: the idle share of the
// p ranks' time until the pipeline has drained (what StepResult::bubble_fraction reports).
// theory = pp::theoretical_bubble_fraction: (p - 1) / (m + p - 1) for GPipe and 1F1B,
// (p - 1) / (v m + p - 1) interleaved (Narayanan et al., SC'21, section 2.2: a bubble of
// (p - 1)(t_f + t_b), divided by v with interleaving, against m (t_f + t_b) of work per rank).
// Counters: bubble, theory, diff_pp = 100 (bubble - theory), step_ms (max wall, mean; also the
// "Time" column), in_flight / in_flight_r0 (ScheduleStats::peak_in_flight, max over ranks /
// rank 0), stash_MiB / stash_r0_MiB (measured stash peak, max over ranks / rank 0).
//
// ## pipeline_train_step: the Trainer, TP1 x PP4
//
// Decoder of 8 layers, hidden 64, 4 heads / 2 query groups, SwiGLU 256, seq 64, vocabulary 256
// (bytes of data/tinyshakespeare.txt), untied; micro-batch 1, global batch 16: m = 16; gpipe,
// 1f1b and interleaved (--num-layers-per-virtual-pipeline-stage 1: v = 8 / (4 x 1) = 2).
// 2 warm-up steps, then one train_step per iteration. Counters: step_ms / step_sd_ms (max over
// ranks of StepResult::seconds: mean, sd), bubble (StepResult::bubble_fraction, mean over
// steps), theory, in_flight / in_flight_r0 (StepResult::peak_in_flight),
// act_MiB / act_r0_MiB (StepResult::peak_activation_bytes, dsp::memory: stash + temporaries).
// 4 rank threads share 2 cores, so the ranks' compute competes for them: a rank computes
// faster while its neighbours idle, and its hooks last longer while they compute. The measured
// bubble is therefore not the schedule's (see RESULTS.md, "Pipeline bubble").
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "../tests/data_dir.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/policy.hpp"
#include "dsp/pp/engine.hpp"
#include "dsp/train/trainer.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using dsp::comm::ThreadComm;
constexpr int kRanks = 4;                                        // p
constexpr std::chrono::microseconds kForward{4000};              // t_f
constexpr std::int64_t kStashTokens = 512, kStashHidden = 256;   // stash per micro-batch per rank
const dsp::Shape kBoundary{64, 64};
constexpr double MiB = 1024.0 * 1024.0;

dsp::pp::Schedule make(const std::string& name, int m) {
  return dsp::pp::make_schedule(name, kRanks, name == "interleaved" ? 2 : 1, m);
}

struct RankRun {
  dsp::pp::ScheduleStats stats;
  std::int64_t stash_peak = 0;
};

void pipeline_synthetic(benchmark::State& state, const std::string& name) {
  const int m = static_cast<int>(state.range(0));
  const dsp::pp::Schedule schedule = make(name, m);
  const int v = schedule.virtual_size;
  std::vector<RankRun> runs(kRanks);
  std::atomic<bool> go{false};
  double n = 0, sum_bubble = 0, sum_wall = 0;
  double in_flight = 0, in_flight_r0 = 0, stash = 0, stash_r0 = 0;
  try {
    dsp::comm::launch(kRanks, [&](ThreadComm& world) {
      dsp::DeviceMesh mesh(world, dsp::ParallelLayout{.pipeline = kRanks});
      dsp::pp::Engine<ThreadComm> engine(mesh.pipeline_group(), schedule, kBoundary);
      const int r = mesh.pp_rank();
      std::map<std::pair<int, int>, dsp::Tensor> live;  // (micro-batch, stage) -> stash
      std::int64_t live_bytes = 0, peak_bytes = 0;
      dsp::pp::Engine<ThreadComm>::Hooks hooks;
      hooks.forward = [&](int mb, int stage, dsp::Tensor) {
        const auto deadline = clock_type::now() + kForward / v;
        dsp::Tensor act({kStashTokens, kStashHidden / v});  // zero-filled: the memory is touched
        live_bytes += act.numel() * 4;
        peak_bytes = std::max(peak_bytes, live_bytes);
        live.emplace(std::pair{mb, stage}, std::move(act));
        std::this_thread::sleep_until(deadline);
        return dsp::Tensor(kBoundary);
      };
      hooks.backward = [&](int mb, int stage, dsp::Tensor, bool) {
        const auto deadline = clock_type::now() + 2 * kForward / v;
        auto it = live.find({mb, stage});
        live_bytes -= it->second.numel() * 4;
        live.erase(it);
        std::this_thread::sleep_until(deadline);
        return dsp::Tensor(kBoundary);
      };
      engine.run(hooks);  // warm-up: threads, receive workers, allocator
      for (;;) {
        if (r == 0) go.store(state.KeepRunning());
        world.barrier();
        if (!go.load()) break;
        peak_bytes = 0;
        RankRun& run = runs[static_cast<std::size_t>(r)];
        run.stats = engine.run(hooks);
        run.stash_peak = peak_bytes;
        const double bubble = dsp::pp::pipeline_bubble_fraction(mesh.pipeline_group(), run.stats);
        world.barrier();
        if (r != 0) continue;
        double wall = 0;
        for (const RankRun& q : runs) {
          wall = std::max(wall, q.stats.seconds);
          in_flight = std::max(in_flight, double(q.stats.peak_in_flight));
          stash = std::max(stash, double(q.stash_peak));
        }
        state.SetIterationTime(wall);
        n += 1, sum_wall += wall, sum_bubble += bubble;
        in_flight_r0 = std::max(in_flight_r0, double(runs[0].stats.peak_in_flight));
        stash_r0 = std::max(stash_r0, double(runs[0].stash_peak));
      }
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  const double theory = dsp::pp::theoretical_bubble_fraction(schedule);
  auto& c = state.counters;
  c["bubble"] = sum_bubble / n;
  c["theory"] = theory;
  c["diff_pp"] = 100 * (sum_bubble / n - theory);
  c["step_ms"] = 1e3 * sum_wall / n;
  c["in_flight"] = in_flight;
  c["in_flight_r0"] = in_flight_r0;
  c["stash_MiB"] = stash / MiB;
  c["stash_r0_MiB"] = stash_r0 / MiB;
}

using HostPolicy = dsp::Policy<dsp::backend::Host, ThreadComm>;

const dsp::train::TokenDataset& shakespeare(std::int64_t seq_length) {
  static const auto data = dsp::train::TokenDataset::from_file(
      dsp::test::data_dir() + "/tinyshakespeare.txt", seq_length);
  return data;
}

void pipeline_train_step(benchmark::State& state, const std::string& name) {
  const dsp::model::ModelConfig model{.vocab_size = 256, .hidden_size = 64, .num_layers = 8,
                                      .num_attention_heads = 4, .num_query_groups = 2, .ffn_hidden_size = 256,
                                      .seq_length = 64, .tie_word_embeddings = false};
  dsp::train::TrainConfig tc;
  tc.micro_batch_size = 1;
  tc.global_batch_size = 16;  // m = 16 micro-batches
  tc.train_iters = 1000;      // only shapes the learning-rate schedule
  tc.pipeline.schedule = name;
  if (name == "interleaved") tc.pipeline.num_layers_per_virtual_stage = 1;  // v = 2
  std::atomic<bool> go{false};
  std::vector<double> steps, rank_peak(kRanks), rank_act(kRanks);
  double bubble = 0, in_flight = 0, in_flight_r0 = 0, act = 0, act_r0 = 0;
  try {
    const auto& data = shakespeare(model.seq_length);
    dsp::comm::launch(kRanks, [&](ThreadComm& world) {
      dsp::DeviceMesh mesh(world, dsp::ParallelLayout{.tensor = 1, .pipeline = kRanks});
      dsp::train::Trainer<HostPolicy> trainer(model, tc, mesh, data);
      const int r = world.rank();
      for (int i = 0; i < 2; ++i) trainer.train_step();
      for (;;) {
        if (r == 0) go.store(state.KeepRunning());
        world.barrier();
        if (!go.load()) break;
        const auto res = trainer.train_step();
        rank_peak[static_cast<std::size_t>(r)] = res.peak_in_flight;
        rank_act[static_cast<std::size_t>(r)] = double(res.peak_activation_bytes);
        std::vector<double> s{res.seconds};
        world.all_reduce(std::span(s), dsp::comm::ReduceOp::Max);
        if (r != 0) continue;
        state.SetIterationTime(s[0]);
        steps.push_back(s[0]);
        bubble += res.bubble_fraction;  // already over the pipeline ranks
        in_flight = std::max(in_flight, *std::max_element(rank_peak.begin(), rank_peak.end()));
        in_flight_r0 = std::max(in_flight_r0, rank_peak[0]);
        act = std::max(act, *std::max_element(rank_act.begin(), rank_act.end()));
        act_r0 = std::max(act_r0, rank_act[0]);
      }
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  const double k = double(steps.size());
  double mean = 0, var = 0;
  for (double s : steps) mean += s / k;
  for (double s : steps) var += (s - mean) * (s - mean) / std::max(1.0, k - 1);
  const int v = name == "interleaved" ? 2 : 1;
  auto& c = state.counters;
  c["step_ms"] = 1e3 * mean;
  c["step_sd_ms"] = 1e3 * std::sqrt(var);
  c["bubble"] = bubble / k;
  c["theory"] = double(kRanks - 1) / (v * 16 + kRanks - 1);
  c["in_flight"] = in_flight;
  c["in_flight_r0"] = in_flight_r0;
  c["act_MiB"] = act / MiB;
  c["act_r0_MiB"] = act_r0 / MiB;
}

}  // namespace

// 20 synthetic steps per case (~15 s in all), 12 training steps per schedule (~15 s).
#define DSP_SYNTHETIC(name)                                                                                   \
  BENCHMARK_CAPTURE(pipeline_synthetic, name, std::string(#name))->ArgName("m")->Arg(4)->Arg(8)->Arg(16) \
      ->Iterations(20)->UseManualTime()->Unit(benchmark::kMillisecond)
#define DSP_TRAIN_STEP(name)                                       \
  BENCHMARK_CAPTURE(pipeline_train_step, name, std::string(#name)) \
      ->Iterations(12)->UseManualTime()->Unit(benchmark::kMillisecond)
DSP_SYNTHETIC(gpipe);
DSP_SYNTHETIC(1f1b);
DSP_SYNTHETIC(interleaved);
DSP_TRAIN_STEP(gpipe);
DSP_TRAIN_STEP(1f1b);
DSP_TRAIN_STEP(interleaved);

BENCHMARK_MAIN();
