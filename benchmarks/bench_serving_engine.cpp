// The serving engine in process (serve::Engine on the host, TP1, fp32 weights and KV cache),
// against the limits of this machine measured in the same run.
//
// decode/<model>/batch:B   B requests of a 32-token prompt, all decoding; one engine step (B
//     new tokens) per iteration, contexts growing from 32.
//       tokens_per_s       B / step time
//       roofline_tokens_per_s  B / max(bytes / copy bandwidth, FLOPs / sgemm peak) per step,
//                          bytes = the weights the step's GEMMs read (every matrix once; the
//                          embedding gather reads B rows only) + the KV cache its attention
//                          reads, FLOPs = 2 x matmul parameters x B + attention 4 x context x
//                          heads x head_dim per layer and token
//       roofline_fraction  tokens_per_s / roofline_tokens_per_s
//       copy_GBps, peak_GFLOPs  the two limits: memcpy of 512 MiB (beyond any cache), and the
//                          faster of OpenBLAS sgemm on 1024^3 (train::measure_sgemm_peak) and
//                          the batch-invariant GEMM on 64 x 1024 x 1024, all on every core
// prefill/<model>/chunk:C  one prompt of P tokens (demo 120, 100m 480), max_num_batched_tokens
//     C: prefill tokens per second until its first token.
// prefix_ttft/<model>/cached:0|1  time to first token of a 100-token prompt sharing its first
//     90 tokens with a request served before it, with prefix caching off and on
//     (--block-size 8: 88 tokens of full blocks shared, 12 computed).
// scheduler/running:N      the scheduler alone (no forward pass): one schedule() + advance()
//     of N decoding requests, per step.
// Models: demo = samples/configs/demo.json (4 layers, hidden 128, 0.8 M parameters, in cache);
// 100m = 8 layers, hidden 1024, 16 heads, 4 KV groups, SwiGLU 2816, vocab 32000 (untied):
// 155.7 M parameters, of which 123.0 M in the matrices a decode step reads (90.2 M in the
// layers, 32.8 M the output layer): 492 MB of fp32 weights per step. demo_moe and demo_mla:
// the MoE demos (samples/configs/demo_moe.json: GQA; demo_mla.json: DeepSeek-V3's MLA, its
// cache the KV latent, attention in the absorbed form), decode only, tokens_per_s, step_ms and
// kv_bytes_per_token without a roofline (their steps read only the routed experts).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/policy.hpp"
#include "dsp/serve/engine.hpp"
#include "dsp/train/metrics.hpp"

