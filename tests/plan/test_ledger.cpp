// The ledger's formulas against independent sources:
//  - ZeRO (Rajbhandari et al. SC'20, figure 1): 16, 4 + 12/N, 2 + 14/N, 16/N bytes per
//    parameter in mixed precision, per rank of a DP = 4 plan, experts sharded over DP / EP;
//  - activations: the bytes dsp::memory measured while a real CausalLM's forward filled its
//    Activations (fp32, no recomputation, dense and MoE at EP 1, TP 1/2/4) equal the ledger's
//    count minus what it keeps outside Tensor storage (std::vector statistics and ids, which
//    dsp::memory does not count): exact;
//  - serving: the KV cache the real model asks for (kv_values_per_token() of a CausalLM at TP 1/2/4,
//    K/V heads replicated at TP 4) measured at allocation equals the formula; serving weights
//    equal the model's bytes;
//  - the schedule walk equals pp::peak_in_flight x the stage's bytes with one chunk per rank;
//  - Korthikanti et al. eq. 2 reduces to s b h (34 + 5 a s / h) at t = 1.
#include <doctest/doctest.h>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/model/causal_lm.hpp"
#include "dsp/plan/ledger.hpp"
#include "dsp/policy.hpp"
#include "dsp/serve/kv_cache_pool.hpp"

using namespace dsp;

namespace plan_ledger_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

model::ModelConfig dense() {
  return {.vocab_size = 37, .hidden_size = 32, .num_layers = 3, .num_attention_heads = 4, .num_query_groups = 2,
          .ffn_hidden_size = 48, .seq_length = 8, .tie_word_embeddings = false};
}

model::ModelConfig moe() {
  model::ModelConfig c = dense();
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 16;
  c.num_shared_experts = 1;
  c.first_k_dense_replace = 1;
  return c;
}

plan::TrainingPlan plan_of(const model::ModelConfig& c, ParallelLayout layout, plan::Precision p, int zero) {
  plan::TrainingPlan t;
  t.model = c;
  t.layout = layout;
  t.precision = p;
  t.zero_stage = zero;
  t.global_batch_size = layout.data * layout.pipeline;
  return t;
}

}  // namespace

TEST_CASE("ZeRO bytes per parameter: 16, 4 + 12/N, 2 + 14/N, 16/N (mixed); fp32 16, 8 + 8/N, 4 + 12/N, 16/N") {
  for (std::int64_t n : {1, 2, 4, 8, 64}) {
    const std::int64_t E = 1000 * n;  // a multiple of N: no padding
    const double N = double(n);
    const double mixed[] = {16, 4 + 12 / N, 2 + 14 / N, 16 / N}, fp32[] = {16, 8 + 8 / N, 4 + 12 / N, 16 / N};
    for (int stage = 0; stage < 4; ++stage) {
      CAPTURE(n);
      CAPTURE(stage);
      CHECK(double(plan::zero_model_state(E, n, plan::Precision::Bf16Mixed, stage).total()) / double(E) ==
            doctest::Approx(mixed[stage]).epsilon(1e-12));
      CHECK(double(plan::zero_model_state(E, n, plan::Precision::Fp32, stage).total()) / double(E) ==
            doctest::Approx(fp32[stage]).epsilon(1e-12));
      CHECK(plan::bytes_per_parameter(plan::Precision::Bf16Mixed, stage, N) == doctest::Approx(mixed[stage]));
    }
  }
  // A buffer that does not divide: each rank holds ceil(E / N) (padded flat buffer).
  CHECK(plan::zero_model_state(10, 4, plan::Precision::Bf16Mixed, 3).parameters == 3 * 2);
  CHECK_THROWS_AS(plan::zero_model_state(10, 4, plan::Precision::Bf16Mixed, 4), ConfigError);
}

