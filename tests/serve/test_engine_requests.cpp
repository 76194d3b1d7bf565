// serve::Engine's request handling: bad requests are refused with the value named while the
// others go on; aborts and 1,000 requests leave every block free; a prompt sharing 90 of its
// 100 tokens with an earlier one computes only the rest; stop strings across token
// boundaries, stop tokens, log-probabilities and penalties against full-forward references;
// the KV cache sized from a budget as the ledger predicts, with kv_heads / TP heads per rank;
// the same for MLA, whose latent is whole on every TP rank; MoE models (GQA and MLA) served
// with the experts split over ranks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "dsp/plan/ledger.hpp"
#include "dsp/serve/full_logits.hpp"
#include "engine_harness.hpp"

using namespace dsp;
using test::Arrival;
using test::serve_requests;

namespace serve_engine_requests_test {

namespace {

std::vector<std::int32_t> text_ids(const std::string& s) { return {s.begin(), s.end()}; }

serve::SamplingParams greedy(std::int64_t max_tokens) {
  serve::SamplingParams p;
  p.max_tokens = max_tokens;
  return p;
}

// Runs fn(model, world) on a TP1 rank holding the tiny serving model.
template <class Fn>
void with_model(Fn fn, const model::ModelConfig& config = test::tiny_serving_model()) {
  comm::launch(1, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{});
    model::CausalLM<test::ServeP> model(config, mesh, test::kServingSeed);
    fn(model, world);
  });
}

}  // namespace

TEST_CASE("engine requests: bad requests are refused naming the value; the other requests go on") {
  with_model([](model::CausalLM<test::ServeP>& model, comm::ThreadComm& world) {
    serve::Engine<test::ServeP> engine(model, world, {});
    const std::string a = engine.add_request(text_ids("ROMEO:"), greedy(5));
    const auto refused = [&](std::vector<std::int32_t> prompt, serve::SamplingParams params, const std::string& what) {
      CAPTURE(what);
      try {
        engine.add_request(std::move(prompt), params);
        FAIL("accepted");
      } catch (const InputError& e) {
        CHECK(std::string(e.what()).find(what) != std::string::npos);
      }
    };
    refused({}, greedy(5), "the prompt is empty");
    refused({1, 127, 2}, greedy(5), "prompt token id 127 is outside the vocabulary [0, 127)");
    refused({1, -3}, greedy(5), "prompt token id -3");
    refused(std::vector<std::int32_t>(100, 65), greedy(29),
            "the prompt of 100 tokens plus max_tokens 29 exceeds --max-model-len 128");
    auto p = greedy(5);
    p.top_p = 1.5f;
    refused({1}, p, "top_p must be in (0, 1], got 1.5");
    p = greedy(5);
    p.top_p = 0.0f;
    refused({1}, p, "top_p must be in (0, 1], got 0");
    p = greedy(5);
    p.repetition_penalty = 0.0f;
    refused({1}, p, "repetition_penalty must be > 0 (1: off), got 0");
    p = greedy(5);
    p.presence_penalty = 2.5f;
    refused({1}, p, "presence_penalty must be in [-2, 2], got 2.5");
    p = greedy(5);
    p.frequency_penalty = -3.0f;
    refused({1}, p, "frequency_penalty must be in [-2, 2], got -3");
    p = greedy(5);
    p.temperature = -1.0f;
    refused({1}, p, "temperature must be finite and >= 0, got -1");
    refused({1}, greedy(0), "max_tokens must be >= 1, got 0");
    CHECK_NOTHROW(engine.add_request(std::vector<std::int32_t>(100, 65), greedy(28)));  // 128 fits exactly
    CHECK_THROWS_WITH_AS(engine.add_request({1}, greedy(1), a), "request id 'req-0' is already in use", InputError);
    std::map<std::string, std::int64_t> tokens;
    for (int step = 0; engine.has_unfinished_requests() && step < 200; ++step)
      for (const auto& out : engine.step()) tokens[out.id] += static_cast<std::int64_t>(out.new_tokens.size());
    CHECK(tokens.size() == 2);
    CHECK(tokens[a] == 5);
    CHECK(engine.block_manager().num_used_blocks() == 0);
  });
  // Engine configs that cannot work name the numbers.
  with_model([](model::CausalLM<test::ServeP>& model, comm::ThreadComm& world) {
    serve::EngineConfig c;
    c.max_model_len = 200;
    CHECK_THROWS_WITH_AS(serve::Engine<test::ServeP>(model, world, c), "--max-model-len 200 exceeds the model's --seq-length 128",
                         ConfigError);
    c = {};
    c.kv_cache_memory = 4096 * 7;  // 7 blocks of 16 tokens: 112 < 128
    CHECK_THROWS_WITH_AS(serve::Engine<test::ServeP>(model, world, c),
                         doctest::Contains("holds 7 blocks of 16 tokens (112 tokens), fewer than one request of "
                                           "--max-model-len 128 needs"),
                         ConfigError);
    c = {};
    c.max_num_seqs = 0;
    CHECK_THROWS_WITH_AS(serve::Engine<test::ServeP>(model, world, c), "--max-num-seqs must be >= 1, got 0", ConfigError);
  });
}

