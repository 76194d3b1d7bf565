// serve::Engine on a tiny random CausalLM: what one request gets against an independent
// reference (greedy decoding by full forward passes, no cache), and the engine's promise that a
// request's tokens and logits do not depend on the batch: 32 requests of 1-100 prompt tokens,
// arriving over 40 steps, each served exactly as alone, with chunk sizes 1, 7 and 64, prefix
// caching on and off, and a KV budget small enough to force preemptions. The same for an MLA +
// MoE model (DeepSeek-V3's shape), whose engine caches MLA's latent and attends in the absorbed
// form, against full forward passes in the un-absorbed form.
//
// Tolerance. Against the full forward (materialising attention over the whole sequence, the
// library GEMM) the engine's logits differ in fp32 summation order only: 1e-5 absolute on
// logits of magnitude ~1 (observed below 2e-6). Between the engine's own runs nothing differs
// in order (backend/batch_invariance.hpp), so those comparisons are exact: tokens and the
// log-probabilities of the whole vocabulary at every step, bitwise.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dsp/serve/consistency.hpp"
#include "dsp/serve/full_logits.hpp"
#include "../guarded_space.hpp"
#include "engine_harness.hpp"

using namespace dsp;
using test::Arrival;
using test::serve_requests;

namespace serve_engine_test {

namespace {

constexpr double kTolerance = 1e-5;

// Prompt i of the batch-invariance runs: 1-100 tokens of Shakespeare (bytes < 127), starting
// at one of three places, so that prompts share prefixes (for the prefix cache).
std::vector<std::int32_t> prompt_of(int i) {
  const std::string text =
      "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\nFirst Citizen:\nYou are "
      "all resolved rather to die than to famish?\nAll:\nResolved. resolved.\n";
  const std::size_t len = 1 + static_cast<std::size_t>(i * 37 % 100);
  std::vector<std::int32_t> out;
  for (std::size_t k = 0; k < len; ++k) out.push_back(static_cast<unsigned char>(text[(k + 17 * (i % 3)) % text.size()]));
  return out;
}

// 32 requests arriving over 40 steps: even ones greedy, odd ones sampled with their own seed;
// every step's log-probabilities of the whole vocabulary returned (127 = vocab).
std::vector<Arrival> mixed_requests() {
  std::vector<Arrival> out;
  for (int i = 0; i < 32; ++i) {
    serve::SamplingParams p;
    p.max_tokens = 4 + i % 13;
    p.logprobs = 127;
    if (i % 2 == 1) {
      p.temperature = 0.8f;
      p.top_k = 20;
      p.top_p = 0.9f;
      p.seed = 1000 + static_cast<std::uint64_t>(i);
    }
    out.push_back({(i * 5) % 40, prompt_of(i), p, test::request_id(i)});
  }
  return out;
}

// Every request of `arrivals` served alone (a fresh engine each, default limits).
std::map<std::string, test::Served> alone(const std::vector<Arrival>& arrivals,
                                          const model::ModelConfig& model = test::tiny_serving_model()) {
  std::map<std::string, test::Served> out;
  for (Arrival a : arrivals) {
    a.step = 0;
    out[a.id] = serve_requests(1, {}, {a}, model).requests.at(a.id);
  }
  return out;
}

// Greedy by argmax of full forward passes (no cache) of the model of `config` at TP `tp`: the
// `steps` tokens after `prompt`, and the prompt's logits [tokens, vocab].
std::pair<std::vector<std::int32_t>, Tensor> full_forward_greedy(int tp, const model::ModelConfig& config,
                                                                 const std::vector<std::int32_t>& prompt, int steps) {
  std::pair<std::vector<std::int32_t>, Tensor> result;
  comm::launch(tp, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
    model::CausalLM<test::ServeP> model(config, mesh, test::kServingSeed);
    std::vector<std::int32_t> seq = prompt, out;
    Tensor prompt_full = serve::full_logits(model, prompt);
    const auto vocab = static_cast<std::size_t>(config.vocab_size);
    for (int t = 0; t < steps; ++t) {
      const Tensor logits = serve::full_logits(model, seq);
      const auto row = logits.span().subspan(static_cast<std::size_t>(logits.dim(0) - 1) * vocab, vocab);
      out.push_back(static_cast<std::int32_t>(std::max_element(row.begin(), row.end()) - row.begin()));
      seq.push_back(out.back());
    }
    if (world.rank() == 0) result = {out, prompt_full};
  });
  return result;
}

void check_same(const test::Served& got, const test::Served& want) {
  CHECK(got.tokens == want.tokens);
  REQUIRE(got.logprobs.size() == want.logprobs.size());
  for (std::size_t s = 0; s < got.logprobs.size(); ++s) {
    CAPTURE(s);
    CHECK(got.logprobs[s].logprob == want.logprobs[s].logprob);
    CHECK(got.logprobs[s].top == want.logprobs[s].top);  // all 127 tokens, bitwise
  }
  CHECK(got.finish == want.finish);
}

}  // namespace

