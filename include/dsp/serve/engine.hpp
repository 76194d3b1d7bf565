#pragma once
// Engine<Policy>: the serving engine (vLLM's LLMEngine): requests in, continuous batches of
// ragged forward passes over a paged KV cache, tokens out.
//
//   serve::Engine<P> engine(model, world, config);   // every rank; sizes the KV cache
//   if (world.rank() == 0) engine.add_request(prompt_ids, params);
//   while (!engine.stopped()) {                       // every rank, in lockstep
//     for (const auto& out : engine.step()) ...       // the same outputs on every rank
//     if (world.rank() == 0 && !engine.has_unfinished_requests()) engine.shutdown();
//   }
//
// Ranks. The engine runs on every rank of `world` (TP x EP ranks of one pipeline stage); its
// rank 0 is the driver: add_request, abort and shutdown are called there (from any thread)
// and take effect at the next step, whose first act is to broadcast them to the other ranks.
// Every rank then schedules the same batch (the scheduler decides from requests and block
// counts alone), runs its shards of the forward pass, gathers the logits over the tensor group
// and samples the same tokens.
//
// The promise (its tests check it): a request's tokens and logits are those it gets alone,
// bitwise, whatever else is in the batch, however its prompt was chunked, whether it was
// preempted and recomputed or found its prefix in the cache. Each step runs in a
// BatchInvariantScope (every GEMM row depends on its own input row only), attention reads each
// token's own sequence in a fixed order (backend/host/paged_attention.hpp), the tensor group
// reduces in rank order, and sampling is a pure function of the logits and of (seed, stream,
// token index). A prefix-cache hit or a recomputation gives the keys and values the request
// would compute itself, bit for bit, since the key of position p depends on tokens 0..p only.
// (Over MPI or NCCL at TP > 2 the reduction order of their all-reduce may depend on the message
// size; ThreadComm's does not.)
#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <unistd.h>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/backend/batch_invariance.hpp"
#include "dsp/backend/host/copy_columns.hpp"
#include "dsp/backend/host/gemm_batch_invariant.hpp"
#include "dsp/backend/host/packed_weights.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/core/memory_space.hpp"
#include "dsp/core/threads.hpp"
#include "dsp/model/causal_lm.hpp"
#include "dsp/serve/block_manager.hpp"
#include "dsp/serve/byte_text.hpp"
#include "dsp/serve/engine_config.hpp"
#include "dsp/serve/kv_cache_pool.hpp"
#include "dsp/serve/request.hpp"
#include "dsp/serve/sampler.hpp"
#include "dsp/serve/sampling_params.hpp"
#include "dsp/serve/scheduler.hpp"
#include "dsp/tp/mappings.hpp"

namespace dsp::serve {

/// Engine counters, the same on every rank after a step (vLLM's metrics).
struct EngineStats {
  std::int64_t running = 0, waiting = 0;    ///< requests
  std::int64_t num_blocks = 0, used_blocks = 0;
  std::int64_t preemptions = 0;             ///< since the start
  std::int64_t prefix_cache_queries = 0;    ///< prompt tokens looked up in the prefix cache
  std::int64_t prefix_cache_hits = 0;       ///< of those, tokens found
  std::int64_t prompt_tokens = 0;           ///< prompt tokens computed (recomputation included, cache hits not)
  std::int64_t generation_tokens = 0;       ///< tokens generated
  std::int64_t steps = 0;                   ///< forward passes run
  double kv_cache_usage() const {
    return num_blocks > 0 ? static_cast<double>(used_blocks) / static_cast<double>(num_blocks) : 0.0;
  }
};

namespace detail {
inline void to_json(nlohmann::json& j, const SamplingParams& p) {
  j = {{"temperature", p.temperature}, {"top_k", p.top_k}, {"top_p", p.top_p}, {"min_p", p.min_p},
       {"repetition_penalty", p.repetition_penalty}, {"presence_penalty", p.presence_penalty},
       {"frequency_penalty", p.frequency_penalty}, {"seed", p.seed}, {"stream", p.stream},
       {"max_tokens", p.max_tokens}, {"stop_token_ids", p.stop_token_ids}, {"stop", p.stop},
       {"prompt_logits", p.prompt_logits}};
  if (p.logprobs) j["logprobs"] = *p.logprobs;
}
inline SamplingParams sampling_params_from_json(const nlohmann::json& j) {
  SamplingParams p;
  j.at("temperature").get_to(p.temperature);
  j.at("top_k").get_to(p.top_k);
  j.at("top_p").get_to(p.top_p);
  j.at("min_p").get_to(p.min_p);
  j.at("repetition_penalty").get_to(p.repetition_penalty);
  j.at("presence_penalty").get_to(p.presence_penalty);
  j.at("frequency_penalty").get_to(p.frequency_penalty);
  j.at("seed").get_to(p.seed);
  j.at("stream").get_to(p.stream);
  j.at("max_tokens").get_to(p.max_tokens);
  j.at("stop_token_ids").get_to(p.stop_token_ids);
  j.at("stop").get_to(p.stop);
  j.at("prompt_logits").get_to(p.prompt_logits);
  if (j.contains("logprobs")) p.logprobs = j.at("logprobs").get<std::int64_t>();
  return p;
}

// Bytes of host memory (physical RAM).
inline std::int64_t host_memory_bytes() {
  return static_cast<std::int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<std::int64_t>(sysconf(_SC_PAGESIZE));
}
}  // namespace detail

template <class Policy>
class Engine {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;
  /// The bytes of a token's text (stop strings and text output are matched on them).
  using TokenText = std::function<std::string(std::int32_t)>;