TEST_CASE("engine requests: 1,000 requests, a fifth aborted mid-generation, leave every block free") {
  std::vector<Arrival> arrivals;
  for (int i = 0; i < 1000; ++i) {
    Arrival a{i / 8, text_ids(std::string("To be, or not to be").substr(0, static_cast<std::size_t>(1 + i % 19))),
              greedy(3 + i % 6), test::request_id(i)};
    if (i % 5 == 0) a.abort_at = a.step + 2;  // after its prefill, before its last token
    arrivals.push_back(a);
  }
  serve::EngineConfig config;
  config.kv_cache_memory = 4096 * 24;  // 24 blocks: preemptions too
  config.enable_prefix_caching = true;
  std::int64_t most_used = 0;
  const auto run = serve_requests(1, config, arrivals, test::tiny_serving_model(), [&](serve::Engine<test::ServeP>& e) {
    most_used = std::max(most_used, e.block_manager().num_used_blocks());
  });
  REQUIRE(run.requests.size() == 1000);
  int aborted = 0;
  for (const auto& [id, s] : run.requests) {
    REQUIRE(s.finish.has_value());
    aborted += *s.finish == serve::FinishReason::Abort;
  }
  CHECK(aborted == 200);
  CHECK(most_used > 0);
  CHECK(run.stats.used_blocks == 0);
  CHECK(run.stats.running == 0);
  CHECK(run.stats.waiting == 0);
}

TEST_CASE("engine requests: a prompt sharing 90 of 100 tokens computes only the other 10 (+ the partial block)") {
  std::vector<std::int32_t> first, second;
  for (int i = 0; i < 100; ++i) first.push_back(32 + (i * 7) % 90);
  second = first;
  for (int i = 90; i < 100; ++i) second[static_cast<std::size_t>(i)] = 33 + i % 5;
  serve::EngineConfig config;
  config.enable_prefix_caching = true;
  std::int64_t prompt_tokens_before = 0, prompt_tokens_after = 0;
  std::int64_t step_count = 0;
  const auto run = serve_requests(1, config, {{0, first, greedy(4), "a"}, {10, second, greedy(4), "b"}},
                                  test::tiny_serving_model(), [&](serve::Engine<test::ServeP>& e) {
                                    if (++step_count == 10) prompt_tokens_before = e.stats().prompt_tokens;
                                    prompt_tokens_after = e.stats().prompt_tokens;
                                  });
  // 90 shared tokens hold 5 full blocks of 16 (80 tokens): the rest, 20, is computed.
  CHECK(run.requests.at("b").cached_tokens == 80);
  CHECK(prompt_tokens_before == 100);
  CHECK(prompt_tokens_after - prompt_tokens_before == 20);
  CHECK(run.stats.prefix_cache_hits == 80);
  // And it gets what it gets without the cache.
  CHECK(run.requests.at("b").tokens == serve_requests(1, {}, {{0, second, greedy(4), "b"}}).requests.at("b").tokens);
}

