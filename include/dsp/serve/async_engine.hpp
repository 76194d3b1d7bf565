#pragma once
// AsyncEngine<Policy>: the serving engine behind a server (vLLM's AsyncLLMEngine). Callers on
// any thread of the driver rank submit requests and read their outputs from an OutputQueue;
// run() steps the engine on every rank, and on the driver routes each step's outputs to the
// queues, keeping the latency metrics a /metrics endpoint shows.
//
//   serve::AsyncEngine<P> async(engine, world, {.max_queue = 256});
//   std::thread http([&] { ... async.submit({{prompt, params}}, queue) ... });  // driver only
//   async.run();                     // every rank, until drain() or shutdown() has ended it
//
// Waiting for work: an idle driver sleeps until a request arrives; with several ranks it still
// steps every `idle_step` (an empty step is one broadcast) so that the other ranks, blocked in
// that broadcast, stay under the communicator's timeout.
// Failure: when a step throws (a rank failed), every open queue is failed with the message, so
// no caller waits forever, and run() rethrows on every rank.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/serve/engine.hpp"
#include "dsp/serve/prometheus.hpp"

namespace dsp::serve {

/// The server cannot take the request now: its waiting queue is full or it is shutting down
/// (HTTP 503).
class ServerBusy : public Error {
 public:
  using Error::Error;
};

/// The outputs of one caller's requests (say the n choices of one HTTP request), in the order
/// the engine produced them. Thread-safe: the engine pushes, the caller pops.
class OutputQueue {
 public:
  /// Adds an output and wakes the reader.
  void push(RequestOutput out) {
    {
      const std::lock_guard lock(mutex_);
      outputs_.push_back(std::move(out));
    }
    ready_.notify_all();
  }
  /// Marks the queue failed (the engine stopped with `message`) and wakes the reader.
  void fail(std::string message) {
    {
      const std::lock_guard lock(mutex_);
      if (!error_) error_ = std::move(message);
    }
    ready_.notify_all();
  }
  /// Waits at most `timeout` for outputs and returns those queued (none on timeout). Throws
  /// Error with the engine's message once the queue is failed and emptied.
  std::vector<RequestOutput> pop(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    ready_.wait_for(lock, timeout, [&] { return !outputs_.empty() || error_; });
    if (outputs_.empty() && error_) throw Error("the serving engine stopped: " + *error_);
    std::vector<RequestOutput> out(std::make_move_iterator(outputs_.begin()), std::make_move_iterator(outputs_.end()));
    outputs_.clear();
    return out;
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<RequestOutput> outputs_;
  std::optional<std::string> error_;
};

/// One request to submit.
struct NewRequest {
  std::vector<std::int32_t> prompt;
  SamplingParams params;
};

/// AsyncEngine's limits.
struct AsyncEngineConfig {
  /// Requests waiting at most: submitted and not yet given their first token (queued, or in
  /// prefill); submit beyond it throws ServerBusy.
  std::int64_t max_queue = 256;
  /// With several ranks, the longest an idle driver waits before an (empty) step.
  std::chrono::milliseconds idle_step{20};
};

template <class Policy>
class AsyncEngine {
 public:
  using Comm = typename Policy::Comm;

  /// Wraps `engine` (which must outlive this) on every rank of `world`.
  AsyncEngine(Engine<Policy>& engine, Comm& world, AsyncEngineConfig config = {})
      : engine_(&engine), world_(&world), config_(config), stats_(engine.stats()) {
    DSP_CHECK_AS(ConfigError, config_.max_queue >= 1, "--max-queue must be >= 1, got ", config_.max_queue);
  }

