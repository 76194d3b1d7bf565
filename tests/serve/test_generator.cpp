// serve::Generator on a tiny random CausalLM: cached decoding equals the no-cache forward (with
// either attention), batching does not change a prompt's tokens, TP2/TP4 generate what TP1
// does, the memory-efficient attention (use_flash_attn) serves what the materialising one does,
// and bad requests throw InputError.
//
// Tolerance 1e-5 absolute on logits of magnitude ~1 (init std 0.2 makes them O(1)): the
// paths compared differ only in fp32 summation order (cached attention spans the whole
// cache with masked zeros, TP splits GEMMs and all-reduces partial sums), ~1e-7 relative per
// operation over a 2-layer model; observed at most 3.5e-6 (logits up to 4.7). The flash
// attention differs from the materialising one the same way (query tiles, another softmax
// order).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/policy.hpp"
#include "dsp/serve/consistency.hpp"
#include "dsp/serve/generator.hpp"

using namespace dsp;

namespace serve_generator_test {
using P = Policy<backend::Host, comm::ThreadComm>;
using Tokens = std::vector<std::vector<std::int32_t>>;

namespace {

constexpr double kTolerance = 1e-5;
constexpr std::uint64_t kSeed = 7;
constexpr std::int64_t kNewTokens = 12;
const serve::SamplingParams kSampled{.temperature = 0.8f, .top_k = 20, .top_p = 0.9f, .seed = 1234};

model::ModelConfig tiny_config(bool flash = false) {
  model::ModelConfig c;
  c.use_flash_attn = flash;
  c.vocab_size = 127;  // not a multiple of 2 or 4: the gathered logits carry padding at TP2/TP4
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;  // at TP4 each K/V head (and its cache) is replicated on two ranks
  c.ffn_hidden_size = 64;
  c.seq_length = 48;
  c.init_method_std = 0.2f;  // logits of std ~1, so top-k and top-p cut real probability mass
  return c;
}

// The default prompts that leave room for kNewTokens within seq_length (lengths 1 to 32).
Tokens prompts() {
  Tokens out;
  for (const auto& text : serve::default_prompts())
    if (static_cast<std::int64_t>(text.size()) + kNewTokens <= tiny_config().seq_length)
      out.push_back(serve::encode_bytes(text));
  return out;
}

// Runs fn(generator, tp_rank) on every rank of a TP group of `tp` threads serving the model.
template <class Fn>
void on_ranks(int tp, Fn fn, bool flash = false) {
  comm::launch(tp, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
    model::CausalLM<P> model(tiny_config(flash), mesh, kSeed);
    serve::Generator<P> generator(model);
    fn(generator, mesh.tp_rank());
  });
}

// Row `row` of a [rows, cols] tensor as a [1, cols] tensor.
Tensor row_of(const Tensor& t, std::int64_t row) {
  const std::int64_t cols = t.dim(1);
  return Tensor({1, cols}, std::vector<float>(t.data() + row * cols, t.data() + (row + 1) * cols));
}

struct Served {
  Tokens greedy, sampled;
  std::vector<Tensor> logits;  // full_logits of each prompt
};

// What every rank of a TP group of `tp` serves for prompts(); checks that all ranks agree.
Served serve_at(int tp, bool flash = false) {
  std::vector<Served> by_rank(static_cast<std::size_t>(tp));
  on_ranks(tp, [&](serve::Generator<P>& generator, int rank) {
    Served s{generator.generate(prompts(), kNewTokens, {}), generator.generate(prompts(), kNewTokens, kSampled), {}};
    for (const auto& p : prompts()) s.logits.push_back(generator.full_logits(p));
    by_rank[static_cast<std::size_t>(rank)] = std::move(s);
  }, flash);
  for (int r = 1; r < tp; ++r) {
    CAPTURE(r);
    CHECK(by_rank[static_cast<std::size_t>(r)].greedy == by_rank[0].greedy);
    CHECK(by_rank[static_cast<std::size_t>(r)].sampled == by_rank[0].sampled);
    CHECK(serve::max_abs_logit_diff(by_rank[static_cast<std::size_t>(r)].logits, by_rank[0].logits) == 0.0);
  }
  return by_rank[0];
}

}  // namespace