TEST_CASE("engine requests: stop strings across tokens, stop tokens, logprobs and penalties") {
  const auto prompt = text_ids("JULIET:\nO Romeo");
  const test::Served plain = serve_requests(1, {}, {{0, prompt, greedy(24), "a"}}).requests.at("a");
  REQUIRE(plain.tokens.size() == 24);
  REQUIRE(plain.text == std::string(plain.tokens.begin(), plain.tokens.end()));
  SUBCASE("a stop string spanning generated tokens 3-5 cuts the text before it") {
    const std::string stop = plain.text.substr(3, 3);
    auto p = greedy(24);
    p.stop = {stop, "never-seen"};
    const auto s = serve_requests(1, {}, {{0, prompt, p, "a"}}).requests.at("a");
    const std::size_t at = plain.text.find(stop);
    CHECK(s.finish == serve::FinishReason::Stop);
    CHECK(s.text == plain.text.substr(0, at));
    CHECK(s.tokens == std::vector<std::int32_t>(plain.tokens.begin(), plain.tokens.begin() + static_cast<std::ptrdiff_t>(at + 3)));
  }
  SUBCASE("a stop token ends the request at its first occurrence; its text is not shown") {
    auto p = greedy(24);
    p.stop_token_ids = {plain.tokens[4]};
    const auto s = serve_requests(1, {}, {{0, prompt, p, "a"}}).requests.at("a");
    const auto first = std::find(plain.tokens.begin(), plain.tokens.end(), plain.tokens[4]) - plain.tokens.begin();
    CHECK(s.finish == serve::FinishReason::Stop);
    CHECK(s.tokens.size() == static_cast<std::size_t>(first + 1));
    CHECK(s.text == plain.text.substr(0, static_cast<std::size_t>(first)));
  }
  SUBCASE("logprobs are the log-softmax of the full forward's logits; penalties as applied to them") {
    auto p = greedy(8);
    p.logprobs = 3;
    p.repetition_penalty = 1.3f;
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.4f;
    const auto s = serve_requests(1, {}, {{0, prompt, p, "a"}}).requests.at("a");
    REQUIRE(s.tokens.size() == 8);
    REQUIRE(s.logprobs.size() == 8);
    CHECK(s.tokens != std::vector<std::int32_t>(plain.tokens.begin(), plain.tokens.begin() + 8));  // the penalties bite
    with_model([&](model::CausalLM<test::ServeP>& model, comm::ThreadComm&) {
      std::vector<std::int32_t> seq = prompt, out;
      for (std::size_t t = 0; t < 8; ++t) {
        const Tensor logits = serve::full_logits(model, seq);
        std::vector<float> row(logits.span().begin() + (logits.dim(0) - 1) * 127, logits.span().end());
        double total = 0;
        for (float l : row) total += std::exp(double(l));
        CHECK(std::abs(s.logprobs[t].logprob - (row[static_cast<std::size_t>(s.tokens[t])] - std::log(total))) <= 1e-5);
        REQUIRE(s.logprobs[t].top.size() == 3);
        CHECK(s.logprobs[t].top[0].second >= s.logprobs[t].top[1].second);
        CHECK(s.logprobs[t].top[1].second >= s.logprobs[t].top[2].second);
        // The penalties of vLLM by hand: repetition on prompt + output, then frequency x count and
        // presence on the output.
        for (std::size_t v = 0; v < row.size(); ++v) {
          const auto id = static_cast<std::int32_t>(v);
          const bool seen = std::count(seq.begin(), seq.end(), id) > 0;
          const auto count = std::count(out.begin(), out.end(), id);
          if (seen) row[v] = row[v] > 0 ? row[v] / 1.3f : row[v] * 1.3f;
          if (count > 0) row[v] -= 0.4f * static_cast<float>(count) + 0.5f;
        }
        out.push_back(static_cast<std::int32_t>(std::max_element(row.begin(), row.end()) - row.begin()));
        seq.push_back(out.back());
      }
      CHECK(out == s.tokens);
    });
  }
}

TEST_CASE("engine requests: KV blocks from a budget equal the ledger's, kv_heads / TP per rank") {
  for (std::int64_t kv_heads : {4, 1}) {
    for (int tp : {1, 2, 4}) {
      CAPTURE(kv_heads);
      CAPTURE(tp);
      const auto config = test::tiny_serving_model(kv_heads);
      const std::int64_t budget = 1 << 20;
      comm::launch(tp, [&](comm::ThreadComm& world) {
        DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
        model::CausalLM<test::ServeP> model(config, mesh, test::kServingSeed);
        serve::EngineConfig c;
        c.kv_cache_memory = budget;
        for (auto dtype : {backend::KvCacheDType::Fp32, backend::KvCacheDType::Bf16}) {
          c.kv_cache_dtype = dtype;
          serve::Engine<test::ServeP> engine(model, world, c);
          const std::int64_t bytes = static_cast<std::int64_t>(backend::kv_cache_dtype_size(dtype));
          const std::int64_t kv_local = std::max<std::int64_t>(1, kv_heads / tp);  // replicated when fewer
          CHECK(engine.bytes_per_block() == 16 * 2 * config.num_layers * kv_local * config.head_dim() * bytes);
          CHECK(engine.bytes_per_block() == plan::kv_cache_bytes_per_block(config, tp, 16, bytes));
          CHECK(engine.block_manager().num_blocks() == plan::kv_cache_blocks(config, tp, 16, bytes, budget));
          CHECK(engine.block_manager().num_blocks() == budget / engine.bytes_per_block());
          CHECK(engine.kv_cache_bytes() == engine.block_manager().num_blocks() * engine.bytes_per_block());
        }
      });
    }
  }
}