  /// Submits requests whose outputs go to `queue` (driver rank only; thread-safe): all or none.
  /// Returns their ids. Throws ServerBusy when they would take the waiting requests over
  /// max_queue or the engine is draining; InputError from Engine::add_request (the ones
  /// already added are aborted).
  std::vector<std::string> submit(std::vector<NewRequest> requests, std::shared_ptr<OutputQueue> queue) {
    std::vector<std::string> ids;
    {
      const std::lock_guard lock(mutex_);
      if (draining_) throw ServerBusy("the server is shutting down and takes no new requests");
      if (failed_) throw ServerBusy("the serving engine stopped: " + *failed_);
      const auto n = static_cast<std::int64_t>(requests.size());
      if (waiting_ + n > config_.max_queue)
        throw ServerBusy(dsp::detail::concat("the server is busy: ", waiting_, " requests are waiting for their first token (--max-queue ",
                                             config_.max_queue, "); retry later"));
      const auto now = Clock::now();
      try {
        for (auto& r : requests) {
          ids.push_back(engine_->add_request(std::move(r.prompt), r.params));
          tracked_[ids.back()] = Tracked{queue, now, now, false};
          ++added_since_step_;
          ++waiting_;
        }
      } catch (...) {
        for (const auto& id : ids) engine_->abort(id);  // they end (and leave waiting_) at the next step
        throw;
      }
    }
    work_.notify_all();
    return ids;
  }

  /// Aborts requests (driver rank only; thread-safe): they end with FinishReason::Abort at the
  /// next step and free their blocks. Unknown or finished ids are ignored.
  void abort(const std::vector<std::string>& ids) {
    for (const auto& id : ids) engine_->abort(id);
    work_.notify_all();
  }

  /// Stops taking requests (submit throws ServerBusy) and ends run() once the unfinished ones
  /// have finished (driver rank only; thread-safe).
  void drain() {
    {
      const std::lock_guard lock(mutex_);
      draining_ = true;
    }
    work_.notify_all();
  }
  bool draining() const {
    const std::lock_guard lock(mutex_);
    return draining_;
  }

  /// Steps the engine until it stopped (every rank, collective). Throws what a step throws,
  /// after failing every open queue (driver).
  void run() {
    const bool driver = world_->rank() == 0;
    try {
      while (!engine_->stopped()) {
        if (driver) {
          wait_for_work();
          if (draining() && !engine_->has_unfinished_requests()) engine_->shutdown();
        }
        {
          const std::lock_guard lock(mutex_);
          added_since_step_ = 0;
        }
        std::vector<RequestOutput> outputs = engine_->step();
        if (driver) route(std::move(outputs));
      }
    } catch (const std::exception& e) {
      if (driver) fail_all(e.what());
      throw;
    }
    if (driver) fail_all("the engine was shut down");
  }

  /// Requests submitted that have not had their first token yet (queued or in prefill): what
  /// max_queue bounds (driver; thread-safe).
  std::int64_t waiting() const {
    const std::lock_guard lock(mutex_);
    return waiting_;
  }

  /// The engine's counters as of the last step (driver; thread-safe).
  EngineStats stats() const {
    const std::lock_guard lock(mutex_);
    return stats_;
  }