  /// Serves `model` (this rank's shards of a model on one pipeline stage, built in the current
  /// memory space; it must outlive the engine) on the ranks of `world`, rank 0 driving.
  /// Collective over world: sizes the KV cache (EngineConfig's budget rules; every rank takes
  /// the smallest block count of any rank) and allocates it in the current memory space. With
  /// the Host backend and the model in host memory it first copies the model's matmul weights
  /// into the GEMM's panel layout (backend/host/packed_weights.hpp; where the GEMM reads them):
  /// one more copy of those weights, counted in the budget, that does not follow later changes
  /// of the model's weights.
  /// Throws ConfigError for an invalid config, a max_model_len above the model's seq_length,
  /// or a KV cache that cannot hold one request of max_model_len tokens (naming both numbers).
  Engine(model::CausalLM<Policy>& model, Comm& world, EngineConfig config, TokenText token_text = byte_token_text)
      : model_(&model), world_(&world), config_(checked(std::move(config), model.config())),
        token_text_(std::move(token_text)),
        values_per_token_(model.kv_values_per_token()),
        packed_params_(weights_to_pack(model)),
        packed_(pack(packed_params_)),
        pool_(model.config().num_layers, model.layers().first_layer, values_per_token_,
              enough_blocks(shared_block_count()), config_.block_size, config_.kv_cache_dtype),
        blocks_(pool_.num_blocks(), config_.block_size, config_.enable_prefix_caching),
        scheduler_(config_, blocks_) {}
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Queues a request (driver rank only; thread-safe); it joins at the next step. Returns its
  /// id (`id`, or "req-N" when empty). Throws InputError, queuing nothing, for an empty
  /// prompt, a token id outside the vocabulary, invalid params (SamplingParams::validate), a
  /// prompt of P tokens plus max_tokens M over max_model_len (naming the three numbers), or an
  /// id already in use; Error when called on another rank or after shutdown().
  std::string add_request(std::vector<std::int32_t> prompt, const SamplingParams& params, std::string id = {}) {
    DSP_CHECK(world_->rank() == 0, "Engine::add_request: call it on rank 0 of the serving world (the driver)");
    params.validate();
    DSP_CHECK_AS(InputError, !prompt.empty(), "the prompt is empty");
    const std::int64_t vocab = model_->config().vocab_size;
    for (auto t : prompt)
      DSP_CHECK_AS(InputError, t >= 0 && t < vocab, "prompt token id ", t, " is outside the vocabulary [0, ", vocab, ")");
    const auto len = static_cast<std::int64_t>(prompt.size());
    DSP_CHECK_AS(InputError, params.max_tokens <= config_.max_model_len - len, "the prompt of ", len,
                 " tokens plus max_tokens ", params.max_tokens, " exceeds --max-model-len ", config_.max_model_len);
    const std::lock_guard lock(mutex_);
    DSP_CHECK(!shutdown_requested_, "Engine::add_request after shutdown()");
    if (id.empty()) id = "req-" + std::to_string(next_id_++);
    DSP_CHECK_AS(InputError, !known_ids_.contains(id), "request id '", id, "' is already in use");
    known_ids_.insert(id);
    nlohmann::json params_json;
    detail::to_json(params_json, params);
    pending_.push_back({{"op", "add"}, {"id", id}, {"prompt", std::move(prompt)}, {"params", std::move(params_json)}});
    return id;
  }