TEST_CASE("engine requests: MLA's KV blocks from a budget equal the ledger's, the whole latent on every TP rank") {
  const auto config = test::tiny_mla_serving_model();
  const std::int64_t budget = 1 << 20;
  for (int tp : {1, 2, 4}) {
    CAPTURE(tp);
    comm::launch(tp, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
      model::CausalLM<test::ServeP> model(config, mesh, test::kServingSeed);
      serve::EngineConfig c;
      c.kv_cache_memory = budget;
      for (auto dtype : {backend::KvCacheDType::Fp32, backend::KvCacheDType::Bf16}) {
        c.kv_cache_dtype = dtype;
        serve::Engine<test::ServeP> engine(model, world, c);
        const std::int64_t bytes = static_cast<std::int64_t>(backend::kv_cache_dtype_size(dtype));
        CHECK(engine.bytes_per_block() == 16 * config.num_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * bytes);
        CHECK(engine.bytes_per_block() == plan::kv_cache_bytes_per_block(config, tp, 16, bytes));
        CHECK(engine.block_manager().num_blocks() == plan::kv_cache_blocks(config, tp, 16, bytes, budget));
        CHECK(engine.kv_cache_bytes() == engine.block_manager().num_blocks() * engine.bytes_per_block());
      }
    });
  }
}

// A GQA and an MLA (DeepSeek-V3-shaped) MoE model, each at EP1, EP2 and TP2 x EP2.
TEST_CASE("engine requests: an MoE model serves the same tokens with its experts split over 2 ranks") {
  auto gqa = test::tiny_serving_model();
  gqa.num_layers = 3;
  gqa.num_experts = 8;
  gqa.moe_router_topk = 2;
  gqa.moe_ffn_hidden_size = 16;
  gqa.num_shared_experts = 1;
  gqa.first_k_dense_replace = 1;
  gqa.moe_router_norm_topk_prob = true;
  for (const auto& config : {gqa, test::tiny_mla_serving_model()}) {
    CAPTURE(config.is_mla());
    std::vector<Arrival> arrivals;
    for (int i = 0; i < 6; ++i)
      arrivals.push_back({i, text_ids(std::string("KING RICHARD III:").substr(0, static_cast<std::size_t>(3 + 2 * i))),
                          greedy(6), test::request_id(i)});
    std::vector<std::map<std::string, std::vector<std::int32_t>>> by_layout;
    for (const auto layout : {ParallelLayout{}, ParallelLayout{.expert = 2}, ParallelLayout{.tensor = 2, .expert = 2}}) {
      const int world_size = layout.tensor * layout.expert;
      std::map<std::string, std::vector<std::int32_t>> tokens;
      comm::launch(world_size, [&](comm::ThreadComm& world) {
        DeviceMesh mesh(world, layout);
        model::CausalLM<test::ServeP> model(config, mesh, test::kServingSeed);
        serve::Engine<test::ServeP> engine(model, world, {});
        if (world.rank() == 0)
          for (const auto& a : arrivals) engine.add_request(a.prompt, a.params, a.id);
        std::map<std::string, std::vector<std::int32_t>> mine;
        for (int step = 0; !engine.stopped() && step < 500; ++step) {
          for (const auto& out : engine.step()) mine[out.id].insert(mine[out.id].end(), out.new_tokens.begin(), out.new_tokens.end());
          if (world.rank() == 0 && !engine.has_unfinished_requests()) engine.shutdown();
        }
        if (world.rank() == world_size - 1) tokens = mine;  // the last rank agrees with the driver
      });
      by_layout.push_back(tokens);
    }
    REQUIRE(by_layout[0].size() == 6);
    CHECK(by_layout[1] == by_layout[0]);
    CHECK(by_layout[2] == by_layout[0]);
  }
}

}  // namespace serve_engine_requests_test
