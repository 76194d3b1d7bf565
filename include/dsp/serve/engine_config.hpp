#pragma once
// EngineConfig: the serving engine's limits and KV cache budget, named as vLLM's flags.
#include <cmath>
#include <cstdint>
#include <optional>

#include "dsp/backend/paged_kv.hpp"
#include "dsp/core/error.hpp"

namespace dsp::serve {

struct EngineConfig {
  std::int64_t block_size = 16;                ///< --block-size: tokens per KV cache block
  std::int64_t max_num_seqs = 256;             ///< --max-num-seqs: running requests at most
  std::int64_t max_num_batched_tokens = 2048;  ///< --max-num-batched-tokens: tokens per forward pass at most
  /// --prefill-decode-ratio: in a step that carries decodes, prompt tokens (prefill chunks and
  /// recomputation) at most this many per decode token, and at least min_prefill_chunk; 0: no
  /// cap but max_num_batched_tokens (vLLM's scheduler). Sarathi-Serve's stall-free batching
  /// (Agrawal et al., OSDI'24) with the budget scaled to the batch: on the CPU a step costs about
  /// its tokens, so 1 keeps a step with prompts within about twice a decode-only step, and the
  /// inter-token latency of running requests from jumping when new prompts arrive
  /// (benchmarks/RESULTS.md: at concurrency 32 on the demo model the p99 inter-token latency
  /// fell from 3.3-4.6x the median without the cap to <= 3x with it, at the same throughput).
  double prefill_decode_ratio = 1.0;
  /// --max-model-len: prompt + generated tokens of a request at most; 0 = the model's seq_length.
  std::int64_t max_model_len = 0;
  /// --kv-cache-memory: bytes of KV cache per rank; overrides gpu_memory_utilization.
  std::optional<std::int64_t> kv_cache_memory;
  /// --gpu-memory-utilization: the fraction of the device's memory (of host RAM on the CPU,
  /// shared by the ranks of a process) the rank may use; the KV cache gets it minus what the
  /// model holds (weights, their packed copies, gradient buffers of a model built with them)
  /// and the peak activations of a profiling forward of max_num_batched_tokens tokens
  /// (vLLM's recipe). Without either field: 0.9 on a GPU; on the host the KV cache of
  /// max_num_seqs full-length sequences, at most 4 GiB (vLLM's CPU default KV space).
  std::optional<double> gpu_memory_utilization;
  backend::KvCacheDType kv_cache_dtype = backend::KvCacheDType::Fp32;  ///< --kv-cache-dtype
  bool enable_prefix_caching = false;          ///< --enable-prefix-caching

  /// Throws ConfigError naming the flag and the value for a size below 1, a negative
  /// max_model_len, kv_cache_memory or prefill_decode_ratio, or a utilization outside (0, 1].
  void validate() const {
    DSP_CHECK_AS(ConfigError, block_size >= 1, "--block-size must be >= 1, got ", block_size);
    DSP_CHECK_AS(ConfigError, max_num_seqs >= 1, "--max-num-seqs must be >= 1, got ", max_num_seqs);
    DSP_CHECK_AS(ConfigError, max_num_batched_tokens >= 1, "--max-num-batched-tokens must be >= 1, got ",
                 max_num_batched_tokens);
    DSP_CHECK_AS(ConfigError, std::isfinite(prefill_decode_ratio) && prefill_decode_ratio >= 0.0,
                 "--prefill-decode-ratio must be >= 0 (0: no cap), got ", prefill_decode_ratio);
    DSP_CHECK_AS(ConfigError, max_model_len >= 0, "--max-model-len must be >= 1 (0: the model's), got ",
                 max_model_len);
    DSP_CHECK_AS(ConfigError, !kv_cache_memory || *kv_cache_memory >= 0, "--kv-cache-memory must be >= 0, got ",
                 kv_cache_memory.value_or(0));
    DSP_CHECK_AS(ConfigError,
                 !gpu_memory_utilization || (std::isfinite(*gpu_memory_utilization) && *gpu_memory_utilization > 0.0 &&
                                             *gpu_memory_utilization <= 1.0),
                 "--gpu-memory-utilization must be in (0, 1], got ", gpu_memory_utilization.value_or(0.0));
  }
};

}  // namespace dsp::serve