  /// Aborts a request (driver rank only; thread-safe) at the next step: its blocks are freed
  /// and that step reports it finished with FinishReason::Abort. An unknown or finished id is
  /// ignored.
  void abort(const std::string& id) {
    DSP_CHECK(world_->rank() == 0, "Engine::abort: call it on rank 0 of the serving world (the driver)");
    const std::lock_guard lock(mutex_);
    pending_.push_back({{"op", "abort"}, {"id", id}});
  }

  /// Ends the engine at the next step (driver rank only; thread-safe): that step aborts every
  /// unfinished request and afterwards stopped() is true on every rank.
  void shutdown() {
    DSP_CHECK(world_->rank() == 0, "Engine::shutdown: call it on rank 0 of the serving world (the driver)");
    const std::lock_guard lock(mutex_);
    shutdown_requested_ = true;
    pending_.push_back({{"op", "shutdown"}});
  }

  /// One engine step. Collective over world: every rank calls it, in lockstep. Applies the
  /// driver's queued commands, schedules a batch, runs it and samples; returns, on every rank
  /// alike, an output for every request that got tokens, finished or was aborted in this step.
  /// A step with nothing to run returns at once (after the broadcast). Throws what the forward
  /// pass and the communicators throw (a failed rank ends every rank).
  std::vector<RequestOutput> step() {
    backend::BatchInvariantScope invariant;
    check_packed_weights();
    backend::PackedWeightsScope panels(&packed_);
    std::vector<RequestOutput> outputs;
    apply(take_commands(), outputs);
    if (stopped_) return outputs;
    const std::vector<ScheduledChunk> batch = scheduler_.schedule();
    if (batch.empty()) return outputs;
    run(batch, outputs);
    ++stats_.steps;
    return outputs;
  }

  /// True once a step applied shutdown() (every rank alike).
  bool stopped() const { return stopped_; }
  /// Requests queued, waiting or running. On the driver it also counts those queued by
  /// add_request since the last step; elsewhere those known at the last step.
  bool has_unfinished_requests() const {
    const std::lock_guard lock(mutex_);
    return !requests_.empty() || std::any_of(pending_.begin(), pending_.end(),
                                             [](const nlohmann::json& c) { return c.at("op") == "add"; });
  }
  /// Counters as of the last step.
  EngineStats stats() const {
    EngineStats s = stats_;
    s.running = scheduler_.num_running();
    s.waiting = scheduler_.num_waiting();
    s.num_blocks = blocks_.num_blocks();
    s.used_blocks = blocks_.num_used_blocks();
    s.preemptions = scheduler_.num_preemptions();
    s.prefix_cache_queries = blocks_.prefix_cache_queries();
    s.prefix_cache_hits = blocks_.prefix_cache_hits();
    return s;
  }
  const EngineConfig& config() const { return config_; }
  const BlockManager& block_manager() const { return blocks_; }
  /// This rank's copy of the model's matmul weights in the GEMM's panel layout (empty where it
  /// makes none: another backend, a memory space, a machine without AVX-512).
  const backend::PackedWeights& packed_weights() const { return packed_; }
  /// Bytes of this rank's KV cache, and of one block over every layer.
  std::int64_t kv_cache_bytes() const { return pool_.bytes(); }
  std::int64_t bytes_per_block() const {
    return KvCachePool::bytes_per_block(values_per_token_, config_.block_size, config_.kv_cache_dtype);
  }

 private:
  static EngineConfig checked(EngineConfig c, const model::ModelConfig& m) {
    c.validate();
    if (c.max_model_len == 0) c.max_model_len = m.seq_length;
    DSP_CHECK_AS(ConfigError, c.max_model_len <= m.seq_length, "--max-model-len ", c.max_model_len,
                 " exceeds the model's --seq-length ", m.seq_length);
    return c;
  }

