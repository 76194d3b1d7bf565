#pragma once
// The serving engine's flags, in vLLM's spelling, shared by the serving programs: limits of
// continuous batching, the KV cache budget and dtype, prefix caching, and the parallel sizes
// the checkpoint is served at.
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include <CLI/CLI.hpp>

#include "cli.hpp"
#include "dsp/backend/paged_kv.hpp"
#include "dsp/checkpoint/hf_import.hpp"
#include "dsp/checkpoint/manifest.hpp"
#include "dsp/model/config.hpp"
#include "dsp/serve/engine_config.hpp"

namespace samples {

struct ServingFlags {
  int tensor_parallel = 0;  // 0: the checkpoint's TP
  int expert_parallel = 1;
  dsp::serve::EngineConfig engine;
  std::int64_t kv_cache_memory = -1;  // -1: not given
  double gpu_memory_utilization = 0;  // 0: not given
  std::string kv_cache_dtype = "fp32";

  void add_to(CLI::App& app) {
    app.add_option("--tensor-model-parallel-size,--tensor-parallel-size", tensor_parallel,
                   "serving TP size (default: the checkpoint's); serving runs one pipeline stage")
        ->check(at_least(1));
    app.add_option("--expert-parallel-size,--expert-model-parallel-size", expert_parallel,
                   "MoE models: ranks the routed experts are split over (tokens dispatched as in training); "
                   "ranks = TP x this")
        ->check(at_least(1));
    app.add_option("--max-num-seqs", engine.max_num_seqs, "requests running at once at most")->check(at_least(1));
    app.add_option("--max-num-batched-tokens", engine.max_num_batched_tokens,
                   "tokens per forward pass at most (longer prompts are prefilled in chunks)")
        ->check(at_least(1));
    app.add_option("--prefill-decode-ratio", engine.prefill_decode_ratio,
                   "in a step with decodes, prompt tokens at most this many per decode (at least 16), so that new "
                   "prompts do not stall running requests; 0: no cap but --max-num-batched-tokens")
        ->check(CLI::NonNegativeNumber);
    app.add_option("--max-model-len", engine.max_model_len,
                   "prompt + generated tokens of a request at most (default: the model's --seq-length)")
        ->check(at_least(1));
    app.add_option("--block-size", engine.block_size, "tokens per KV cache block")->check(at_least(1));
    app.add_option("--kv-cache-memory", kv_cache_memory, "bytes of KV cache per rank (overrides --gpu-memory-utilization)")
        ->check(at_least(0));
    app.add_option("--gpu-memory-utilization", gpu_memory_utilization,
                   "fraction of the device's memory (host RAM on the CPU, shared by the ranks) a rank may use; the KV "
                   "cache gets it minus the weights and a profiling step's activations (default: 0.9 on a GPU; on the "
                   "CPU the cache of --max-num-seqs full-length requests, at most 4 GiB)");
    app.add_option("--kv-cache-dtype", kv_cache_dtype, "fp32, bf16 or fp16 (16 bits stored: half the bytes)")
        ->check(CLI::IsMember({"fp32", "bf16", "fp16", "auto"}));
    app.add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", engine.enable_prefix_caching,
                 "share the KV blocks of common prompt prefixes between requests");
  }

  /// The serving ranks for the checkpoint in `dir` of model `m`: {TP (the checkpoint's when not
  /// given; 1 for a Hugging Face model folder), EP}. Throws ConfigError for EP > 1 on a dense model.
  std::pair<int, int> parallel_sizes(const std::string& dir, const dsp::model::ModelConfig& m) const {
    const int tp = tensor_parallel > 0                               ? tensor_parallel
                   : dsp::checkpoint::is_hugging_face_folder(dir) ? 1
                                                                   : dsp::checkpoint::read_manifest(dir).meta.layout.tensor;
    DSP_CHECK_AS(dsp::ConfigError, expert_parallel == 1 || m.is_moe(), "--expert-parallel-size ", expert_parallel,
                 " needs an MoE model; this checkpoint's is dense");
    return {tp, expert_parallel};
  }

  /// The engine config the flags give (validated).
  dsp::serve::EngineConfig config() const {
    dsp::serve::EngineConfig c = engine;
    if (kv_cache_memory >= 0) c.kv_cache_memory = kv_cache_memory;
    if (gpu_memory_utilization != 0) c.gpu_memory_utilization = gpu_memory_utilization;
    c.kv_cache_dtype = dsp::backend::kv_cache_dtype_from_name(kv_cache_dtype == "auto" ? "fp32" : kv_cache_dtype);
    c.validate();
    return c;
  }
};

}  // namespace samples