  /// Prometheus text of the engine's state and the latencies (driver; thread-safe): vLLM's
  /// metric names with the prefix "dsp:" (num_requests_running, num_requests_waiting,
  /// kv_cache_usage_perc, num_preemptions, prefix_cache_queries / hits, prompt_tokens,
  /// generation_tokens, request_success by finished_reason, time_to_first_token_seconds,
  /// inter_token_latency_seconds, e2e_request_latency_seconds), and dsp's own
  /// kv_cache_used_blocks / kv_cache_num_blocks.
  std::string metrics_text() const {
    const std::lock_guard lock(mutex_);
    namespace pm = prometheus;
    std::string out;
    pm::gauge(out, "dsp:num_requests_running", "Number of requests in the running batch.", static_cast<double>(stats_.running));
    pm::gauge(out, "dsp:num_requests_waiting", "Number of requests waiting to be scheduled.",
              static_cast<double>(stats_.waiting + added_since_step_));
    pm::gauge(out, "dsp:kv_cache_usage_perc", "KV cache usage (1 = every block in use).", stats_.kv_cache_usage());
    pm::gauge(out, "dsp:kv_cache_used_blocks", "KV cache blocks in use (referenced by a request).",
              static_cast<double>(stats_.used_blocks));
    pm::gauge(out, "dsp:kv_cache_num_blocks", "KV cache blocks per rank.", static_cast<double>(stats_.num_blocks));
    pm::counter(out, "dsp:num_preemptions", "Requests preempted (blocks freed, recomputed later).",
                static_cast<double>(stats_.preemptions));
    pm::counter(out, "dsp:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                static_cast<double>(stats_.prefix_cache_queries));
    pm::counter(out, "dsp:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                static_cast<double>(stats_.prefix_cache_hits));
    pm::counter(out, "dsp:prompt_tokens", "Prompt tokens computed (recomputation included, cache hits not).",
                static_cast<double>(stats_.prompt_tokens));
    pm::counter(out, "dsp:generation_tokens", "Tokens generated.", static_cast<double>(stats_.generation_tokens));
    pm::counter(out, "dsp:request_success", "Requests finished, by finish reason.", "finished_reason",
                {{"stop", static_cast<double>(finished_[0])},
                 {"length", static_cast<double>(finished_[1])},
                 {"abort", static_cast<double>(finished_[2])}});
    ttft_.write(out, "dsp:time_to_first_token_seconds", "Time from arrival to the first generated token.");
    itl_.write(out, "dsp:inter_token_latency_seconds", "Time between two tokens of a request.");
    e2e_.write(out, "dsp:e2e_request_latency_seconds", "Time from arrival to the last token.");
    return out;
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Tracked {
    std::shared_ptr<OutputQueue> queue;
    Clock::time_point arrival, last_token;
    bool first_token = false;
  };

  // Driver: returns when there is a request to run or a drain to finish; otherwise sleeps
  // until one arrives (one rank) or for at most idle_step (several ranks).
  void wait_for_work() {
    if (engine_->has_unfinished_requests()) return;
    std::unique_lock lock(mutex_);
    const auto ready = [&] { return draining_ || added_since_step_ > 0 || !tracked_.empty(); };
    if (world_->size() > 1) work_.wait_for(lock, config_.idle_step, ready);
    else work_.wait(lock, ready);
  }

  void route(std::vector<RequestOutput> outputs) {
    const auto now = Clock::now();
    const std::lock_guard lock(mutex_);
    stats_ = engine_->stats();
    for (auto& out : outputs) {
      const auto it = tracked_.find(out.id);
      if (it == tracked_.end()) continue;
      Tracked& t = it->second;
      if (!t.first_token && (!out.new_tokens.empty() || out.finished())) --waiting_;
      if (!out.new_tokens.empty()) {
        const double since = std::chrono::duration<double>(now - (t.first_token ? t.last_token : t.arrival)).count();
        (t.first_token ? itl_ : ttft_).observe(since);
        t.first_token = true;
        t.last_token = now;
      }
      const bool finished = out.finished();
      if (finished) {
        e2e_.observe(std::chrono::duration<double>(now - t.arrival).count());
        ++finished_[static_cast<int>(*out.finish)];
      }
      t.queue->push(std::move(out));
      if (finished) tracked_.erase(it);
    }
  }

  void fail_all(const std::string& message) {
    const std::lock_guard lock(mutex_);
    failed_ = message;
    for (auto& [id, t] : tracked_) t.queue->fail(message);
    tracked_.clear();
    waiting_ = 0;
  }

  Engine<Policy>* engine_;
  Comm* world_;
  AsyncEngineConfig config_;
  mutable std::mutex mutex_;  // everything below
  std::condition_variable work_;
  EngineStats stats_;
  std::int64_t added_since_step_ = 0;  // submitted since the last step began (wakes the driver)
  std::int64_t waiting_ = 0;           // tracked requests without their first token (the queue bound)
  bool draining_ = false;
  std::optional<std::string> failed_;
  std::map<std::string, Tracked> tracked_;
  prometheus::Histogram ttft_{prometheus::Histogram::ttft_buckets()};
  prometheus::Histogram itl_{prometheus::Histogram::itl_buckets()};
  prometheus::Histogram e2e_{prometheus::Histogram::e2e_buckets()};
  std::int64_t finished_[3] = {0, 0, 0};  // by FinishReason: stop, length, abort
};

}  // namespace dsp::serve