  // The KV budget of this rank in bytes (EngineConfig's rules), in blocks, and the smallest of
  // every rank's, so all ranks schedule over the same pool.
  std::int64_t shared_block_count() {
    const std::int64_t per_block = bytes_per_block();
    std::int64_t budget = 0;
    if (config_.kv_cache_memory) {
      budget = *config_.kv_cache_memory;
    } else if (config_.gpu_memory_utilization || current_memory_space()) {
      const double fraction = config_.gpu_memory_utilization.value_or(0.9);
      budget = static_cast<std::int64_t>(fraction * static_cast<double>(memory_capacity())) - model_bytes() -
               profile_peak_bytes();
    } else {
      const std::int64_t full = config_.max_num_seqs * ((config_.max_model_len + config_.block_size - 1) / config_.block_size);
      budget = std::min<std::int64_t>(std::int64_t{4} << 30, full * per_block);
    }
    std::vector<std::int64_t> blocks{std::max<std::int64_t>(0, budget / per_block)};
    world_->all_reduce(std::span(blocks), comm::ReduceOp::Min);
    return blocks[0];
  }

  // `blocks`, when they hold one request of max_model_len tokens; else throws ConfigError.
  std::int64_t enough_blocks(std::int64_t blocks) const {
    const std::int64_t need = (config_.max_model_len + config_.block_size - 1) / config_.block_size;
    DSP_CHECK_AS(ConfigError, blocks >= need, "the KV cache holds ", blocks, " blocks of ", config_.block_size,
                 " tokens (", blocks * config_.block_size, " tokens), fewer than one request of --max-model-len ",
                 config_.max_model_len, " needs: raise --kv-cache-memory / --gpu-memory-utilization or lower --max-model-len");
    return blocks;
  }

  // Bytes this rank may use: the device's memory, or on the host its RAM shared by the ranks
  // of this process and by the other processes of an mpiexec job on this node (OpenMPI's
  // OMPI_COMM_WORLD_LOCAL_SIZE).
  std::int64_t memory_capacity() const {
    if (MemorySpace* space = current_memory_space(); space && space->capacity_bytes())
      return *space->capacity_bytes();
    const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    const std::int64_t processes = local ? std::max(1, std::atoi(local)) : 1;
    return detail::host_memory_bytes() / ranks_per_process() / processes;
  }
  // Bytes the model holds on this rank: its parameters, their gradient buffers (none in a model
  // built in an InferenceMode scope, as dsp-serve builds it) and the packed copies.
  std::int64_t model_bytes() {
    std::int64_t n = packed_.bytes();
    for (auto* p : model_->parameters())
      n += (p->value.numel() + p->grad.numel()) * static_cast<std::int64_t>(sizeof(float));
    return n;
  }
  // The weights to pack: those serving multiplies by whole, of 48 rows or more (a smaller one,
  // such as a router of 8 experts, would multiply its padding), where the host GEMM reads
  // panels and the weights are in host memory; none otherwise.
  static std::vector<Parameter*> weights_to_pack(model::CausalLM<Policy>& model) {
    std::vector<Parameter*> out;
    if constexpr (std::is_same_v<Backend, backend::Host>) {
      if (!current_memory_space() && backend::reads_packed_weights())
        for (auto* p : model.serving_matmul_weights())
          if (p->value.dim(0) >= backend::packed_panel_width) out.push_back(p);
    }
    return out;
  }
  static backend::PackedWeights pack(const std::vector<Parameter*>& weights) {  // host weights (or none)
    backend::PackedWeights packed;
    for (auto* p : weights) packed.add(backend::Host{}, p->value.data(), p->value.dim(0), p->value.dim(1));
    return packed;
  }
  // The copies hold while the weights stay where they were packed: a weight moved since (new
  // values assigned to the model, ZeRO's gather and release) would be read stale, or another
  // matrix at its old address read as it. Throws Error naming the weight.
  void check_packed_weights() const {
    for (const auto* p : packed_params_) {
      const Tensor& v = p->value;
      DSP_CHECK(v.rank() == 2 && packed_.find(v.data(), v.dim(0), v.dim(1), v.dim(1)), "Engine::step: the weight ",
                p->spec.name, " moved or changed shape since the engine packed it; serve a model whose weights stay put");
    }
  }