TEST_CASE("predict_training at DP 4 follows the ZeRO formulas per rank, experts over expert-DP") {
  const auto c = dense();
  const std::int64_t E = plan::stage_parameter_count(c, 1, 1, pp::StageLayers::whole(c.num_layers)).dense;
  REQUIRE(E % 4 == 0);
  const double formula[] = {16, 4 + 12 / 4.0, 2 + 14 / 4.0, 16 / 4.0};
  for (int stage = 0; stage < 4; ++stage) {
    const auto m = plan::predict_training(plan_of(c, {.tensor = 1, .pipeline = 1, .data = 4}, plan::Precision::Bf16Mixed, stage))
                       .worst_rank()
                       .bytes;
    CHECK(double(m.parameters + m.gradients + m.optimizer_state) == doctest::Approx(formula[stage] * double(E)));
  }
  // MoE at DP 4, EP 2: routed experts are data-parallel over DP / EP = 2 ranks.
  const auto cm = moe();
  const auto n = plan::stage_parameter_count(cm, 1, 2, pp::StageLayers::whole(cm.num_layers));
  const auto m = plan::predict_training(plan_of(cm, {.tensor = 1, .pipeline = 1, .data = 4, .expert = 2},
                                                plan::Precision::Bf16Mixed, 1))
                     .worst_rank()
                     .bytes;
  CHECK(m.optimizer_state == 12 * (round_up(n.dense, 4) / 4 + round_up(n.expert, 2) / 2));
  CHECK(m.parameters == 2 * (n.dense + n.expert) + 4 * n.buffers);
}

// The bytes a real forward of one micro-batch kept (memory::live_bytes) against the ledger's
// prediction, less what the stash keeps outside Tensor storage.
void check_stash_prediction(const model::ModelConfig& c, int tp, std::int64_t act_bytes) {
  const plan::MicroBatch mb{2, c.seq_length};
  const std::int64_t n = mb.tokens();
  comm::launch(tp, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
    model::CausalLM<P> m(c, mesh, 42);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(n)), targets(ids.size());
    for (std::int64_t i = 0; i < n; ++i) {
      ids[std::size_t(i)] = std::int32_t((7 * i + 3) % c.vocab_size);
      targets[std::size_t(i)] = std::int32_t((5 * i + 1) % c.vocab_size);
    }
    auto ctx = model::ForwardContext::for_training(mb.batch, mb.seq);
    if (act_bytes == 2) ctx.activations = precision::ActivationPrecision::Bf16;
    model::CausalLM<P>::Activations act;
    const std::int64_t before = memory::live_bytes();
    m.forward(ctx, ids, targets, act);
    const std::int64_t measured = memory::live_bytes() - before;

    const auto predicted =
        plan::dsp_stage_activation_bytes(c, tp, 1, pp::StageLayers::whole(c.num_layers), mb, act_bytes, {});
    // Kept outside Tensor storage: positions, ids and targets int32 [n]; in an MoE layer
    // the Routing (experts int32, weights fp32, kept u8 [n, k]; scores fp32 [n, E]), the
    // DispatchPlan's int64 vectors and the experts' rows vectors. (RMSNorm's rstd and the
    // loss's max and sum of exp are Tensors: measured.)
    std::int64_t untracked = 3 * 4 * n;
    for (std::int64_t l = 0; l < c.num_layers; ++l) {
      if (!c.is_moe_layer(l)) continue;
      const std::int64_t k = c.moe_router_topk, E = c.num_experts;
      untracked += n * k * 9 + n * E * 4 + 8 * (n * k + E + 2 + E + E) + 8 * E + 8;
    }
    CHECK(predicted.kept - untracked == measured);
    CHECK(predicted.recomputed == 0);
  });
}

TEST_CASE("training activations: ledger equals the bytes a real forward stashed (fp32 and bf16, dense and MoE, flash attention)") {
  for (bool is_moe : {false, true})
    for (int tp : {1, 2, 4})
      for (std::int64_t act_bytes : {4, 2})  // fp32; Bf16Mixed's 16-bit activations
        for (bool flash : {false, true}) {   // the probabilities, or the fp32 log-sum-exp
          CAPTURE(is_moe);
          CAPTURE(tp);
          CAPTURE(act_bytes);
          CAPTURE(flash);
          auto c = is_moe ? moe() : dense();
          c.use_flash_attn = flash;
          check_stash_prediction(c, tp, act_bytes);
        }
}

