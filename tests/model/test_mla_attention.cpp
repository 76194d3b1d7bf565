// Multi-head Latent Attention (model/mla_attention.hpp):
//  - its output equals transformers 5.25's DeepseekV3Attention (q_lora_rank, YaRN with
//    mscale != mscale_all_dim, interleaved RoPE) and DeepseekV2Attention (q_lora_rank null as in
//    V2-Lite) on the same weights and inputs (tests/fixtures/mla, tools/write_mla_fixture.py):
//    1e-5 relative (norm-wise); fp32 on both sides, only the summation order differs (measured
//    ~1e-7);
//  - the gradient of every projection, both norms and the input equals central finite
//    differences along a random direction (eps 1e-3: truncation O(eps^2) ~1e-6 relative; the
//    loss sum(y * r) over 160 outputs carries fp32 noise ~1e-6, i.e. ~1e-3 on the quotient, so
//    5e-3 relative + 1e-3 absolute; a missing term or wrong factor is an O(1) error);
//  - TP2 and TP4 (ThreadComm) give TP1's output, input gradient and every gathered weight
//    gradient within 1e-5 relative (the all-reduce sums in another order); selective
//    recomputation (probabilities recomputed in backward) gives the same gradients;
//  - the absorbed serving form over a paged latent cache (a ForwardContext with `paged`) equals
//    the un-absorbed forward of the whole sequence for a prefill and several decode steps of a
//    ragged batch, at TP1 and TP2, within 1e-5 relative (fp32, the products associate
//    differently: q_nope (W_UK c) vs (q_nope W_UK) c);
//  - the cache costs (kv_lora_rank + qk_rope_head_dim) x dtype bytes per token per layer:
//    70,272 bytes per token for DeepSeek-V3 (61 layers) in bf16.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <mutex>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/model/mla_attention.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/policy.hpp"
#include "../gather_global.hpp"
#include "../relative_error.hpp"
#include "mla_fixture.hpp"

using namespace dsp;

namespace model_mla_attention_test {
using P = Policy<backend::Host, comm::ThreadComm>;
using MLA = model::MLAttention<P>;

namespace {

constexpr const char* kPrefix = "model.layers.0.self_attn";

Tensor random(Shape shape, const char* name, double std = 1.0) {
  Tensor t(std::move(shape));
  const CounterRng rng(11, name);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = static_cast<float>(std * rng.normal(static_cast<std::uint64_t>(i)));
  return t;
}

// A small MLA config: 4 heads, YaRN with mscale != mscale_all_dim; std 0.3 for non-trivial
// attention and gradients.
model::ModelConfig small_config(std::int64_t q_lora_rank) {
  model::ModelConfig c{.vocab_size = 16, .hidden_size = 16, .num_layers = 2, .num_attention_heads = 4,
                       .num_query_groups = 4, .ffn_hidden_size = 16, .seq_length = 64, .init_method_std = 0.3f};
  c.q_lora_rank = q_lora_rank;
  c.kv_lora_rank = 8;
  c.qk_nope_head_dim = 4;
  c.qk_rope_head_dim = 4;
  c.v_head_dim = 6;
  c.rope_scaling = {.type = "yarn", .factor = 4, .original_max_position_embeddings = 16, .beta_fast = 32,
                    .beta_slow = 1, .mscale = 1.0, .mscale_all_dim = 0.8};
  return c;
}

model::ModelConfig fixture_config(const nlohmann::json& f) {
  const auto& j = f.at("config");
  const auto& r = j.at("rope_parameters");
  model::ModelConfig c;
  c.hidden_size = j.at("hidden_size");
  c.num_attention_heads = j.at("num_attention_heads");
  c.num_query_groups = c.num_attention_heads;
  c.q_lora_rank = j.at("q_lora_rank").is_null() ? 0 : j.at("q_lora_rank").get<std::int64_t>();
  c.kv_lora_rank = j.at("kv_lora_rank");
  c.qk_nope_head_dim = j.at("qk_nope_head_dim");
  c.qk_rope_head_dim = j.at("qk_rope_head_dim");
  c.v_head_dim = j.at("v_head_dim");
  c.seq_length = j.at("max_position_embeddings");
  c.rope_theta = r.at("rope_theta");
  c.rope_scaling = {.type = r.at("rope_type"), .factor = r.at("factor"),
                    .original_max_position_embeddings = r.at("original_max_position_embeddings"),
                    .beta_fast = r.at("beta_fast"), .beta_slow = r.at("beta_slow"), .mscale = r.at("mscale"),
                    .mscale_all_dim = r.at("mscale_all_dim")};
  return c;
}

struct Result {
  Tensor y, dx;
  std::map<std::string, Tensor> grads;  // gathered global gradients by name
};

// Forward and backward of one MLA layer at TP `tp` on x [batch * seq, hidden], dy = r.
Result run(int tp, const model::ModelConfig& c, std::int64_t batch, std::int64_t seq, bool selective = false) {
  Result out;
  std::mutex mu;
  comm::launch(tp, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
    auto& g = mesh.tensor_group();
    MLA attn(g, c, model::MlaAttentionSpec::describe(c, 0), 0, 7);
    auto ctx = model::ForwardContext::for_training(batch, seq);
    if (selective) ctx.recompute.granularity = model::RecomputeGranularity::Selective;
    const Tensor x = random({batch * seq, c.hidden_size}, "x");
    MLA::Saved saved;
    const Tensor y = attn.forward(ctx, x, &saved);
    if (selective) CHECK(saved.probs.numel() == 0);
    const Tensor dx = attn.backward(ctx, random(y.shape(), "r"), saved);
    std::map<std::string, Tensor> grads;
    for (Parameter* p : attn.parameters()) grads[p->spec.name] = test::gather_global(g, p->spec, p->grad);
    std::lock_guard lk(mu);
    if (g.rank() == 0) out = {y, dx, std::move(grads)};
  });
  return out;
}

}  // namespace

