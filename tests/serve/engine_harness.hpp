#pragma once
// Test harness of the serving engine: a tiny random CausalLM served by serve::Engine on a TP
// group of threads, requests added at given steps, every output collected per request.
#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/policy.hpp"
#include "dsp/serve/engine.hpp"

namespace dsp::test {

using ServeP = Policy<backend::Host, comm::ThreadComm>;

/// vocab 127 (not a multiple of 2 or 4: the gathered logits carry padding at TP2/TP4), 2
/// query groups for 4 heads (at TP4 each K/V head is replicated on two ranks), init std 0.2
/// (logits of std ~1, so sampling cuts real probability mass), 128 positions.
inline model::ModelConfig tiny_serving_model(std::int64_t kv_heads = 2) {
  model::ModelConfig c;
  c.vocab_size = 127;
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_attention_heads = 4;
  c.num_query_groups = kv_heads;
  c.ffn_hidden_size = 64;
  c.seq_length = 128;
  c.init_method_std = 0.2f;
  return c;
}
/// A DeepSeek-V3-shaped tiny model: MLA (q latent 16, KV latent 16, nope 8, rope 4, v 8; YaRN)
/// in both layers, the second an MoE layer (4 routed experts, top-2, one shared expert,
/// sigmoid router with V3's groups and expert bias). Its cache is kv_lora + rope = 20 values per
/// token per layer on every TP rank.
inline model::ModelConfig tiny_mla_serving_model() {
  model::ModelConfig c = tiny_serving_model(4);
  c.q_lora_rank = 16;
  c.kv_lora_rank = 16;
  c.qk_nope_head_dim = 8;
  c.qk_rope_head_dim = 4;
  c.v_head_dim = 8;
  c.rope_scaling = {.type = "yarn", .factor = 4, .original_max_position_embeddings = 32, .beta_fast = 32,
                    .beta_slow = 1, .mscale = 1.0, .mscale_all_dim = 1.0};
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 16;
  c.num_shared_experts = 1;
  c.first_k_dense_replace = 1;
  c.moe_router_score_function = ep::ScoreFunction::Sigmoid;
  c.moe_router_norm_topk_prob = true;
  c.moe_router_num_groups = 2;
  c.moe_router_group_topk = 1;
  c.moe_router_topk_scaling_factor = 2.5f;
  c.moe_router_enable_expert_bias = true;
  return c;
}
inline constexpr std::uint64_t kServingSeed = 7;

/// "r<i>" (built by appending: GCC 12 warns of "r" + std::to_string(i), its bug 105329).
inline std::string request_id(int i) {
  std::string id = "r";
  id += std::to_string(i);
  return id;
}

/// A request of a run: added on the driver before step `step` (0-based), aborted before step
/// `abort_at` when that is >= 0.
struct Arrival {
  std::int64_t step = 0;
  std::vector<std::int32_t> prompt;
  serve::SamplingParams params;
  std::string id;
  std::int64_t abort_at = -1;
};

/// Everything the engine reported of one request, concatenated over its steps.
struct Served {
  std::vector<std::int32_t> tokens;
  std::vector<serve::TokenLogprobs> logprobs;
  std::string text;
  std::optional<serve::FinishReason> finish;
  std::int64_t cached_tokens = 0;
  Tensor prompt_logits;
};

struct Run {
  std::map<std::string, Served> requests;
  serve::EngineStats stats;   ///< after the last step
  std::int64_t steps = 0;     ///< engine steps taken
};

/// Serves `arrivals` with `config` on a TP group of `tp` threads (a model of `model_config`
/// drawn from kServingSeed); every rank must report the same outputs (checked). `inspect`, when
/// set, is called on the driver after every step with the engine. P: the serving policy; the
/// model and the KV cache live in its backend's memory space (or in `space` when given: a
/// GuardedSpace), and a communicator other than ThreadComm is built over each thread's own
/// (StagingComm: ranks sharing one GPU).
template <class P = ServeP>
inline Run serve_requests(int tp, const serve::EngineConfig& config, const std::vector<Arrival>& arrivals,
                          const model::ModelConfig& model_config = tiny_serving_model(),
                          const std::type_identity_t<std::function<void(serve::Engine<P>&)>>& inspect = {},
                          MemorySpace* space = nullptr) {
  std::vector<Run> by_rank(static_cast<std::size_t>(tp));
  comm::launch(tp, [&](comm::ThreadComm& threads) {
    const MemorySpaceScope in_space(space ? space : memory_space(typename P::Backend{}));
    std::optional<typename P::Comm> own;
    if constexpr (!std::is_same_v<typename P::Comm, comm::ThreadComm>) own.emplace(threads.split(0, threads.rank()));
    typename P::Comm& world = [&]() -> typename P::Comm& {
      if constexpr (std::is_same_v<typename P::Comm, comm::ThreadComm>) return threads;
      else return *own;
    }();
    DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
    const InferenceMode inference;  // as dsp-serve builds its model: weights only
    model::CausalLM<P> model(model_config, mesh, kServingSeed);
    serve::Engine<P> engine(model, world, config);
    Run& run = by_rank[static_cast<std::size_t>(world.rank())];
    const bool driver = world.rank() == 0;
    std::int64_t last_arrival = 0;
    for (const auto& a : arrivals) last_arrival = std::max(last_arrival, std::max(a.step, a.abort_at));
    for (std::int64_t step = 0; !engine.stopped(); ++step) {
      REQUIRE(step < 100000);  // bounded: every test run ends long before
      if (driver) {
        for (const auto& a : arrivals) {
          if (a.step == step) engine.add_request(a.prompt, a.params, a.id);
          if (a.abort_at == step) engine.abort(a.id);
        }
        if (step > last_arrival && !engine.has_unfinished_requests()) engine.shutdown();
      }
      for (auto& out : engine.step()) {
        Served& s = run.requests[out.id];
        s.tokens.insert(s.tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
        s.logprobs.insert(s.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
        s.text += out.new_text;
        if (out.finish) s.finish = out.finish;
        s.cached_tokens = out.cached_tokens;
        if (out.prompt_logits.numel() > 0) s.prompt_logits = out.prompt_logits;
      }
      if (driver && inspect) inspect(engine);
      run.steps = step + 1;
    }
    run.stats = engine.stats();
  });
  for (int r = 1; r < tp; ++r) {
    CAPTURE(r);
    const Run& other = by_rank[static_cast<std::size_t>(r)];
    REQUIRE(other.requests.size() == by_rank[0].requests.size());
    for (const auto& [id, s] : by_rank[0].requests) {
      CAPTURE(id);
      CHECK(other.requests.at(id).tokens == s.tokens);
      CHECK(other.requests.at(id).text == s.text);
    }
  }
  return by_rank[0];
}

}  // namespace dsp::test
