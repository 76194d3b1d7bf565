// ZeRO stages 0-3 (zero::ZeroOptimizer) on data-parallel ranks, in fp32 and in bf16 mixed
// precision: training-step time and the model-state bytes each rank holds.
//
// ## zero_step/<precision>/stage/dp   (precision fp32 or bf16: precision::Bf16Mixed)
//
// One comm::launch of dp ranks (threads) training the demo model's shape (4 layers, hidden 128,
// vocabulary 256, sequence 128, tied embeddings: 0.83 M parameters) on tiny Shakespeare, micro
// batch 2 per rank, no gradient accumulation, --ddp-bucket-size 1 MiB, overlap on. Two warm-up
// steps, then every benchmark iteration is one train_step; its time is the slowest rank's
// StepResult::seconds (manual time).
//
// Counters:
//   state_bytes       parameters + gradients + optimizer state a rank holds between steps
//                     (dsp::memory live bytes of those categories after a step, rank 0)
//   bytes_per_param   state_bytes / parameters of the model (ZeRO paper figures: fp32
//                     16, 8 + 8/N, 4 + 12/N, 16/N; mixed 16, 4 + 12/N, 2 + 14/N, 16/N)
//   peak_bytes        the rank's peak of all tensor bytes over the measured steps (includes
//                     activations, gathered parameters, communication payloads)
//   comm_peak_bytes   its peak of communication buffers (bucket payloads, gathers)
// What it shows: the memory a stage saves and what it costs in time. Stage 1 adds nothing to
// the communicated volume (reduce-scatter + all-gather = one all-reduce); stage 2 the same;
// stage 3 all-gathers every part's parameters again for the forward and for the backward.
// bf16 halves the bytes communicated (gradients and gathered parameters travel in bf16) and adds
// the widening of each part's parameters before use and of the gradients in the update.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <filesystem>
#include <vector>

#include "../tests/data_dir.hpp"
#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/trainer.hpp"

namespace {

using dsp::comm::ThreadComm;
using Fp32Policy = dsp::Policy<dsp::backend::Host, ThreadComm>;
using Bf16Policy = dsp::Policy<dsp::backend::Host, ThreadComm, dsp::precision::Bf16Mixed>;
using dsp::memory::Category;

const dsp::train::TokenDataset& shakespeare(std::int64_t seq_length) {
  static const auto data = dsp::train::TokenDataset::from_file(
      dsp::test::data_dir() + "/tinyshakespeare.txt", seq_length);
  return data;
}

template <class Policy>
void BM_zero_step(benchmark::State& state) {
  const int stage = static_cast<int>(state.range(0)), dp = static_cast<int>(state.range(1));
  const dsp::model::ModelConfig model{.vocab_size = 256, .hidden_size = 128, .num_layers = 4,
                                      .num_attention_heads = 4, .num_query_groups = 2, .ffn_hidden_size = 384,
                                      .seq_length = 128, .tie_word_embeddings = true};
  dsp::train::TrainConfig tc;
  tc.micro_batch_size = 2;
  tc.global_batch_size = 2 * dp;
  tc.train_iters = 1000;  // only shapes the learning-rate schedule
  tc.ddp.bucket_size_bytes = 1 << 20;
  tc.ddp.overlap_grad_reduce = true;
  tc.zero_stage = stage;
  const int steps = 12;
  std::vector<double> seconds;
  std::int64_t state_bytes = 0, peak = 0, comm_peak = 0, parameters = 0;
  try {
    dsp::comm::launch(dp, [&](ThreadComm& world) {
      const dsp::memory::Snapshot before = dsp::memory::snapshot();
      dsp::DeviceMesh mesh(world, dsp::ParallelLayout{.data = dp});
      dsp::train::Trainer<Policy> trainer(model, tc, mesh, shakespeare(model.seq_length));
      for (int i = 0; i < 2; ++i) trainer.train_step();
      dsp::memory::reset_peak();
      std::vector<double> mine;
      for (int i = 0; i < steps; ++i) {
        world.barrier();
        std::vector<double> t{trainer.train_step().seconds};
        world.all_reduce(std::span(t), dsp::comm::ReduceOp::Max);
        mine.push_back(t[0]);
      }
      if (world.rank() != 0) return;
      const dsp::memory::Snapshot now = dsp::memory::snapshot();
      for (Category c : {Category::Parameters, Category::Gradients, Category::OptimizerState})
        state_bytes += now[c].live - before[c].live;
      peak = now.total.peak - before.total.live;
      comm_peak = now[Category::Communication].peak;
      for (auto* p : trainer.parameters()) parameters += dsp::numel(p->spec.global_shape);
      seconds = std::move(mine);
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  std::size_t i = 0;
  for (auto _ : state) state.SetIterationTime(seconds[i++ % seconds.size()]);
  state.counters["stage"] = stage;
  state.counters["dp"] = dp;
  state.counters["state_bytes"] = double(state_bytes);
  state.counters["bytes_per_param"] = double(state_bytes) / double(parameters);
  state.counters["peak_bytes"] = double(peak);
  state.counters["comm_peak_bytes"] = double(comm_peak);
}

void zero_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"stage", "dp"});
  for (int dp : {2, 4})
    for (int stage : {0, 1, 2, 3}) b->Args({stage, dp});
}

}  // namespace

BENCHMARK(BM_zero_step<Fp32Policy>)->Name("zero_step/fp32")->Apply(zero_args)->Iterations(12)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_zero_step<Bf16Policy>)->Name("zero_step/bf16")->Apply(zero_args)->Iterations(12)->UseManualTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