TEST_CASE("MLA output equals transformers' DeepseekV3Attention and DeepseekV2Attention") {
  for (const char* name : {"v3", "v2"}) {
    CAPTURE(name);
    const auto& f = test::mla_fixture().at(name);
    const model::ModelConfig c = fixture_config(f);
    const auto batch = f.at("batch").get<std::int64_t>(), seq = f.at("seq").get<std::int64_t>();
    comm::launch(1, [&](comm::ThreadComm& world) {
      MLA attn(world, c, model::MlaAttentionSpec::describe(c, 0), 0, 1);
      CHECK(attn.softmax_scale() == doctest::Approx(f.at("scaling").get<double>()).epsilon(1e-7));
      const auto& weights = f.at("weights");
      const auto params = attn.parameters();
      CHECK(params.size() == weights.size());
      for (Parameter* p : params) {
        const std::string hf = p->spec.name.substr(std::string(kPrefix).size() + 1);
        CAPTURE(hf);
        REQUIRE(weights.contains(hf));
        REQUIRE(weights.at(hf).at("shape").get<Shape>() == p->value.shape());
        p->value = test::fixture_tensor(weights.at(hf).at("values"), p->value.shape());
      }
      const Tensor x = test::fixture_tensor(f.at("hidden_states"), {batch * seq, c.hidden_size});
      const Tensor expected = test::fixture_tensor(f.at("output"), {batch * seq, c.hidden_size});
      const Tensor y = attn.forward(model::ForwardContext::for_training(batch, seq), x, nullptr);
      CHECK(test::relative_error(y, expected) < 1e-5);
    });
  }
}

TEST_CASE("MLA gradients of every projection, norm and the input equal finite differences") {
  for (std::int64_t q_lora : {6, 0}) {
    CAPTURE(q_lora);
    const model::ModelConfig c = small_config(q_lora);
    const std::int64_t batch = 2, seq = 5, n = batch * seq;
    comm::launch(1, [&](comm::ThreadComm& world) {
      MLA attn(world, c, model::MlaAttentionSpec::describe(c, 0), 0, 3);
      const auto ctx = model::ForwardContext::for_training(batch, seq);
      Tensor x = random({n, c.hidden_size}, "x");
      const Tensor r = random({n, c.hidden_size}, "r");
      auto loss = [&] {
        const Tensor y = attn.forward(ctx, x, nullptr);
        double l = 0;
        for (std::int64_t i = 0; i < y.numel(); ++i) l += double(y[i]) * r[i];
        return l;
      };
      MLA::Saved saved;
      attn.forward(ctx, x, &saved);
      const Tensor dx = attn.backward(ctx, r, saved);
      auto check = [&](Tensor& value, const Tensor& grad, const std::string& name) {
        CAPTURE(name);
        const Tensor v = random(value.shape(), name.c_str());
        const Tensor original = value;
        const double eps = 1e-3;
        for (std::int64_t i = 0; i < value.numel(); ++i) value[i] = original[i] + static_cast<float>(eps) * v[i];
        const double plus = loss();
        for (std::int64_t i = 0; i < value.numel(); ++i) value[i] = original[i] - static_cast<float>(eps) * v[i];
        const double minus = loss();
        value = original;
        double analytic = 0;
        for (std::int64_t i = 0; i < v.numel(); ++i) analytic += double(grad[i]) * v[i];
        const double numeric = (plus - minus) / (2 * eps);
        CAPTURE(analytic);
        CAPTURE(numeric);
        CHECK(std::abs(analytic - numeric) <= 5e-3 * std::abs(numeric) + 1e-3);
      };
      std::size_t checked = 0;
      for (Parameter* p : attn.parameters()) {
        check(p->value, p->grad, p->spec.name);
        ++checked;
      }
      CHECK(checked == (q_lora > 0 ? 7u : 5u));
      check(x, dx, "x");
    });
  }
}

