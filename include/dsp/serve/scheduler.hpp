#pragma once
// Scheduler: continuous batching with chunked prefill and preemption by recomputation (vLLM
// v1's scheduler, Kwon et al., SOSP'23; Agrawal et al., "Sarathi-Serve", OSDI'24). Every step:
//  1. The running requests, oldest first, each get the tokens they need next: one for a
//     decode, the rest of the prompt (or as much as the token budget leaves) for a request
//     still prefilling. Prompt tokens (prefill chunks, recomputation) share a budget of their
//     own when the step carries decodes: prefill_decode_ratio per decode, at least
//     min_prefill_chunk (EngineConfig::prefill_decode_ratio). When the free blocks cannot hold them, the newest running request is
//     preempted: its blocks are freed and it goes back to the front of the waiting queue,
//     its generated tokens kept, to be recomputed from its prompt and those tokens later.
//  2. If nothing was preempted in this step, waiting requests, first come first served, are
//     admitted while the token budget (max_num_batched_tokens), max_num_seqs and the free
//     blocks allow; a prompt that does not fit the budget is prefilled in chunks. With prefix
//     caching, an admitted request first takes the cached blocks of its prompt's prefix.
// The scheduler decides from the requests and the block counts alone (no clocks), so every
// rank of a serving group schedules the same batches.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "dsp/serve/block_manager.hpp"
#include "dsp/serve/engine_config.hpp"
#include "dsp/serve/request.hpp"

namespace dsp::serve {

/// Tokens [first, first + count) of a request run in this step; `samples` when they reach
/// the end of its sequence, so the last one's logits draw its next token.
struct ScheduledChunk {
  Request* request = nullptr;
  std::int64_t first = 0;
  std::int64_t count = 0;
  bool samples = false;
};

/// The fewest prompt tokens a step with decodes may take (EngineConfig::prefill_decode_ratio):
/// at one or two decodes a step's fixed cost, not its tokens, dominates on the CPU (the demo
/// model's decode of 1 token costs about as much as a step of 16: benchmarks/RESULTS.md, prefill
/// tokens/s by chunk), so a smaller floor would only stretch time to first token.
inline constexpr std::int64_t min_prefill_chunk = 16;

class Scheduler {
 public:
  /// config must be validated; blocks must outlive the scheduler.
  Scheduler(const EngineConfig& config, BlockManager& blocks) : config_(config), blocks_(&blocks) {}

  /// Queues a request at the back of the waiting queue.
  void add(Request& r) {
    r.status = RequestStatus::Waiting;
    waiting_.push_back(&r);
  }

  /// Removes a request from whichever queue holds it and frees its blocks (abort or finish).
  void remove(Request& r) {
    std::erase(waiting_, &r);
    std::erase(running_, &r);
    blocks_->free(r.table);
    r.status = RequestStatus::Finished;
  }

  /// The next step's batch (empty when nothing is waiting or running). Allocates the blocks
  /// its tokens need; the caller runs the batch and then calls advance().
  std::vector<ScheduledChunk> schedule() {
    std::vector<ScheduledChunk> out;
    std::int64_t budget = config_.max_num_batched_tokens;
    std::int64_t prefill_budget = prefill_cap();
    bool preempted = false;
    for (std::size_t i = 0; i < running_.size() && budget > 0;) {
      Request& r = *running_[i];
      const std::int64_t left = r.num_tokens() - r.computed;
      // At most one running request is part-way through its prompt (one cut short by a budget
      // ends the step's admissions), so the prompt budget is untouched when it comes: n >= 1.
      const std::int64_t n = left == 1 ? 1 : std::min({left, budget, prefill_budget});
      bool scheduled = true;
      while (!blocks_->allocate(r.table, r.computed + n)) {
        Request& victim = *running_.back();
        preempt(victim);
        preempted = true;
        if (&victim == &r) {
          scheduled = false;
          break;
        }
      }
      if (!scheduled) break;
      out.push_back({&r, r.computed, n, r.computed + n == r.num_tokens()});
      budget -= n;
      if (left > 1) prefill_budget -= n;
      ++i;
    }
    while (!preempted && !waiting_.empty() && budget > 0 && prefill_budget > 0 &&
           static_cast<std::int64_t>(running_.size()) < config_.max_num_seqs) {
      Request& r = *waiting_.front();
      // Prompt logits need every prompt position computed: no prefix cache for those.
      const PrefixHit hit = r.params.prompt_logits || !blocks_->prefix_caching()
                                ? PrefixHit{}
                                : blocks_->find_cached_prefix(r.all_tokens());
      const auto cached = static_cast<std::int64_t>(hit.blocks.size()) * blocks_->block_size();
      const std::int64_t left = r.num_tokens() - cached;
      const std::int64_t n = left == 1 ? 1 : std::min({left, budget, prefill_budget});
      if (!blocks_->allocate(r.table, cached + n, &hit)) break;
      waiting_.pop_front();
      r.computed = cached;
      if (r.output.empty()) r.cached_tokens = cached;
      r.status = RequestStatus::Running;
      running_.push_back(&r);
      out.push_back({&r, cached, n, cached + n == r.num_tokens()});
      budget -= n;
      if (left > 1) prefill_budget -= n;
    }
    return out;
  }

  /// After the batch ran: the chunks' keys and values are in the cache (their full blocks go
  /// to the prefix cache).
  void advance(const std::vector<ScheduledChunk>& batch) {
    for (const auto& c : batch) {
      Request& r = *c.request;
      r.computed = c.first + c.count;
      if (blocks_->prefix_caching()) blocks_->cache_full_blocks(r.table, r.all_tokens(), r.computed);
    }
  }

  std::int64_t num_waiting() const { return static_cast<std::int64_t>(waiting_.size()); }
  std::int64_t num_running() const { return static_cast<std::int64_t>(running_.size()); }
  /// Preemptions since construction.
  std::int64_t num_preemptions() const { return preemptions_; }

 private:
  // The prompt-token budget of the next step: unbounded (the token budget rules) without
  // running decodes or without a ratio; else prefill_decode_ratio per decode, at least
  // min_prefill_chunk. A decode is a running request with one token to compute.
  std::int64_t prefill_cap() const {
    const auto decodes = std::count_if(running_.begin(), running_.end(),
                                       [](const Request* r) { return r->num_tokens() - r->computed == 1; });
    if (decodes == 0 || config_.prefill_decode_ratio == 0.0) return config_.max_num_batched_tokens;
    const double scaled = std::min(std::ceil(config_.prefill_decode_ratio * static_cast<double>(decodes)),
                                   static_cast<double>(config_.max_num_batched_tokens));
    return std::max(static_cast<std::int64_t>(scaled), min_prefill_chunk);
  }

  void preempt(Request& r) {
    running_.pop_back();  // the newest running request is the last
    blocks_->free(r.table);
    r.computed = 0;
    r.status = RequestStatus::Waiting;
    r.prompt_logits.clear();
    ++r.preemptions;
    ++preemptions_;
    waiting_.push_front(&r);
  }

  const EngineConfig& config_;
  BlockManager* blocks_;
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;
  std::int64_t preemptions_ = 0;
};

}  // namespace dsp::serve
