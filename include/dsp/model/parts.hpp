#pragma once
// The model as an explicit list of parts, described before anything is allocated:
//   embedding   model.embed_tokens.weight [vocab, hidden], split by vocabulary rows
//               (when the range starts the model: PartRange::pre_process)
//   blocks      one per decoder layer l of the range, model.layers.{l}.*: input_layernorm,
//               the attention, post_attention_layernorm, the feed-forward (dense MLP or MoE)
//   head        model.norm.weight and the output layer: lm_head.weight, or the embedding table
//               when tied (a copy of it on a last stage without the embedding)
//               (when the range ends the model: PartRange::post_process)
// Each part lists its tensors as ParameterSpecs (ShardedTensor, init, flags) in the order the
// part allocates them. model::CausalLM builds every part from this description (each layer's
// constructor takes its part's spec), so the model holds exactly what the description lists;
// readers that must not allocate (the ledger, plan/parameters.hpp) read the description.
// Which attention and which feed-forward layer l has is decided in one place: layer_kind().
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dsp/core/divide.hpp"
#include "dsp/core/error.hpp"
#include "dsp/model/config.hpp"
#include "dsp/model/part_range.hpp"
#include "dsp/parallel/parameter.hpp"
#include "dsp/tp/swiglu_spec.hpp"

namespace dsp::model {

/// The attention of a decoder layer: grouped-query attention (model/attention.hpp) or
/// Multi-head Latent Attention (model/mla_attention.hpp).
enum class AttentionKind { Gqa, Mla };
/// The feed-forward of a decoder layer: the dense SwiGLU MLP or the DeepSeekMoE layer.
enum class FeedForwardKind { Dense, Moe };

/// What decoder layer `layer` is made of.
struct LayerKind {
  AttentionKind attention = AttentionKind::Gqa;
  FeedForwardKind feed_forward = FeedForwardKind::Dense;
};

/// The one place that says which attention and which feed-forward global layer `layer` has:
/// MLA in every layer when the config has a KV latent (ModelConfig::is_mla), else GQA; MoE from
/// first_k_dense_replace on in an MoE model (ModelConfig::is_moe_layer), else dense.
inline LayerKind layer_kind(const ModelConfig& c, std::int64_t layer) {
  return {c.is_mla() ? AttentionKind::Mla : AttentionKind::Gqa,
          c.is_moe_layer(layer) ? FeedForwardKind::Moe : FeedForwardKind::Dense};
}

/// Megatron's scaled init for the projections that write into the residual stream (o_proj,
/// down_proj): init_method_std / sqrt(2 x layers).
inline float output_init_std(const ModelConfig& c) {
  return c.init_method_std / std::sqrt(2.0f * static_cast<float>(c.num_layers));
}

/// "model.layers.{layer}": the Hugging Face prefix of a decoder layer's tensors.
inline std::string layer_prefix(std::int64_t layer) { return "model.layers." + std::to_string(layer); }

/// The tensors of grouped-query attention (model::Attention).
struct GqaAttentionSpec {
  ParameterSpec qkv;  ///< "{prefix}.qkv_proj.weight" [(heads + 2 kv_heads) head_dim, hidden], column-parallel per KV group
  ParameterSpec o;    ///< "{prefix}.o_proj.weight" [hidden, heads head_dim], row-parallel

  /// Layer `layer`'s attention, prefix "model.layers.{layer}.self_attn".
  static GqaAttentionSpec describe(const ModelConfig& c, std::int64_t layer) {
    const std::string p = layer_prefix(layer) + ".self_attn";
    return {{ShardedTensor::qkv(p + ".qkv_proj.weight", c.hidden_size, c.num_attention_heads, c.num_query_groups,
                                c.head_dim(), {p + ".q_proj.weight", p + ".k_proj.weight", p + ".v_proj.weight"}),
             {Init::Normal, c.init_method_std}},
            {ShardedTensor::split(p + ".o_proj.weight", {c.hidden_size, c.num_attention_heads * c.head_dim()}, 1),
             {Init::Normal, output_init_std(c)}}};
  }
  std::vector<const ParameterSpec*> parameters() const { return {&qkv, &o}; }
};

/// The tensors of Multi-head Latent Attention (model::MLAttention; DeepSeek-V2 report section
/// 2.1, Hugging Face names), tensor-parallel as Megatron-Core and vLLM split it: the two
/// down-projections and their norms replicated, the up-projections split by heads, o_proj
/// row-parallel. heads = num_attention_heads, qk = qk_nope_head_dim + qk_rope_head_dim.
struct MlaAttentionSpec {
  std::optional<ParameterSpec> q_a;       ///< q_a_proj.weight [q_lora_rank, hidden], replicated (when q_lora_rank > 0)
  std::optional<ParameterSpec> q_a_norm;  ///< q_a_layernorm.weight [q_lora_rank], replicated, ones
  ParameterSpec q_b;        ///< q_b_proj.weight [heads qk, q_lora_rank] (or q_proj.weight [heads qk, hidden]), split by heads
  ParameterSpec kv_a;       ///< kv_a_proj_with_mqa.weight [kv_lora_rank + qk_rope_head_dim, hidden], replicated
  ParameterSpec kv_a_norm;  ///< kv_a_layernorm.weight [kv_lora_rank], replicated, ones
  ParameterSpec kv_b;       ///< kv_b_proj.weight [heads (qk_nope_head_dim + v_head_dim), kv_lora_rank], split by heads
  ParameterSpec o;          ///< o_proj.weight [hidden, heads v_head_dim], row-parallel