namespace {

using P = dsp::Policy<dsp::backend::Host, dsp::comm::ThreadComm>;

dsp::model::ModelConfig model_config(const std::string& name) {
  dsp::model::ModelConfig c;
  if (name == "demo_moe" || name == "demo_mla") {  // samples/configs/demo_moe.json, demo_mla.json
    c = model_config("demo");
    c.num_experts = 8;
    c.moe_router_topk = 2;
    c.moe_ffn_hidden_size = 128;
    c.num_shared_experts = 1;
    c.first_k_dense_replace = 1;
    c.moe_router_score_function = dsp::ep::ScoreFunction::Sigmoid;
    c.moe_router_enable_expert_bias = true;
    if (name == "demo_mla") {
      c.num_query_groups = c.num_attention_heads;
      c.q_lora_rank = 64;
      c.kv_lora_rank = 32;
      c.qk_nope_head_dim = 32;
      c.qk_rope_head_dim = 16;
      c.v_head_dim = 32;
      c.moe_router_norm_topk_prob = true;
      c.moe_router_topk_scaling_factor = 2.5f;
      c.moe_router_num_groups = 4;
      c.moe_router_group_topk = 2;
    }
  } else if (name == "demo") {
    c.vocab_size = 256;
    c.hidden_size = 128;
    c.num_layers = 4;
    c.num_attention_heads = 4;
    c.num_query_groups = 2;
    c.ffn_hidden_size = 384;
    c.seq_length = 128;
  } else {
    c.vocab_size = 32000;
    c.hidden_size = 1024;
    c.num_layers = 8;
    c.num_attention_heads = 16;
    c.num_query_groups = 4;
    c.ffn_hidden_size = 2816;
    c.seq_length = 512;
  }
  return c;
}

// FLOP/s of the batch-invariant GEMM (backend/host/gemm_batch_invariant.hpp) on 64 x 1024 x
// 1024, every core, for `seconds`.
double batch_invariant_peak(double seconds) {
  constexpr std::int64_t m = 64, n = 1024;
  std::vector<float> a(m * n, 1.0f), b(n * n, 0.5f), c(m * n);
  dsp::backend::gemm_nt_batch_invariant(dsp::backend::Host{}, m, n, n, a.data(), n, b.data(), n, c.data(), n);
  const auto t0 = std::chrono::steady_clock::now();
  std::int64_t reps = 0;
  double elapsed = 0.0;
  do {
    dsp::backend::gemm_nt_batch_invariant(dsp::backend::Host{}, m, n, n, a.data(), n, b.data(), n, c.data(), n);
    ++reps;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (elapsed < seconds);
  return 2.0 * static_cast<double>(m * n * n) * static_cast<double>(reps) / elapsed;
}

// The machine's limits, measured once per run.
struct Limits {
  double copy_bytes_per_s = 0, peak_flops = 0;
  static const Limits& get() {
    static const Limits l = [] {
      Limits out;
      // The faster of OpenBLAS and the batch-invariant GEMM serving runs (on this kind of
      // machine Debian's OpenBLAS reaches ~35-50 GFLOP/s, the batch-invariant kernel ~90).
      out.peak_flops = std::max(dsp::train::measure_sgemm_peak<dsp::backend::Host>(0.5), batch_invariant_peak(0.5));
      const std::size_t n = std::size_t{512} << 20;
      std::vector<char> a(n, 1), b(n, 2);
      std::memcpy(b.data(), a.data(), n);  // fault the pages in
      double best = 1e30;
      for (int i = 0; i < 3; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        std::memcpy(b.data(), a.data(), n);
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      out.copy_bytes_per_s = 2.0 * static_cast<double>(n) / best;  // read + write
      benchmark::DoNotOptimize(b.data());
      return out;
    }();
    return l;
  }
};

std::vector<std::int32_t> prompt(std::size_t len, std::size_t offset = 0) {
  static const std::string text =
      "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\nFirst Citizen:\nYou are "
      "all resolved rather to die than to famish?\nAll:\nResolved. resolved.\nFirst Citizen:\nFirst, you know Caius "
      "Marcius is chief enemy to the people.\n";
  std::vector<std::int32_t> out;
  for (std::size_t i = 0; i < len; ++i) out.push_back(static_cast<unsigned char>(text[(i + offset) % text.size()]));
  return out;
}

// Runs body(engine, model) on one rank holding a random model of `name`.
template <class Body>
void with_engine(const std::string& name, dsp::serve::EngineConfig config, Body body) {
  dsp::comm::launch(1, [&](dsp::comm::ThreadComm& world) {
    dsp::DeviceMesh mesh(world, dsp::ParallelLayout{});
    const dsp::InferenceMode inference;  // as dsp-serve builds its model: no gradient buffers
    dsp::model::CausalLM<P> model(model_config(name), mesh, 1);
    dsp::serve::Engine<P> engine(model, world, config);
    body(engine, model);
  });
}

void BM_decode(benchmark::State& state, const std::string& name) {
  const auto batch = state.range(0);
  const Limits& limits = Limits::get();
  const auto c = model_config(name);
  with_engine(name, {}, [&](dsp::serve::Engine<P>& engine, dsp::model::CausalLM<P>&) {
    const std::int64_t prompt_len = 32;
    dsp::serve::SamplingParams params;
    params.max_tokens = c.seq_length - prompt_len;
    for (std::int64_t b = 0; b < batch; ++b) engine.add_request(prompt(prompt_len, static_cast<std::size_t>(b)), params);
    engine.step();  // every prefill in one step (B x 32 <= 2048 tokens)
    std::int64_t context = prompt_len, steps = 0;
    double kv_bytes = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (auto _ : state) {
      engine.step();
      kv_bytes += static_cast<double>(batch * ++context) * static_cast<double>(engine.bytes_per_block()) /
                  static_cast<double>(engine.config().block_size);
      ++steps;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // The matrices a step multiplies by: all but the norms and, untied, the input embedding
    // table (a lookup reads B rows of it); a tied table once, as the output layer.
    const double matmul = static_cast<double>(c.num_parameters() - (2 * c.num_layers + 1) * c.hidden_size -
                                              (c.tie_word_embeddings ? 0 : c.vocab_size * c.hidden_size));
    const double weight_bytes = 4.0 * matmul;
    const double attn_flops = 4.0 * static_cast<double>(c.num_layers * c.num_attention_heads * c.head_dim()) *
                              static_cast<double>(batch) * (static_cast<double>(prompt_len) + steps / 2.0);
    const double flops = 2.0 * matmul * static_cast<double>(batch) + attn_flops;
    const double step_time = std::max((weight_bytes + kv_bytes / static_cast<double>(steps)) / limits.copy_bytes_per_s,
                                      flops / limits.peak_flops);
    const double tps = static_cast<double>(batch * steps) / seconds;
    state.counters["tokens_per_s"] = tps;
    state.counters["step_ms"] = 1e3 * seconds / static_cast<double>(steps);
    state.counters["kv_bytes_per_token"] = static_cast<double>(engine.bytes_per_block() / engine.config().block_size);
    if (c.is_moe()) return;  // the roofline below reads every weight: dense models only
    state.counters["roofline_tokens_per_s"] = static_cast<double>(batch) / step_time;
    state.counters["roofline_fraction"] = tps * step_time / static_cast<double>(batch);
    state.counters["copy_GBps"] = limits.copy_bytes_per_s / 1e9;
    state.counters["peak_GFLOPs"] = limits.peak_flops / 1e9;
  });
}

void BM_prefill(benchmark::State& state, const std::string& name) {
  const auto chunk = state.range(0);
  const auto c = model_config(name);
  const std::int64_t len = name == "demo" ? 120 : 480;
  dsp::serve::EngineConfig config;
  config.max_num_batched_tokens = chunk;
  with_engine(name, config, [&](dsp::serve::Engine<P>& engine, dsp::model::CausalLM<P>&) {
    double seconds = 0;
    for (auto _ : state) {
      const auto t0 = std::chrono::steady_clock::now();
      engine.add_request(prompt(static_cast<std::size_t>(len)), {.max_tokens = 1});
      while (engine.has_unfinished_requests()) engine.step();
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    state.counters["prefill_tokens_per_s"] = static_cast<double>(len * state.iterations()) / seconds;
    state.counters["ttft_ms"] = 1e3 * seconds / static_cast<double>(state.iterations());
  });
}

void BM_prefix_ttft(benchmark::State& state, const std::string& name) {
  dsp::serve::EngineConfig config;
  config.enable_prefix_caching = state.range(0) == 1;
  config.block_size = 8;
  with_engine(name, config, [&](dsp::serve::Engine<P>& engine, dsp::model::CausalLM<P>&) {
    double seconds = 0;
    std::int64_t computed = 0;
    std::size_t round = 0;
    for (auto _ : state) {
      state.PauseTiming();
      auto first = prompt(100, 7 * round++);  // a new shared prefix each round
      engine.add_request(first, {.max_tokens = 1});
      while (engine.has_unfinished_requests()) engine.step();
      auto second = first;
      for (std::size_t i = 90; i < 100; ++i) second[i] = 33 + static_cast<std::int32_t>(i % 7);
      const std::int64_t before = engine.stats().prompt_tokens;
      state.ResumeTiming();
      const auto t0 = std::chrono::steady_clock::now();
      engine.add_request(second, {.max_tokens = 1});
      while (engine.has_unfinished_requests()) engine.step();
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      computed += engine.stats().prompt_tokens - before;
    }
    state.counters["ttft_ms"] = 1e3 * seconds / static_cast<double>(state.iterations());
    state.counters["prompt_tokens_computed"] = static_cast<double>(computed) / static_cast<double>(state.iterations());
  });
}

void BM_scheduler(benchmark::State& state) {
  const auto running = state.range(0);
  dsp::serve::EngineConfig config;
  config.max_num_seqs = running;
  dsp::serve::BlockManager blocks(running * 64, config.block_size, true);
  dsp::serve::Scheduler scheduler(config, blocks);
  std::vector<dsp::serve::Request> requests(static_cast<std::size_t>(running));
  for (std::size_t i = 0; i < requests.size(); ++i) {
    requests[i].id = std::to_string(i);
    requests[i].prompt = prompt(32, i);
    requests[i].params.max_tokens = 1 << 30;
    scheduler.add(requests[i]);
  }
  scheduler.advance(scheduler.schedule());  // the prefills
  for (auto _ : state) {
    const auto batch = scheduler.schedule();
    scheduler.advance(batch);
    for (const auto& chunk : batch) chunk.request->output.push_back(65);  // the sampled token
    if (requests[0].num_tokens() > 60 * 16) {  // keep the contexts bounded
      state.PauseTiming();
      for (auto& r : requests) {
        scheduler.remove(r);
        r.output.clear();
        r.computed = 0;
        scheduler.add(r);
      }
      scheduler.advance(scheduler.schedule());
      state.ResumeTiming();
    }
  }
  state.counters["us_per_step"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 1e-6, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

}  // namespace

BENCHMARK_CAPTURE(BM_decode, demo, std::string("demo"))->RangeMultiplier(2)->Range(1, 64)->Iterations(80)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_decode, 100m, std::string("100m"))->RangeMultiplier(2)->Range(1, 64)->Iterations(24)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_decode, demo_moe, std::string("demo_moe"))->RangeMultiplier(4)->Range(1, 64)->Iterations(80)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_decode, demo_mla, std::string("demo_mla"))->RangeMultiplier(4)->Range(1, 64)->Iterations(80)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_prefill, demo, std::string("demo"))->Arg(8)->Arg(32)->Arg(128)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_prefill, 100m, std::string("100m"))->Arg(16)->Arg(64)->Arg(256)->Arg(512)->Iterations(3)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_prefix_ttft, demo, std::string("demo"))->ArgName("cached")->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_prefix_ttft, 100m, std::string("100m"))->ArgName("cached")->Arg(0)->Arg(1)->Iterations(4)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_scheduler)->ArgName("running")->Arg(1)->Arg(16)->Arg(64)->Arg(256)->UseRealTime();
BENCHMARK_MAIN();