TEST_CASE("engine: one greedy request decodes as full forward passes do, and its prompt logits match them") {
  for (int tp : {1, 2, 4}) {
    CAPTURE(tp);
    for (int i : {0, 3, 11}) {  // prompts of 1, 12 and 8 tokens
      CAPTURE(i);
      const auto prompt = prompt_of(i);
      serve::SamplingParams params;
      params.max_tokens = 10;
      params.prompt_logits = true;
      const auto run = serve_requests(tp, {}, {{0, prompt, params, "a"}});
      const test::Served& s = run.requests.at("a");
      REQUIRE(s.tokens.size() == 10);
      CHECK(s.finish == serve::FinishReason::Length);
      // The reference: the same model, greedy by argmax of full forward passes.
      const auto [reference, full] = full_forward_greedy(tp, test::tiny_serving_model(), prompt, 10);
      CHECK(s.tokens == reference);
      CHECK(serve::max_abs_logit_diff({s.prompt_logits}, {full}) <= kTolerance);
    }
  }
}

TEST_CASE("engine: 32 mixed requests get, bitwise, what each gets alone (chunk sizes, prefix cache, preemption)") {
  const auto arrivals = mixed_requests();
  const auto reference = alone(arrivals);
  struct Variant {
    std::int64_t chunk;
    bool prefix_caching;
    std::optional<std::int64_t> kv_cache_memory;
  };
  // Blocks of 16 tokens of the tiny model: 2 layers x 2 x 2 kv heads x 8 dims x 4 bytes x 16 =
  // 4 KiB. 40 KiB (10 blocks = 160 tokens) holds one request of 128 but not all 32 at once.
  for (const Variant v : {Variant{1, false, {}}, Variant{7, false, {}}, Variant{64, false, {}}, Variant{7, true, {}},
                          Variant{64, true, {}}, Variant{64, false, 40 << 10}, Variant{7, true, 40 << 10}}) {
    CAPTURE(v.chunk);
    CAPTURE(v.prefix_caching);
    CAPTURE(v.kv_cache_memory.value_or(0));
    serve::EngineConfig config;
    config.max_num_batched_tokens = v.chunk;
    config.enable_prefix_caching = v.prefix_caching;
    config.kv_cache_memory = v.kv_cache_memory;
    const auto run = serve_requests(1, config, arrivals);
    REQUIRE(run.requests.size() == arrivals.size());
    for (const auto& a : arrivals) {
      CAPTURE(a.id);
      check_same(run.requests.at(a.id), reference.at(a.id));
    }
    if (v.kv_cache_memory) CHECK(run.stats.preemptions > 0);
    if (v.prefix_caching) CHECK(run.stats.prefix_cache_hits > 0);  // the prompts share prefixes
    CHECK(run.stats.used_blocks == 0);
  }
}

TEST_CASE("engine: TP2 and TP4 serve the TP1 tokens") {
  const auto arrivals = mixed_requests();
  const auto ref = serve_requests(1, {}, arrivals);
  for (int tp : {2, 4}) {
    CAPTURE(tp);
    const auto run = serve_requests(tp, {}, arrivals);
    for (const auto& a : arrivals) {
      CAPTURE(a.id);
      CHECK(run.requests.at(a.id).tokens == ref.requests.at(a.id).tokens);
      const auto& lp = run.requests.at(a.id).logprobs;
      const auto& lr = ref.requests.at(a.id).logprobs;
      REQUIRE(lp.size() == lr.size());
      for (std::size_t s = 0; s < lp.size(); ++s) CHECK(std::abs(lp[s].logprob - lr[s].logprob) <= kTolerance);
    }
  }
}

TEST_CASE("engine: with the model and the KV cache where the host may not touch them (as on a GPU), the same bits") {
  // test::GuardedSpace: host memory that Tensor's host accessors refuse, so the engine, the
  // model's paged forward and the KV pool must reach it through ops, communicators and explicit
  // copies only, as serving on the CUDA backend needs. Chunked, with preemptions, TP1 and TP2.
  static auto& space = *new test::GuardedSpace;  // never destroyed: outlives any buffer kept for reuse
  const auto arrivals = mixed_requests();
  for (const auto& [tp, model] : {std::pair{1, test::tiny_serving_model()}, std::pair{2, test::tiny_serving_model()},
                                  std::pair{1, test::tiny_mla_serving_model()}}) {
    CAPTURE(tp);
    CAPTURE(model.is_mla());
    serve::EngineConfig config;
    config.max_num_batched_tokens = 7;
    // 10 blocks (160 tokens) per rank: GQA's hold 4 KiB / TP, MLA's 2.5 KiB (the mixed tests above).
    config.kv_cache_memory = model.is_mla() ? 25 << 10 : (40 << 10) / tp;
    // The host run reads the weights' panels where this machine's GEMM has them, the guarded
    // one B in place (its weights are out of the host's reach): the same bits either way.
    const bool panels = backend::reads_packed_weights();
    const auto host = serve_requests(tp, config, arrivals, model, [&](serve::Engine<test::ServeP>& e) {
      CHECK((e.packed_weights().bytes() > 0) == panels);
      CHECK((e.packed_weights().reads() > 0) == panels);
    });
    const std::int64_t before = space.allocations;
    const auto guarded = serve_requests(
        tp, config, arrivals, model,
        [](serve::Engine<test::ServeP>& e) { CHECK(e.packed_weights().bytes() + e.packed_weights().reads() == 0); }, &space);
    CHECK(space.allocations > before);  // the model and the cache went there
    CHECK(guarded.stats.preemptions > 0);
    for (const auto& a : arrivals) {
      CAPTURE(a.id);
      check_same(guarded.requests.at(a.id), host.requests.at(a.id));
    }
  }
}

