// plan::stage_parameters against the parameters real stages allocate: name by name and shape
// by shape (the list must equal the stage's state_parameters(): parameters(), then the buffers), and the ledger's
// parameter, gradient and optimizer bytes against the bytes dsp::memory measured while the
// model and its AdamW (zero::ZeroOptimizer at stage 0) were built (fp32, ZeRO 0, DP 1: what dsp trains today). Exact: the
// ledger enumerates the same ShardedTensor specs, so any difference is a bug, not noise.
// Cases: TP 1/2/4 (vocab 37 padded at TP 2/4; 2 KV heads replicated at TP4), tied and untied,
// PP 2 (the last stage's tied copy), MoE (first layer dense, shared expert, expert bias) at
// TP 1/2 x EP 1/2.
#include <doctest/doctest.h>

#include <string>
#include <utility>
#include <vector>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/model/causal_lm.hpp"
#include "dsp/pp/pipeline_stage.hpp"
#include "dsp/plan/ledger.hpp"
#include "dsp/policy.hpp"
#include "dsp/zero/zero_optimizer.hpp"

using namespace dsp;

namespace plan_parameters_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

model::ModelConfig dense(bool tied) {
  return {.vocab_size = 37, .hidden_size = 16, .num_layers = 3, .num_attention_heads = 4, .num_query_groups = 2,
          .ffn_hidden_size = 24, .seq_length = 8, .tie_word_embeddings = tied};
}

model::ModelConfig moe() {
  model::ModelConfig c = dense(false);
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 8;
  c.num_shared_experts = 1;
  c.first_k_dense_replace = 1;
  c.moe_router_score_function = ep::ScoreFunction::Sigmoid;
  c.moe_router_enable_expert_bias = true;
  return c;
}

using Listed = std::vector<std::pair<std::string, Shape>>;

Listed listed(const std::vector<plan::StageParameter>& ps) {
  Listed out;
  for (const auto& p : ps) out.emplace_back(p.spec.name, p.local_shape);
  return out;
}

template <class Stage>
Listed listed(Stage& s) {
  Listed out;
  for (auto* p : s.state_parameters()) out.emplace_back(p->spec.name, p->value.shape());  // parameters(), then buffers
  return out;
}

// Flags the ledger derives from the list equal the real parameters' flags.
template <class Stage>
void check_flags(Stage& s, const std::vector<plan::StageParameter>& ps) {
  const auto real = s.parameters();
  REQUIRE(ps.size() >= real.size());
  for (std::size_t i = 0; i < real.size(); ++i) {
    CAPTURE(real[i]->spec.name);
    CHECK(ps[i].expert == real[i]->expert);
    CHECK(ps[i].tied_copy == real[i]->tied_copy);
    CHECK(ps[i].spec == real[i]->spec);
  }
}

}  // namespace

TEST_CASE("ledger parameters equal a CausalLM's at TP 1/2/4, tied and untied, with measured bytes") {
  for (bool tied : {false, true})
    for (int tp : {1, 2, 4}) {
      CAPTURE(tp);
      CAPTURE(tied);
      comm::launch(tp, [&](comm::ThreadComm& world) {
        DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
        const auto c = dense(tied);
        const std::int64_t before = memory::live_bytes();
        model::CausalLM<P> m(c, mesh, 42);
        const std::int64_t model_bytes = memory::live_bytes() - before;
        dp::GradBuckets<comm::ThreadComm, backend::Host> buckets(mesh.data_group(), m.parameters(), {});  // DP 1: no payload
        zero::ZeroOptimizer<backend::Host, comm::ThreadComm> adam(m.parameters(), {&buckets}, {}, tp, mesh.tp_rank());
        const std::int64_t adam_bytes = memory::live_bytes() - before - model_bytes;

        const auto ps = plan::stage_parameters(c, tp, 1, pp::StageLayers::whole(c.num_layers));
        CHECK(listed(ps) == listed(m));
        check_flags(m, ps);

        plan::TrainingPlan tplan;
        tplan.model = c;
        tplan.layout = {.tensor = tp, .pipeline = 1, .data = 1, .expert = 1};
        tplan.precision = plan::Precision::Fp32;
        const auto ledger = plan::predict_training(tplan).worst_rank().bytes;
        CHECK(ledger.parameters + ledger.gradients == model_bytes);  // value + grad of every shard, fp32
        CHECK(ledger.optimizer_state == adam_bytes);                 // exp_avg + exp_avg_sq, fp32
      });
    }
}