  /// Layer `layer`'s attention, prefix "model.layers.{layer}.self_attn".
  static MlaAttentionSpec describe(const ModelConfig& c, std::int64_t layer) {
    const std::string p = layer_prefix(layer) + ".self_attn";
    const Init normal{Init::Normal, c.init_method_std};
    const std::int64_t h = c.hidden_size, heads = c.num_attention_heads,
                       qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    auto ones = [](std::string name, std::int64_t n) {
      return ParameterSpec{ShardedTensor::replicated(std::move(name), {n}), {Init::Ones}};
    };
    MlaAttentionSpec s{
        std::nullopt,
        std::nullopt,
        {ShardedTensor::split(p + (c.q_lora_rank > 0 ? ".q_b_proj.weight" : ".q_proj.weight"),
                              {heads * qk, c.q_lora_rank > 0 ? c.q_lora_rank : h}, 0),
         normal},
        {ShardedTensor::replicated(p + ".kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, h}), normal},
        ones(p + ".kv_a_layernorm.weight", c.kv_lora_rank),
        {ShardedTensor::split(p + ".kv_b_proj.weight", {heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, 0),
         normal},
        {ShardedTensor::split(p + ".o_proj.weight", {h, heads * c.v_head_dim}, 1), {Init::Normal, output_init_std(c)}}};
    if (c.q_lora_rank > 0) {
      s.q_a = ParameterSpec{ShardedTensor::replicated(p + ".q_a_proj.weight", {c.q_lora_rank, h}), normal};
      s.q_a_norm = ones(p + ".q_a_layernorm.weight", c.q_lora_rank);
    }
    return s;
  }
  /// q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_a_layernorm,
  /// kv_b_proj, o_proj (model::MLAttention::parameters()).
  std::vector<const ParameterSpec*> parameters() const {
    std::vector<const ParameterSpec*> out;
    if (q_a) out.insert(out.end(), {&*q_a, &*q_a_norm});
    out.insert(out.end(), {&q_b, &kv_a, &kv_a_norm, &kv_b, &o});
    return out;
  }
};

/// The tensors of a DeepSeekMoE layer (model::MoELayer) on one expert-parallel rank, under
/// "model.layers.{layer}.mlp".
struct MoeSpec {
  ParameterSpec router;                      ///< gate.weight [experts, hidden], replicated
  std::optional<tp::SwiGluSpec> shared;      ///< shared_experts, num_shared_experts x moe_ffn wide (when any)
  std::int64_t first_expert = 0;             ///< global index of experts[0]
  std::vector<tp::SwiGluSpec> experts;       ///< this EP rank's routed experts, experts.{e}, Parameter::expert
  std::optional<ParameterSpec> expert_bias;  ///< gate.e_score_correction_bias [experts], a buffer (with the expert bias)

  /// Layer `layer`'s MoE on EP rank `ep_rank` of `ep_size` (experts [E/ep x rank, + E/ep)),
  /// the experts' down projections drawn with down_std. Throws ConfigError (naming the
  /// numbers) when the experts do not split over ep_size.
  static MoeSpec describe(const ModelConfig& c, std::int64_t layer, float down_std, int ep_size, int ep_rank) {
    c.validate_expert_parallel(ep_size);
    const std::string p = layer_prefix(layer) + ".mlp";
    const std::int64_t h = c.hidden_size,
                       local = divide(c.num_experts, ep_size, "number of experts", "expert-model-parallel-size");
    MoeSpec s{{ShardedTensor::replicated(p + ".gate.weight", {c.num_experts, h}), {Init::Normal, c.init_method_std}},
              std::nullopt,
              local * ep_rank,
              {},
              std::nullopt};
    if (c.num_shared_experts > 0)
      s.shared = tp::SwiGluSpec::describe(p + ".shared_experts", h, c.num_shared_experts * c.moe_ffn_hidden_size,
                                          c.init_method_std, down_std);
    for (std::int64_t e = s.first_expert; e < s.first_expert + local; ++e)
      s.experts.push_back(tp::SwiGluSpec::describe(p + ".experts." + std::to_string(e), h, c.moe_ffn_hidden_size,
                                                   c.init_method_std, down_std, true));
    if (c.moe_router_enable_expert_bias)
      s.expert_bias = ParameterSpec{ShardedTensor::replicated(p + ".gate.e_score_correction_bias", {c.num_experts}),
                                    {Init::Zeros}, false, false, true};
    return s;
  }
  /// The router, the shared experts, then the routed experts (model::MoELayer::parameters()).
  std::vector<const ParameterSpec*> parameters() const {
    std::vector<const ParameterSpec*> out{&router};
    if (shared) out.insert(out.end(), {&shared->gate_up, &shared->down});
    for (const auto& e : experts) out.insert(out.end(), {&e.gate_up, &e.down});
    return out;
  }
  /// Saved state not trained by gradients: the expert bias (empty without it).
  std::vector<const ParameterSpec*> buffers() const {
    if (expert_bias) return {&*expert_bias};
    return {};
  }
};

/// The tensors of one decoder block (model::DecoderBlock).
struct DecoderBlockSpec {
  std::int64_t layer = 0;  ///< global layer index
  LayerKind kind;
  ParameterSpec input_norm;           ///< input_layernorm.weight [hidden], replicated, ones
  std::optional<GqaAttentionSpec> gqa;  ///< self_attn.* (kind.attention == Gqa)
  std::optional<MlaAttentionSpec> mla;  ///< self_attn.* (kind.attention == Mla)
  ParameterSpec post_attention_norm;  ///< post_attention_layernorm.weight [hidden], replicated, ones
  std::optional<tp::SwiGluSpec> mlp;  ///< mlp.*: the dense MLP (kind.feed_forward == Dense)
  std::optional<MoeSpec> moe;         ///< mlp.*: the MoE layer (kind.feed_forward == Moe)

  /// Layer `layer` of `c` on EP rank `ep_rank` of `ep_size`. Throws ConfigError as
  /// MoeSpec::describe.
  static DecoderBlockSpec describe(const ModelConfig& c, std::int64_t layer, int ep_size, int ep_rank) {
    const std::string p = layer_prefix(layer);
    DecoderBlockSpec s{layer,
                       layer_kind(c, layer),
                       norm(p + ".input_layernorm.weight", c.hidden_size),
                       std::nullopt,
                       std::nullopt,
                       norm(p + ".post_attention_layernorm.weight", c.hidden_size),
                       std::nullopt,
                       std::nullopt};
    if (s.kind.attention == AttentionKind::Mla) s.mla = MlaAttentionSpec::describe(c, layer);
    else s.gqa = GqaAttentionSpec::describe(c, layer);
    if (s.kind.feed_forward == FeedForwardKind::Moe)
      s.moe = MoeSpec::describe(c, layer, output_init_std(c), ep_size, ep_rank);
    else
      s.mlp = tp::SwiGluSpec::describe(p + ".mlp", c.hidden_size, c.ffn_hidden_size, c.init_method_std,
                                       output_init_std(c));
    return s;
  }
  /// An RMSNorm weight: [hidden], replicated, initialised to ones.
  static ParameterSpec norm(std::string name, std::int64_t hidden) {
    return {ShardedTensor::replicated(std::move(name), {hidden}), {Init::Ones}};
  }

  /// Input norm, attention, post-attention norm, feed-forward (model::DecoderBlock::parameters()).
  std::vector<const ParameterSpec*> parameters() const {
    std::vector<const ParameterSpec*> out{&input_norm};
    for (const auto* a : gqa ? gqa->parameters() : mla->parameters()) out.push_back(a);
    out.push_back(&post_attention_norm);
    if (mlp) out.insert(out.end(), {&mlp->gate_up, &mlp->down});
    if (moe)
      for (const auto* m : moe->parameters()) out.push_back(m);
    return out;
  }
  std::vector<const ParameterSpec*> buffers() const { return moe ? moe->buffers() : std::vector<const ParameterSpec*>{}; }
};

/// The tensors of the last part: the final norm and the output layer.
struct HeadSpec {
  ParameterSpec final_norm;  ///< model.norm.weight [hidden], replicated, ones
  /// lm_head.weight [vocab, hidden] split by vocabulary rows; nullopt when tied (the output
  /// layer multiplies by the embedding table).
  std::optional<ParameterSpec> lm_head;
  /// Tied embeddings on a range without the embedding (a last pipeline stage): this range's
  /// copy of model.embed_tokens.weight (Parameter::tied_copy), drawn from the same (seed, name)
  /// as the first stage's table.
  std::optional<ParameterSpec> tied_copy;
};

/// The parts of a range of the model on one expert-parallel rank (the same on every TP rank:
/// a ShardedTensor gives each TP rank its local shape).
struct ModelParts {
  PartRange range;
  std::optional<ParameterSpec> embedding;  ///< when range.pre_process
  std::vector<DecoderBlockSpec> blocks;    ///< layers range.first_layer, +1, ...
  std::optional<HeadSpec> head;            ///< when range.post_process

  static constexpr const char* embedding_name = "model.embed_tokens.weight";

  /// Every trained tensor once, in the order of model::CausalLM::parameters(): the embedding,
  /// each block's, the final norm, the untied output layer or the tied copy.
  std::vector<const ParameterSpec*> parameters() const {
    std::vector<const ParameterSpec*> out;
    if (embedding) out.push_back(&*embedding);
    for (const auto& b : blocks)
      for (const auto* p : b.parameters()) out.push_back(p);
    if (head) {
      out.push_back(&head->final_norm);
      if (head->lm_head) out.push_back(&*head->lm_head);
      if (head->tied_copy) out.push_back(&*head->tied_copy);
    }
    return out;
  }
  /// The saved state gradients do not train (MoE expert biases), block by block.
  std::vector<const ParameterSpec*> buffers() const {
    std::vector<const ParameterSpec*> out;
    for (const auto& b : blocks)
      for (const auto* p : b.buffers()) out.push_back(p);
    return out;
  }
  /// parameters() then buffers(): what a checkpoint of the range holds (with the tied copy,
  /// which saving leaves out), the order of model::CausalLM::state_parameters().
  std::vector<const ParameterSpec*> state() const {
    std::vector<const ParameterSpec*> out = parameters();
    for (const auto* b : buffers()) out.push_back(b);
    return out;
  }
};

/// The parts of `range` of model `c` on EP rank `ep_rank` of `ep_size`. Allocates no tensor.
/// Throws ConfigError (naming the numbers) when the range lies outside the model or the
/// experts do not split over ep_size.
inline ModelParts describe_parts(const ModelConfig& c, const PartRange& range, int ep_size = 1, int ep_rank = 0) {
  DSP_CHECK_AS(ConfigError, range.first_layer >= 0 && range.num_layers >= 0 &&
                                range.first_layer + range.num_layers <= c.num_layers,
               "stage layers [", range.first_layer, ", ", range.first_layer + range.num_layers,
               ") lie outside the model's ", c.num_layers, " layers");
  ModelParts parts{range, std::nullopt, {}, std::nullopt};
  const Init normal{Init::Normal, c.init_method_std};
  const Shape table{c.vocab_size, c.hidden_size};
  if (range.pre_process) parts.embedding = ParameterSpec{ShardedTensor::vocab(ModelParts::embedding_name, table), normal};
  for (std::int64_t l = range.first_layer; l < range.first_layer + range.num_layers; ++l)
    parts.blocks.push_back(DecoderBlockSpec::describe(c, l, ep_size, ep_rank));
  if (range.post_process) {
    parts.head = HeadSpec{DecoderBlockSpec::norm("model.norm.weight", c.hidden_size), std::nullopt, std::nullopt};
    if (!c.tie_word_embeddings)
      parts.head->lm_head = ParameterSpec{ShardedTensor::vocab("lm_head.weight", table), normal};
    else if (!range.pre_process)
      parts.head->tied_copy = ParameterSpec{ShardedTensor::vocab(ModelParts::embedding_name, table), normal, false, true};
  }
  return parts;
}

}  // namespace dsp::model