TEST_CASE("generator: KV-cache decoding gives the no-cache logits at every step (TP1, TP2, TP4, both attentions)") {
  for (bool flash : {false, true})
  for (int tp : {1, 2, 4}) {
    CAPTURE(flash);
    CAPTURE(tp);
    on_ranks(tp, [&](serve::Generator<P>& generator, int) {
      const Tokens batch = prompts();  // lengths 1..32: prefill pads rows on the right
      const Tokens generated = generator.generate(batch, kNewTokens, kSampled);
      serve::KvCache cache = generator.make_cache(static_cast<std::int64_t>(batch.size()));
      Tensor cached = generator.prefill(cache, batch);
      Tokens sequences = batch;
      for (std::int64_t step = 0;; ++step) {
        std::vector<Tensor> incremental, reference;
        for (std::size_t b = 0; b < batch.size(); ++b) {
          incremental.push_back(row_of(cached, static_cast<std::int64_t>(b)));
          const Tensor full = generator.full_logits(sequences[b]);
          reference.push_back(row_of(full, full.dim(0) - 1));
        }
        CAPTURE(step);
        CHECK(serve::max_abs_logit_diff(incremental, reference) <= kTolerance);
        if (step == kNewTokens - 1) break;
        std::vector<std::int32_t> tokens, positions;
        for (std::size_t b = 0; b < batch.size(); ++b) {
          tokens.push_back(generated[b][static_cast<std::size_t>(step)]);
          positions.push_back(static_cast<std::int32_t>(sequences[b].size()));
          sequences[b].push_back(tokens.back());
        }
        cached = generator.decode(cache, tokens, positions);
      }
    }, flash);
  }
}

TEST_CASE("generator: a prompt gets the same tokens alone as in a batch") {
  on_ranks(1, [](serve::Generator<P>& generator, int) {
    const Tokens batch = prompts();
    for (const serve::SamplingParams& params : {serve::SamplingParams{}, kSampled}) {
      CAPTURE(params.temperature);
      const Tokens together = generator.generate(batch, kNewTokens, params);
      REQUIRE(together.size() == batch.size());
      for (std::size_t b = 0; b < batch.size(); ++b) {
        CAPTURE(b);
        CHECK(together[b].size() == static_cast<std::size_t>(kNewTokens));
        // Alone, the prompt keeps its stream (its index in the batch) through first_stream.
        CHECK(generator.generate({batch[b]}, kNewTokens, params, b) == Tokens{together[b]});
      }
    }
    // Sampling does sample, and the same prompt twice in a request gets two streams.
    const Tokens twice = generator.generate({batch[2], batch[2]}, kNewTokens, kSampled);
    CHECK(twice[0] != twice[1]);
    CHECK(generator.generate({batch[2]}, kNewTokens, kSampled) != generator.generate({batch[2]}, kNewTokens, {}));
  });
}

TEST_CASE("generator: TP2 and TP4 generate the TP1 tokens and logits") {
  const Served ref = serve_at(1);
  REQUIRE(ref.logits.size() == prompts().size());
  CHECK(ref.logits[0].shape() == Shape{1, 127});
  for (int tp : {2, 4}) {
    CAPTURE(tp);
    const Served s = serve_at(tp);
    CHECK(s.greedy == ref.greedy);
    CHECK(s.sampled == ref.sampled);
    CHECK(serve::max_abs_logit_diff(s.logits, ref.logits) <= kTolerance);
  }
}

TEST_CASE("generator: the memory-efficient attention serves the materialising one's tokens and logits") {
  const Served ref = serve_at(1);
  for (int tp : {1, 2}) {
    CAPTURE(tp);
    const Served s = serve_at(tp, true);
    CHECK(s.greedy == ref.greedy);
    CHECK(s.sampled == ref.sampled);
    // At TP1 bitwise: a prompt of <= 48 tokens is one query tile, whose GEMMs and softmax are
    // the materialising op's. At TP2 the split GEMMs and the all-reduce differ (3.6e-6 seen).
    const double diff = serve::max_abs_logit_diff(s.logits, ref.logits);
    if (tp == 1) CHECK(diff == 0.0);
    CHECK(diff <= kTolerance);
  }
}

TEST_CASE("generator: bad requests throw InputError") {
  on_ranks(1, [](serve::Generator<P>& generator, int) {
    const std::vector<std::int32_t> forty(40, 65);
    try {
      generator.generate({{1, 2}, forty}, 9, {});
      FAIL("no error for a prompt that does not fit");
    } catch (const InputError& e) {
      CHECK(std::string(e.what()) == "prompt 1: prompt of 40 tokens plus 9 new tokens exceeds --seq-length 48");
    }
    CHECK(generator.generate({forty}, 8, {}).front().size() == 8);  // 40 + 8 = 48 fits exactly
    CHECK_THROWS_AS(generator.generate({{1, 2}, {}}, 4, {}), InputError);
    CHECK_THROWS_AS(generator.generate({{1, 127}}, 4, {}), InputError);
    CHECK_THROWS_AS(generator.generate({{-1}}, 4, {}), InputError);
    CHECK_THROWS_AS(generator.generate({{1}}, -1, {}), InputError);
    CHECK_THROWS_AS(generator.generate({{1}}, 4, {.temperature = -1.0f}), InputError);
    CHECK_THROWS_AS(generator.generate({{1}}, 4, {.top_p = 0.0f}), InputError);
    CHECK_THROWS_AS(generator.full_logits({}), InputError);
    CHECK_THROWS_AS(generator.full_logits(std::vector<std::int32_t>(49, 1)), InputError);
    CHECK(generator.generate({{1}, {2}}, 0, {}) == Tokens{{}, {}});
    CHECK(generator.generate({}, 4, {}).empty());
  });
}

}  // namespace serve_generator_test