TEST_CASE("training activations: ledger equals the bytes a real forward of an MLA model stashed") {
  for (std::int64_t q_lora : {0, 12})
    for (int tp : {1, 2})
      for (std::int64_t act_bytes : {4, 2}) {
        CAPTURE(q_lora);
        CAPTURE(tp);
        CAPTURE(act_bytes);
        auto c = moe();
        c.q_lora_rank = q_lora;
        c.kv_lora_rank = 8;
        c.qk_nope_head_dim = 4;
        c.qk_rope_head_dim = 4;
        c.v_head_dim = 6;
        check_stash_prediction(c, tp, act_bytes);
      }
}

TEST_CASE("recomputation: selective drops the s^2 probabilities, full keeps the layer inputs") {
  const auto c = dense();
  const plan::MicroBatch mb{2, c.seq_length};
  const std::int64_t none = plan::dsp_layer_activation_bytes(c, 2, 1, 0, mb, 2);
  const std::int64_t selective = plan::dsp_layer_activation_bytes(c, 2, 1, 0, mb, 2, plan::RecomputeGranularity::Selective);
  CHECK(none - selective == 2 * mb.batch * (c.num_attention_heads / 2) * mb.seq * mb.seq);
  auto flash = c;  // keeps the fp32 log-sum-exp [b, heads/t, s] instead, with any granularity
  flash.use_flash_attn = true;
  for (auto g : {plan::RecomputeGranularity::None, plan::RecomputeGranularity::Selective})
    CHECK(plan::dsp_layer_activation_bytes(flash, 2, 1, 0, mb, 2, g) ==
          selective + 4 * mb.batch * (c.num_attention_heads / 2) * mb.seq);
  const auto whole = pp::StageLayers{0, 3, false, false};
  const auto full = plan::dsp_stage_activation_bytes(c, 2, 1, whole, mb, 2, {plan::RecomputeGranularity::Full});
  CHECK(full.kept == 4 * mb.tokens() + 3 * mb.tokens() * c.hidden_size * 2);  // positions + 3 inputs
  CHECK(full.recomputed == none);                                            // one layer at a time
  const auto uniform2 = plan::dsp_stage_activation_bytes(
      c, 2, 1, whole, mb, 2, {plan::RecomputeGranularity::Full, plan::RecomputeMethod::Uniform, 2});
  CHECK(uniform2.kept == 4 * mb.tokens() + 2 * mb.tokens() * c.hidden_size * 2);  // groups {0, 1}, {2}
  CHECK(uniform2.recomputed == 2 * none);
  const auto block1 = plan::dsp_stage_activation_bytes(
      c, 2, 1, whole, mb, 2, {plan::RecomputeGranularity::Full, plan::RecomputeMethod::Block, 1});
  CHECK(block1.kept == 4 * mb.tokens() + mb.tokens() * c.hidden_size * 2 + 2 * none);
}