  // Peak bytes a forward pass of max_num_batched_tokens tokens allocates beyond what is live
  // (sequences of max_model_len at most, over a scratch KV pool just large enough, whose own
  // bytes are not counted). Collective over the tensor group.
  std::int64_t profile_peak_bytes() {
    const std::int64_t tokens = config_.max_num_batched_tokens, len = config_.max_model_len;
    const std::int64_t blocks = (tokens + config_.block_size - 1) / config_.block_size + (tokens + len - 1) / len;
    KvCachePool scratch(model_->config().num_layers, model_->layers().first_layer, values_per_token_, blocks,
                        config_.block_size, config_.kv_cache_dtype);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(tokens), 0), positions(ids.size()), slots(ids.size()),
        seq(ids.size());
    const std::int64_t max_blocks = (len + config_.block_size - 1) / config_.block_size;
    std::vector<std::int32_t> tables(static_cast<std::size_t>(((tokens + len - 1) / len) * max_blocks), 0);
    std::int32_t next_block = 0;
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::int64_t s = t / len, p = t % len;
      if (p % config_.block_size == 0) tables[static_cast<std::size_t>(s * max_blocks + p / config_.block_size)] = next_block++;
      positions[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(p);
      seq[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(s);
      slots[static_cast<std::size_t>(t)] =
          tables[static_cast<std::size_t>(s * max_blocks + p / config_.block_size)] * static_cast<std::int32_t>(config_.block_size) +
          static_cast<std::int32_t>(p % config_.block_size);
    }
    const memory::Snapshot before = space_snapshot();
    reset_space_peak();
    {
      backend::BatchInvariantScope invariant;
      backend::PackedWeightsScope panels(&packed_);
      const SpaceArray<std::int32_t> d_tables(tables), d_slots(slots), d_seq(seq);
      model::PagedKvBatch paged{scratch.pools(), config_.kv_cache_dtype, config_.block_size, d_tables.data(),
                                max_blocks, d_slots.data(), d_seq.data()};
      const auto ctx = model::ForwardContext::for_serving(positions, &paged, std::vector<std::int64_t>{tokens - 1});
      (void)model_->logits(ctx, ids);
    }
    return std::max<std::int64_t>(0, space_snapshot().total.peak - before.total.live);
  }
  // The driver's queued commands, broadcast to every rank of the world.
  nlohmann::json take_commands() {
    nlohmann::json commands = nlohmann::json::array();
    if (world_->rank() == 0) {
      const std::lock_guard lock(mutex_);
      for (auto& c : pending_) commands.push_back(std::move(c));
      pending_.clear();
    }
    if (world_->size() == 1) return commands;
    std::string payload = world_->rank() == 0 && !commands.empty() ? commands.dump() : std::string();
    std::vector<std::int64_t> size{static_cast<std::int64_t>(payload.size())};
    world_->broadcast(std::span(size), 0);
    if (size[0] == 0) return nlohmann::json::array();
    payload.resize(static_cast<std::size_t>(size[0]));
    world_->broadcast(std::span(payload.data(), payload.size()), 0);
    return world_->rank() == 0 ? commands : nlohmann::json::parse(payload);
  }

  void apply(const nlohmann::json& commands, std::vector<RequestOutput>& outputs) {
    for (const auto& c : commands) {
      const std::string op = c.at("op");
      if (op == "add") {
        auto r = std::make_unique<Request>();
        r->id = c.at("id").get<std::string>();
        r->prompt = c.at("prompt").get<std::vector<std::int32_t>>();
        r->params = detail::sampling_params_from_json(c.at("params"));
        r->max_model_len = config_.max_model_len;
        r->stops = StopChecker(r->params.stop);
        Request& ref = *r;
        {
          const std::lock_guard lock(mutex_);
          requests_.emplace(ref.id, std::move(r));
        }
        scheduler_.add(ref);
      } else if (op == "abort") {
        const auto it = requests_.find(c.at("id").get<std::string>());
        if (it != requests_.end()) finish(*it->second, FinishReason::Abort, outputs);
      } else if (op == "shutdown") {
        std::vector<Request*> all;
        for (auto& [id, r] : requests_) all.push_back(r.get());
        for (Request* r : all) finish(*r, FinishReason::Abort, outputs);
        stopped_ = true;
      }
    }
  }