TEST_CASE("engine: packs the weights serving multiplies by whole, and refuses to step once one moved") {
  if (!backend::reads_packed_weights()) {
    MESSAGE("no AVX-512 here: the engine packs nothing");
    return;
  }
  comm::launch(1, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{});
    model::CausalLM<test::ServeP> model(test::tiny_serving_model(), mesh, test::kServingSeed);
    serve::Engine<test::ServeP> engine(model, world, {});
    // Every 2-D parameter of 48 rows or more but the input embedding (untied: only looked up).
    const std::vector<Parameter*> params = model.parameters();
    std::int64_t expected = 0;
    for (auto* p : params) {
      if (p->value.rank() != 2) continue;
      const bool packed = p->value.dim(0) >= 48 && p != params.front();
      CAPTURE(p->spec.name);
      CHECK((engine.packed_weights().find(p->value.data(), p->value.dim(0), p->value.dim(1), p->value.dim(1)) !=
             nullptr) == packed);
      if (packed) expected += (p->value.dim(0) + 47) / 48 * 48 * p->value.dim(1) * static_cast<std::int64_t>(sizeof(float));
    }
    CHECK(engine.packed_weights().bytes() == expected);
    (void)engine.step();  // nothing to run: the check passes
    params.back()->value = Tensor(params.back()->value.shape());  // the output layer's weight, in a new buffer
    CHECK_THROWS_WITH_AS(engine.step(), doctest::Contains(params.back()->spec.name.c_str()), Error);
  });
}

}  // namespace serve_engine_test

namespace serve_engine_test {

// MLA (DeepSeek-V2 section 2.1.2): the engine caches the latent [c_kv | k_pe] and attends in the
// absorbed form for prefill and decode alike; the full forward passes of the reference run the
// un-absorbed form. Same tolerance: only the association of the products differs.
TEST_CASE("engine: an MLA + MoE model's request decodes as full (un-absorbed) forward passes do, at TP1 and TP2") {
  const model::ModelConfig mla = test::tiny_mla_serving_model();
  for (int tp : {1, 2}) {
    CAPTURE(tp);
    for (int i : {0, 3, 11}) {  // prompts of 1, 12 and 8 tokens
      CAPTURE(i);
      const auto prompt = prompt_of(i);
      serve::SamplingParams params;
      params.max_tokens = 10;
      params.prompt_logits = true;
      const auto run = serve_requests(tp, {}, {{0, prompt, params, "a"}}, mla);
      const test::Served& s = run.requests.at("a");
      const auto [reference, full] = full_forward_greedy(tp, mla, prompt, 10);
      CHECK(s.tokens == reference);
      const double diff = serve::max_abs_logit_diff({s.prompt_logits}, {full});
      CAPTURE(diff);
      CHECK(diff <= kTolerance);
    }
  }
}

TEST_CASE("engine: an MLA + MoE model serves 32 mixed requests as each alone (chunked, prefix cache, preemption)") {
  const model::ModelConfig mla = test::tiny_mla_serving_model();
  const auto arrivals = mixed_requests();
  const auto reference = alone(arrivals, mla);
  // A block: 2 layers x (16 + 4) latent values x 4 bytes x 16 tokens = 2.5 KiB (GQA at 4 KV
  // heads of 8: 8 KiB); 25 KiB (10 blocks, 160 tokens) holds one request of 128, not all 32.
  for (const auto& [chunk, prefix, budget] : {std::tuple<std::int64_t, bool, std::int64_t>{7, false, 0},
                                              {64, true, 0}, {7, true, 25 << 10}}) {
    CAPTURE(chunk);
    CAPTURE(prefix);
    CAPTURE(budget);
    serve::EngineConfig config;
    config.max_num_batched_tokens = chunk;
    config.enable_prefix_caching = prefix;
    if (budget > 0) config.kv_cache_memory = budget;
    std::int64_t bytes_per_block = 0;
    const auto run = serve_requests(1, config, arrivals, mla,
                                    [&](serve::Engine<test::ServeP>& e) { bytes_per_block = e.bytes_per_block(); });
    CHECK(bytes_per_block == 2 * (16 + 4) * 4 * 16);
    REQUIRE(run.requests.size() == arrivals.size());
    for (const auto& a : arrivals) {
      CAPTURE(a.id);
      check_same(run.requests.at(a.id), reference.at(a.id));
    }
    if (budget > 0) CHECK(run.stats.preemptions > 0);
    if (prefix) CHECK(run.stats.prefix_cache_hits > 0);
    CHECK(run.stats.used_blocks == 0);
  }
}

}  // namespace serve_engine_test