TEST_CASE("MLA at TP2 and TP4 equals TP1; selective recomputation gives the same gradients") {
  for (std::int64_t q_lora : {6, 0}) {
    CAPTURE(q_lora);
    const model::ModelConfig c = small_config(q_lora);
    const Result ref = run(1, c, 2, 5);
    for (int tp : {2, 4}) {
      CAPTURE(tp);
      const Result r = run(tp, c, 2, 5);
      CHECK(test::relative_error(r.y, ref.y) < 1e-5);
      CHECK(test::relative_error(r.dx, ref.dx) < 1e-5);
      for (const auto& [name, g] : ref.grads) {
        CAPTURE(name);
        CHECK(test::relative_error(r.grads.at(name), g) < 1e-5);
      }
    }
    const Result sel = run(2, c, 2, 5, /*selective=*/true);
    CHECK(test::relative_error(sel.dx, ref.dx) < 1e-5);
    CHECK(test::relative_error(sel.grads, ref.grads) < 1e-5);
  }
}

TEST_CASE("MLA absorbed form over the paged latent cache equals the un-absorbed forward (prefill + decode steps)") {
  for (std::int64_t q_lora : {6, 0}) {
    for (int tp : {1, 2}) {
      CAPTURE(q_lora);
      CAPTURE(tp);
      const model::ModelConfig c = small_config(q_lora);
      comm::launch(tp, [&](comm::ThreadComm& world) {
        DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
        MLA attn(mesh.tensor_group(), c, model::MlaAttentionSpec::describe(c, 0), 0, 5);
        const std::int64_t lw = attn.latent_values_per_token();
        CHECK(lw == c.kv_lora_rank + c.qk_rope_head_dim);
        // two sequences: prompts of 5 and 3 tokens, then 4 decode steps each; blocks of 2 tokens,
        // sequence 0 in blocks 4, 1, 6, 3, 8; sequence 1 in 0, 7, 2, 5 (out of order on purpose)
        const std::int64_t steps = 4, block = 2;
        const std::vector<std::int64_t> prompt = {5, 3};
        const std::vector<std::int32_t> tables = {4, 1, 6, 3, 8, 0, 7, 2, 5, 9};  // [2, 5]
        std::vector<float> pool(static_cast<std::size_t>(10 * block * lw), 0.0f);
        std::vector<Tensor> inputs;
        for (std::size_t s = 0; s < prompt.size(); ++s)
          inputs.push_back(random({prompt[s] + steps, c.hidden_size}, s == 0 ? "seq0" : "seq1"));
        // the un-absorbed reference: forward over each whole sequence (causal: row p sees 0..p)
        std::vector<Tensor> reference;
        for (std::size_t s = 0; s < prompt.size(); ++s)
          reference.push_back(attn.forward(model::ForwardContext::for_training(1, prompt[s] + steps), inputs[s], nullptr));
        // a step: one ragged batch of rows (seq, position) through the paged forward
        auto step = [&](const std::vector<std::pair<std::size_t, std::int32_t>>& rows) {
          const auto n = static_cast<std::int64_t>(rows.size());
          Tensor x({n, c.hidden_size});
          std::vector<std::int32_t> positions, slots, seq;
          for (std::int64_t i = 0; i < n; ++i) {
            const auto [s, p] = rows[static_cast<std::size_t>(i)];
            for (std::int64_t k = 0; k < c.hidden_size; ++k) x[i * c.hidden_size + k] = inputs[s][p * c.hidden_size + k];
            positions.push_back(p);
            seq.push_back(static_cast<std::int32_t>(s));
            slots.push_back(tables[s * 5 + static_cast<std::size_t>(p / block)] * static_cast<std::int32_t>(block) + p % block);
          }
          const model::PagedKvBatch paged{{pool.data(), nullptr}, backend::KvCacheDType::Fp32, block, tables.data(), 5,
                                          slots.data(), seq.data()};
          const Tensor y = attn.forward(model::ForwardContext::for_serving(positions, &paged), x, nullptr);
          Tensor expected({n, c.hidden_size});
          for (std::int64_t i = 0; i < n; ++i) {
            const auto [s, p] = rows[static_cast<std::size_t>(i)];
            for (std::int64_t k = 0; k < c.hidden_size; ++k)
              expected[i * c.hidden_size + k] = reference[s][p * c.hidden_size + k];
          }
          CHECK(test::relative_error(y, expected) < 1e-5);
        };
        std::vector<std::pair<std::size_t, std::int32_t>> prefill;  // both prompts in one ragged batch
        for (std::size_t s = 0; s < prompt.size(); ++s)
          for (std::int32_t p = 0; p < prompt[s]; ++p) prefill.emplace_back(s, p);
        step(prefill);
        for (std::int64_t t = 0; t < steps; ++t)
          step({{0, static_cast<std::int32_t>(prompt[0] + t)}, {1, static_cast<std::int32_t>(prompt[1] + t)}});
        // the pool holds latents only, kv_lora + rope values per token: sequence 0's position 0
        // (block 4, row 0) is written, the never-used block 9 is not
        CHECK(pool[static_cast<std::size_t>(4 * block * lw)] != 0.0f);
        CHECK(pool[static_cast<std::size_t>(9 * block * lw)] == 0.0f);
      });
    }
  }
}