  // Ends a request: frees its blocks and reports it (with whatever it released this step).
  void finish(Request& r, FinishReason reason, std::vector<RequestOutput>& outputs) {
    r.finish = reason;
    scheduler_.remove(r);
    RequestOutput* out = find_output(r, outputs);
    out->finish = reason;
    out->new_text += r.stops.release(true);
    out->generated_tokens = static_cast<std::int64_t>(r.output.size());
    const std::string id = r.id;  // r dies with its map entry
    const std::lock_guard lock(mutex_);
    known_ids_.erase(id);
    requests_.erase(id);
  }

  RequestOutput* find_output(const Request& r, std::vector<RequestOutput>& outputs) {
    for (auto& o : outputs)
      if (o.id == r.id) return &o;
    RequestOutput& o = outputs.emplace_back();
    o.id = r.id;
    o.prompt_tokens = static_cast<std::int64_t>(r.prompt.size());
    o.cached_tokens = r.cached_tokens;
    o.generated_tokens = static_cast<std::int64_t>(r.output.size());
    return &o;
  }

  // Runs one scheduled batch: the ragged forward pass over the paged cache, then sampling.
  void run(const std::vector<ScheduledChunk>& batch, std::vector<RequestOutput>& outputs) {
    std::vector<std::int32_t> ids, positions, slots, seq;
    std::vector<std::int64_t> rows;        // logit rows
    std::vector<std::int64_t> sample_row;  // per chunk: index into rows, or -1
    std::vector<std::int64_t> prompt_row;  // per chunk: index into rows of its first prompt-logit row, or -1
    std::int64_t max_blocks = 1;
    for (const auto& c : batch) max_blocks = std::max<std::int64_t>(max_blocks, static_cast<std::int64_t>(c.request->table.blocks.size()));
    std::vector<std::int32_t> tables(batch.size() * static_cast<std::size_t>(max_blocks), 0);
    const std::int64_t bs = config_.block_size;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const ScheduledChunk& c = batch[i];
      const Request& r = *c.request;
      std::copy(r.table.blocks.begin(), r.table.blocks.end(), tables.begin() + static_cast<std::ptrdiff_t>(i) * max_blocks);
      const auto first_row = static_cast<std::int64_t>(ids.size());
      for (std::int64_t p = c.first; p < c.first + c.count; ++p) {
        ids.push_back(r.token(p));
        positions.push_back(static_cast<std::int32_t>(p));
        slots.push_back(r.table.blocks[static_cast<std::size_t>(p / bs)] * static_cast<std::int32_t>(bs) +
                        static_cast<std::int32_t>(p % bs));
        seq.push_back(static_cast<std::int32_t>(i));
      }
      const auto prompt_len = static_cast<std::int64_t>(r.prompt.size());
      prompt_row.push_back(-1);
      if (r.params.prompt_logits && r.output.empty()) {
        prompt_row.back() = static_cast<std::int64_t>(rows.size());
        for (std::int64_t p = c.first; p < std::min(c.first + c.count, prompt_len); ++p) rows.push_back(first_row + p - c.first);
      }
      sample_row.push_back(-1);
      if (c.samples) {
        const std::int64_t last = first_row + c.count - 1;
        if (prompt_row.back() >= 0 && !rows.empty() && rows.back() == last) sample_row.back() = static_cast<std::int64_t>(rows.size()) - 1;
        else {
          sample_row.back() = static_cast<std::int64_t>(rows.size());
          rows.push_back(last);
        }
      }
      stats_.prompt_tokens += std::min(c.first + c.count, prompt_len) - std::min(c.first, prompt_len);
    }
    Tensor logits;
    {
      const SpaceArray<std::int32_t> d_tables(tables), d_slots(slots), d_seq(seq);
      const model::PagedKvBatch paged{pool_.pools(), config_.kv_cache_dtype, bs, d_tables.data(), max_blocks,
                                      d_slots.data(), d_seq.data()};
      const auto ctx = model::ForwardContext::for_serving(positions, &paged, rows);
      const Tensor local = model_->logits(ctx, ids);  // no rows in a step of prefill chunks only
      if (!rows.empty()) logits = gathered(local).to_host();
    }
    scheduler_.advance(batch);
    const std::int64_t vocab = model_->config().vocab_size;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      Request& r = *batch[i].request;
      if (prompt_row[i] >= 0) {  // this chunk's prompt logits
        const auto prompt_len = static_cast<std::int64_t>(r.prompt.size());
        r.prompt_logits.resize(static_cast<std::size_t>(prompt_len * vocab));
        const std::int64_t n = std::min(batch[i].first + batch[i].count, prompt_len) - batch[i].first;
        std::copy_n(logits.span().begin() + prompt_row[i] * vocab, n * vocab,
                    r.prompt_logits.begin() + batch[i].first * vocab);
      }
      if (sample_row[i] < 0) continue;
      sample(r, logits.span().subspan(static_cast<std::size_t>(sample_row[i] * vocab), static_cast<std::size_t>(vocab)),
             outputs);
    }
  }

  // Draws request r's next token from its logits row [vocab] and applies the stop rules.
  void sample(Request& r, std::span<const float> raw, std::vector<RequestOutput>& outputs) {
    const std::int64_t vocab = model_->config().vocab_size;
    std::span<const float> row = raw;
    std::vector<float> penalised;  // a copy only when the request has penalties to apply
    if (r.params.penalised()) {
      penalised.assign(raw.begin(), raw.end());
      apply_penalties(penalised, vocab, r.params, r.prompt, r.output);
      row = penalised;
    }
    const std::int32_t token = sample_token(row, vocab, r.params, r.params.stream, static_cast<std::uint64_t>(r.output.size()));
    RequestOutput* out = find_output(r, outputs);
    if (r.output.empty() && r.params.prompt_logits) {
      out->prompt_logits = Tensor::host_zeros({static_cast<std::int64_t>(r.prompt.size()), vocab});
      std::copy(r.prompt_logits.begin(), r.prompt_logits.end(), out->prompt_logits.span().begin());
      r.prompt_logits = {};
    }
    if (r.params.logprobs) out->logprobs.push_back(token_logprobs(raw, vocab, token, *r.params.logprobs));
    r.output.push_back(token);
    out->new_tokens.push_back(token);
    ++stats_.generation_tokens;
    out->generated_tokens = static_cast<std::int64_t>(r.output.size());
    std::optional<FinishReason> reason;
    if (std::find(r.params.stop_token_ids.begin(), r.params.stop_token_ids.end(), token) != r.params.stop_token_ids.end())
      reason = FinishReason::Stop;  // the stop token's text is not shown
    else if (r.stops.append(token_text_(token)))
      reason = FinishReason::Stop;
    else if (static_cast<std::int64_t>(r.output.size()) >= r.params.max_tokens || r.num_tokens() >= r.max_model_len)
      reason = FinishReason::Length;
    if (reason) finish(r, *reason, outputs);
    else out->new_text += r.stops.release(false);
  }

  // This rank's logits [rows, padded_vocab / tp] -> all of them [rows, vocab]: all-gathered
  // over the tensor group, padding columns dropped.
  Tensor gathered(const Tensor& local) {
    Tensor full = tp::GatherFromTpRegion<Backend>::forward(model_->tensor_group(), local);
    const std::int64_t vocab = model_->config().vocab_size, rows = full.dim(0);
    if (full.dim(1) == vocab) return full;
    Tensor out({rows, vocab});
    copy_columns(Backend{}, full.data(), full.dim(1), 0, out.data(), vocab, 0, rows, vocab);
    return out;
  }

  model::CausalLM<Policy>* model_;
  Comm* world_;
  EngineConfig config_;
  TokenText token_text_;
  std::vector<std::int64_t> values_per_token_;
  std::vector<Parameter*> packed_params_;  // the weights packed_ copies
  backend::PackedWeights packed_;          // the model's matmul weights in panels (host), read by step()
  KvCachePool pool_;
  BlockManager blocks_;
  Scheduler scheduler_;
  mutable std::mutex mutex_;  // pending_, known_ids_, next_id_, requests_ (the map, for has_unfinished_requests)
  std::vector<nlohmann::json> pending_;
  std::set<std::string> known_ids_;
  std::int64_t next_id_ = 0;
  bool shutdown_requested_ = false;
  std::map<std::string, std::unique_ptr<Request>> requests_;
  bool stopped_ = false;
  EngineStats stats_;
};

}  // namespace dsp::serve