TEST_CASE("activations in flight follow the schedule: pp::peak_in_flight x stage bytes for 1F1B and GPipe") {
  const auto c = dense();
  for (const char* schedule : {"1f1b", "gpipe"}) {
    auto t = plan_of(c, {.tensor = 1, .pipeline = 3, .data = 1}, plan::Precision::Fp32, 0);
    t.pipeline.schedule = schedule;
    t.global_batch_size = 5;
    const auto pred = plan::predict_training(t);
    const auto s = pp::make_schedule(schedule, 3, 1, 5);
    for (const auto& r : pred.ranks) {
      const auto per_mb = plan::dsp_stage_activation_bytes(c, 1, 1, r.chunks.at(0), t.micro_batch(), 4, {}).kept;
      CHECK(r.in_flight == pp::peak_in_flight(s, r.pipeline_rank));
      CHECK(r.bytes.activations == pp::peak_in_flight(s, r.pipeline_rank) * per_mb);
    }
    CHECK(pred.bubble == doctest::Approx(2.0 / 7.0));
  }
  // Interleaved: 8 layers, 2 ranks x 2 chunks of 2 layers (rank 0: layers 0-1 with the
  // embedding and 4-5; rank 1: 2-3 and 6-7 with the output layer): the walk weighs each stashed
  // chunk by its bytes, so it never exceeds peak_in_flight x the larger chunk.
  auto c6 = c;
  c6.num_layers = 8;
  auto t = plan_of(c6, {.tensor = 1, .pipeline = 2, .data = 1}, plan::Precision::Fp32, 0);
  t.pipeline.num_layers_per_virtual_stage = 2;
  t.global_batch_size = 4;
  const auto pred = plan::predict_training(t);
  CHECK(pred.virtual_size == 2);
  for (const auto& r : pred.ranks) {
    std::int64_t largest = 0;
    for (const auto& ch : r.chunks)
      largest = std::max(largest, plan::dsp_stage_activation_bytes(c6, 1, 1, ch, t.micro_batch(), 4, {}).kept);
    CHECK(r.bytes.activations <= r.in_flight * largest);
    CHECK(r.bytes.activations > 0);
  }
}

TEST_CASE("serving: the KV cache the model asks for equals 2 x layers x kv_heads/TP x head_dim x tokens x bytes") {
  const auto c = dense();  // 2 KV heads: split at TP 2, replicated at TP 4
  for (int tp : {1, 2, 4}) {
    CAPTURE(tp);
    comm::launch(tp, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
      const std::int64_t before = memory::live_bytes();
      const InferenceMode inference;  // as dsp-serve builds its model: weights only
      model::CausalLM<P> m(c, mesh, 42);
      const std::int64_t model_bytes = memory::live_bytes() - before;
      const std::int64_t batch = 3, tokens = c.seq_length;
      const std::int64_t before_cache = memory::live_bytes();
      // One block per sequence, of `tokens` tokens, sized by the attention layers as serve::Engine does.
      serve::KvCachePool cache(c.num_layers, 0, m.kv_values_per_token(), batch, tokens, backend::KvCacheDType::Fp32);
      const std::int64_t cache_bytes = memory::live_bytes() - before_cache;
      CHECK(cache_bytes == cache.bytes());
      const auto ledger = plan::predict_serving({c, tp, batch, tokens, 4});
      CHECK(ledger.activations == cache_bytes);
      CHECK(ledger.activations == 2 * c.num_layers * (tp <= 2 ? 2 / tp : 1) * c.head_dim() * batch * tokens * 4);
      CHECK(ledger.parameters == model_bytes);  // the served model holds its weights only
    });
  }
}

TEST_CASE("Korthikanti et al. eq. 2 at t = 1 is s b h (34 + 5 a s / h); selective drops the s^2 term") {
  const std::int64_t s = 2048, b = 1, h = 12288, a = 96;  // GPT-3 175B's layer
  const double sbh = double(s * b * h);
  CHECK(plan::korthikanti_layer_bytes(s, b, h, a, 1, plan::RecomputeGranularity::None) ==
        doctest::Approx(sbh * (34 + 5.0 * a * s / h)));
  CHECK(plan::korthikanti_layer_bytes(s, b, h, a, 8, plan::RecomputeGranularity::None, true) ==
        doctest::Approx(sbh * (34 + 5.0 * a * s / h) / 8));
  CHECK(plan::korthikanti_layer_bytes(s, b, h, a, 8, plan::RecomputeGranularity::Selective) ==
        doctest::Approx(sbh * (10 + 24.0 / 8)));
  CHECK(plan::korthikanti_layer_bytes(s, b, h, a, 8, plan::RecomputeGranularity::Full) == doctest::Approx(2 * sbh));
}

}  // namespace plan_ledger_test