TEST_CASE("MLA cache bytes per token per layer: DeepSeek-V3 in bf16 caches 70,272 bytes per token") {
  model::ModelConfig v3;
  v3.kv_lora_rank = 512;
  v3.qk_rope_head_dim = 64;
  v3.qk_nope_head_dim = 128;
  v3.v_head_dim = 128;
  v3.num_layers = 61;
  CHECK(model::mla_cache_bytes_per_token(v3, 2) == 1152);
  CHECK(model::mla_cache_bytes_per_token(v3, 2) * v3.num_layers == 70272);
  CHECK_THROWS_AS(model::mla_cache_bytes_per_token(model::ModelConfig{}, 2), ConfigError);
  const model::ModelConfig c = small_config(6);
  // the ledger's parameter count (ModelConfig::num_parameters) counts MLA's weights as built
  for (std::int64_t q_lora : {6, 0}) {
    const model::ModelConfig m = small_config(q_lora);
    comm::launch(1, [&](comm::ThreadComm& world) {
      MLA attn(world, m, model::MlaAttentionSpec::describe(m, 0), 0, 5);
      std::int64_t attention = 0;
      for (Parameter* p : attn.parameters()) attention += p->value.numel();
      const std::int64_t h = m.hidden_size;
      CHECK(m.num_parameters() ==
            2 * m.vocab_size * h + m.num_layers * (attention + 2 * h + 3 * h * m.ffn_hidden_size) + h);
    });
  }
  comm::launch(2, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = 2});
    MLA attn(mesh.tensor_group(), c, model::MlaAttentionSpec::describe(c, 0), 0, 5);
    CHECK(attn.latent_values_per_token() * 4 == model::mla_cache_bytes_per_token(c, 4));  // not divided by TP
  });
}

TEST_CASE("MLA refuses a config without MLA, heads that do not split, and a paged context asked to keep activations") {
  comm::launch(1, [&](comm::ThreadComm& world) {
    CHECK_THROWS_AS(MLA(world, model::ModelConfig{}, model::MlaAttentionSpec::describe(small_config(6), 0), 0, 1), ConfigError);
    model::ModelConfig c = small_config(6);
    c.use_flash_attn = true;
    CHECK_THROWS_AS(MLA(world, c, model::MlaAttentionSpec::describe(small_config(6), 0), 0, 1), Error);
    MLA attn(world, small_config(6), model::MlaAttentionSpec::describe(small_config(6), 0), 0, 1);
    std::vector<float> pool(64, 0.0f);
    const std::vector<std::int32_t> table{0}, slot{0}, seq{0};
    const model::PagedKvBatch paged{{pool.data()}, backend::KvCacheDType::Fp32, 4, table.data(), 1, slot.data(), seq.data()};
    const auto ctx = model::ForwardContext::for_serving({0}, &paged);
    MLA::Saved saved;
    CHECK_THROWS_WITH_AS(attn.forward(ctx, Tensor({1, 16}), &saved), doctest::Contains("keeps nothing for backward"), Error);
    CHECK(attn.forward(ctx, random({1, 16}, "x"), nullptr).dim(0) == 1);
  });
  comm::launch(3, [&](comm::ThreadComm& world) {
    CHECK_THROWS_AS(MLA(world, small_config(6), model::MlaAttentionSpec::describe(small_config(6), 0), 0, 1), ConfigError);
  });
}

}  // namespace model_mla_attention_test
