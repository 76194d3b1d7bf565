// model::describe_parts, the model's description of its parts: the model built from it holds
// exactly the described tensors (spec, order and flags, per rank, for whole models, pipeline
// ranges and expert-parallel ranks), layer_kind says which feed-forward each layer has, and
// the description of a model far too large to allocate (DeepSeek-V3's MoE dimensions with GQA)
// counts the parameters ModelConfig::num_parameters() gives in closed form.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/model/causal_lm.hpp"
#include "dsp/model/parts.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/policy.hpp"

using namespace dsp;

namespace model_parts_test {
using P = Policy<backend::Host, comm::ThreadComm>;

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

// The model's tensors against its description, one by one: the spec, the flags, a buffer has
// no gradient, and the shard has the spec's local shape at this TP size.
void check_built_from_description(model::CausalLM<P>& m, int tp) {
  const std::vector<Parameter*> built = m.state_parameters();
  const std::vector<const ParameterSpec*> described = m.parts().state();
  REQUIRE(built.size() == described.size());
  for (std::size_t i = 0; i < built.size(); ++i) {
    CAPTURE(described[i]->tensor.name);
    CHECK(built[i]->spec == described[i]->tensor);
    CHECK(built[i]->expert == described[i]->expert);
    CHECK(built[i]->tied_copy == described[i]->tied_copy);
    CHECK((built[i]->grad.numel() == 0) == described[i]->buffer);
    CHECK(built[i]->value.shape() == described[i]->local_shape(tp));
  }
  // ZeRO's per-part lists are the described parts, part by part.
  const auto& parts = m.parameter_parts();
  const auto& spec = m.parts();
  REQUIRE(parts.size() == (spec.embedding ? 1 : 0) + spec.blocks.size() + (spec.head ? 1 : 0));
  const std::size_t first_block = spec.embedding ? 1 : 0;
  for (std::size_t b = 0; b < spec.blocks.size(); ++b) {
    const auto names = spec.blocks[b].parameters();
    REQUIRE(parts[first_block + b].size() == names.size());
    for (std::size_t k = 0; k < names.size(); ++k) CHECK(parts[first_block + b][k]->spec == names[k]->tensor);
  }
}

TEST_CASE("the model holds exactly the tensors of its description") {
  for (bool tied : {false, true})
    for (int tp : {1, 2}) {
      CAPTURE(tied);
      CAPTURE(tp);
      comm::launch(tp, [&](comm::ThreadComm& world) {
        model::CausalLM<P> whole(dense(tied), world, model::PartRange::whole(3), 7);
        check_built_from_description(whole, tp);
        // Two pipeline stages: the tied copy on the last one.
        for (const model::PartRange range : {model::PartRange{0, 2, true, false}, model::PartRange{2, 1, false, true}}) {
          model::CausalLM<P> stage(dense(tied), world, range, 7);
          check_built_from_description(stage, tp);
          CHECK(stage.parts().head.has_value() == range.post_process);
          CHECK((stage.parts().head && stage.parts().head->tied_copy) == (tied && range.post_process));
        }
      });
    }
  comm::launch(4, [&](comm::ThreadComm& world) {  // MoE at TP 2 x EP 2
    DeviceMesh mesh(world, ParallelLayout{.tensor = 2, .expert = 2});
    model::CausalLM<P> m(moe(), mesh, 7);
    check_built_from_description(m, 2);
    const auto& experts = m.parts().blocks.at(1).moe->experts;
    REQUIRE(experts.size() == 2);
    CHECK(experts[0].gate_up.tensor.name ==
          "model.layers.1.mlp.experts." + std::to_string(2 * mesh.ep_rank()) + ".gate_up_proj.weight");
  });
}

TEST_CASE("an MLA model (with and without a query latent) holds exactly the tensors of its description") {
  for (std::int64_t q_lora : {0, 12}) {
    model::ModelConfig c = moe();
    c.q_lora_rank = q_lora;
    c.kv_lora_rank = 8;
    c.qk_nope_head_dim = 4;
    c.qk_rope_head_dim = 4;
    c.v_head_dim = 6;
    CAPTURE(q_lora);
    CHECK(model::layer_kind(c, 0).attention == model::AttentionKind::Mla);
    comm::launch(2, [&](comm::ThreadComm& world) {
      model::CausalLM<P> m(c, world, model::PartRange::whole(3), 7);
      check_built_from_description(m, 2);
      const auto& mla = *m.parts().blocks.at(0).mla;
      CHECK(mla.q_a.has_value() == (q_lora > 0));
      CHECK(mla.q_b.tensor.name == (q_lora > 0 ? "model.layers.0.self_attn.q_b_proj.weight"
                                               : "model.layers.0.self_attn.q_proj.weight"));
      CHECK_FALSE(m.parts().blocks.at(0).gqa.has_value());
    });
    // The description's count equals ModelConfig's closed form for MLA too.
    std::int64_t described = 0;
    const model::ModelParts parts = model::describe_parts(c, model::PartRange::whole(3));
    for (const auto* p : parts.parameters()) described += numel(p->tensor.global_shape);
    CHECK(described == c.num_parameters());
  }
}

TEST_CASE("layer_kind decides each layer's feed-forward, and the blocks follow it") {
  model::ModelConfig c = moe();
  c.num_layers = 4;
  c.first_k_dense_replace = 2;
  const model::ModelParts parts = model::describe_parts(c, model::PartRange::whole(4));
  for (std::int64_t l = 0; l < 4; ++l) {
    CAPTURE(l);
    const bool is_moe = l >= 2;
    CHECK(model::layer_kind(c, l).attention == model::AttentionKind::Gqa);
    CHECK((model::layer_kind(c, l).feed_forward == model::FeedForwardKind::Moe) == is_moe);
    const auto& block = parts.blocks.at(static_cast<std::size_t>(l));
    CHECK(block.layer == l);
    CHECK(block.moe.has_value() == is_moe);
    CHECK(block.mlp.has_value() == !is_moe);
  }
  CHECK(model::layer_kind(dense(false), 2).feed_forward == model::FeedForwardKind::Dense);
  CHECK_THROWS_AS(model::describe_parts(c, {3, 2, false, true}), ConfigError);  // layers [3, 5) of 4
  CHECK_THROWS_AS(model::describe_parts(c, model::PartRange::whole(4), 3, 0), ConfigError);  // 4 experts over EP 3
}

TEST_CASE("a model too large to allocate is counted from its description") {
  // DeepSeek-V3's dimensions (hidden 7168, 61 layers of which 3 dense with ffn 18432, 256
  // routed experts of 2048 and one shared, vocabulary 129280), with GQA attention instead of
  // MLA: ~6.7e11 parameters, 2.7 TB in fp32, so the description must not allocate.
  model::ModelConfig c{.vocab_size = 129280, .hidden_size = 7168, .num_layers = 61, .num_attention_heads = 128,
                       .num_query_groups = 128, .ffn_hidden_size = 18432};
  c.num_experts = 256;
  c.moe_router_topk = 8;
  c.moe_ffn_hidden_size = 2048;
  c.num_shared_experts = 1;
  c.first_k_dense_replace = 3;
  c.moe_router_enable_expert_bias = true;
  const model::ModelParts parts = model::describe_parts(c, model::PartRange::whole(c.num_layers));
  std::int64_t trained = 0, buffers = 0;
  for (const auto* p : parts.parameters()) trained += numel(p->tensor.global_shape);
  for (const auto* p : parts.buffers()) buffers += numel(p->tensor.global_shape);
  CHECK(trained == c.num_parameters());  // the closed form in model/config.hpp
  CHECK(buffers == (61 - 3) * 256);      // one expert bias per MoE layer
  CHECK(trained > 600'000'000'000);
}

}  // namespace model_parts_test