TEST_CASE("ledger parameters equal each PipelineStage's at PP 2 (tied copy on the last stage)") {
  for (bool tied : {false, true})
    for (int tp : {1, 2}) {
      CAPTURE(tp);
      CAPTURE(tied);
      const auto c = dense(tied);
      const auto stages = pp::stage_layers(pp::even_layer_split(c.num_layers, 2), c.num_layers);  // 2 + 1 layers
      comm::launch(tp, [&](comm::ThreadComm& world) {
        for (const auto& s : stages) {
          pp::PipelineStage<P> stage(c, world, s, 42);
          const auto ps = plan::stage_parameters(c, tp, 1, s);
          CHECK(listed(ps) == listed(stage));
          check_flags(stage, ps);
        }
      });
      // The ledger's per-rank parameter elements are these stages' (pipeline rank r = stage r).
      plan::TrainingPlan tplan;
      tplan.model = c;
      tplan.layout = {.tensor = tp, .pipeline = 2, .data = 1, .expert = 1};
      tplan.global_batch_size = 2;
      const auto pred = plan::predict_training(tplan);
      REQUIRE(pred.ranks.size() == 2);
      for (int r = 0; r < 2; ++r)
        CHECK(pred.ranks[std::size_t(r)].elements.total() ==
              plan::stage_parameter_count(c, tp, 1, stages[std::size_t(r)]).total());
    }
}

TEST_CASE("ledger parameters equal an MoE CausalLM's at TP 1/2 x EP 1/2 (experts split over EP)") {
  for (int tp : {1, 2})
    for (int ep : {1, 2}) {
      CAPTURE(tp);
      CAPTURE(ep);
      comm::launch(tp * ep, [&](comm::ThreadComm& world) {
        DeviceMesh mesh(world, ParallelLayout{.tensor = tp, .expert = ep});  // data = ep
        const auto c = moe();
        const std::int64_t before = memory::live_bytes();
        model::CausalLM<P> m(c, mesh, 42);
        const std::int64_t model_bytes = memory::live_bytes() - before;
        const auto ps = plan::stage_parameters(c, tp, ep, pp::StageLayers::whole(c.num_layers), mesh.ep_rank());
        CHECK(listed(ps) == listed(m));
        check_flags(m, ps);
        const auto n = plan::count(ps);
        CHECK(n.buffers == 2 * c.num_experts);  // the expert bias of the two MoE layers
        // Dense parameters and buffers are the same on every EP rank; each EP rank holds
        // num_experts / ep routed experts of every MoE layer.
        CHECK(n.expert == 2 * (c.num_experts / ep) * 3 * c.hidden_size * (c.moe_ffn_hidden_size / tp));
        // fp32, ZeRO 0 at DP = ep, EP = ep: value + grad of the parameters, the value of the
        // buffers (no gradient), as allocated.
        plan::TrainingPlan tplan;
        tplan.model = c;
        tplan.layout = {.tensor = tp, .pipeline = 1, .data = ep, .expert = ep};
        tplan.precision = plan::Precision::Fp32;
        tplan.global_batch_size = ep;
        const auto ledger = plan::predict_training(tplan).worst_rank().bytes;
        CHECK(ledger.parameters + ledger.gradients == model_bytes);
      });
    }
}

}  // namespace plan_parameters_test
