#pragma once
// A DeepSeek-style decoder block (pre-norm):
//   h = x + Attention(RMSNorm(x)),  out = h + FFN(RMSNorm(h)),
// Attention grouped-query (Attention) or Multi-head Latent Attention (MLAttention), FFN the
// dense SwiGLU MLP, or in an MoE layer the DeepSeekMoE layer (MoELayer), as the
// block's DecoderBlockSpec says (layer_kind, model/parts.hpp).
// Hugging Face names: model.layers.{i}.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}.
#include <memory>
#include <string>

#include "dsp/backend/host/elementwise.hpp"
#include "dsp/core/trace.hpp"
#include "dsp/model/moe_layer.hpp"
#include "dsp/model/attention.hpp"
#include "dsp/model/mla_attention.hpp"
#include "dsp/model/mlp.hpp"
#include "dsp/model/rms_norm.hpp"

namespace dsp::model {

template <class Policy>
class DecoderBlock {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;
  struct Saved {
    typename RMSNorm<Policy>::Saved norm1, norm2;
    typename Attention<Policy>::Saved attn;   ///< GQA
    typename MLAttention<Policy>::Saved mla;  ///< MLA
    typename MLP<Policy>::Saved mlp;
    typename MoELayer<Policy>::Saved moe;
    /// Every activation kept (the unused one of attn and mla, and of mlp and moe, is empty).
    std::vector<Tensor*> tensors() {
      std::vector<Tensor*> out;
      for (const auto& part :
           {norm1.tensors(), norm2.tensors(), attn.tensors(), mla.tensors(), mlp.tensors(), moe.tensors()})
        out.insert(out.end(), part.begin(), part.end());
      return out;
    }
  };

  /// Builds this rank's shards of `spec` (DecoderBlockSpec::describe; spec.layer: the global
  /// layer index, which names and the KV-cache slot use), in the spec's order. ep: the
  /// expert-parallel group of an MoE layer (unused by dense layers).
  DecoderBlock(Comm& tp, Comm& ep, const ModelConfig& c, const DecoderBlockSpec& spec, std::uint64_t seed)
      : norm1_(spec.input_norm, c.norm_epsilon, tp.size(), tp.rank()),
        norm2_(spec.post_attention_norm, c.norm_epsilon, tp.size(), tp.rank()),
        layer_(spec.layer),
        forward_span_("layers." + std::to_string(spec.layer) + ".forward"),
        backward_span_("layers." + std::to_string(spec.layer) + ".backward") {
    if (spec.mla) mla_ = std::make_unique<MLAttention<Policy>>(tp, c, *spec.mla, spec.layer, seed);
    else attn_ = std::make_unique<Attention<Policy>>(tp, c, *spec.gqa, spec.layer, seed);
    if (spec.moe) moe_ = std::make_unique<MoELayer<Policy>>(tp, ep, c, spec.layer, *spec.moe, seed);
    else mlp_ = std::make_unique<MLP<Policy>>(tp, *spec.mlp, seed);
  }

  /// x [tokens, hidden] -> [tokens, hidden]; saved may be null (inference). The normalised
  /// inputs, the residual stream and the output are rounded to ctx.activations.
  Tensor forward(const ForwardContext& ctx, const Tensor& x, Saved* saved) {
    trace::Span span(forward_span_, trace::Kind::Compute);
    Tensor normed = norm1_.forward(x, saved ? &saved->norm1 : nullptr);
    round_activations(Backend{}, ctx.activations, normed);
    Tensor h = mla_ ? mla_->forward(ctx, normed, saved ? &saved->mla : nullptr)
                    : attn_->forward(ctx, normed, saved ? &saved->attn : nullptr);
    add(Backend{}, x.numel(), x.data(), h.data());
    round_activations(Backend{}, ctx.activations, h);
    normed = norm2_.forward(h, saved ? &saved->norm2 : nullptr);
    round_activations(Backend{}, ctx.activations, normed);
    Tensor out = moe_ ? moe_->forward(ctx, normed, saved ? &saved->moe : nullptr)
                      : mlp_->forward(normed, saved ? &saved->mlp : nullptr, !ctx.recompute.selective(),
                                      ctx.activations);
    add(Backend{}, h.numel(), h.data(), out.data());
    round_activations(Backend{}, ctx.activations, out);
    return out;
  }
  /// dout [tokens, hidden] -> dx; accumulates every parameter's gradient.
  Tensor backward(const ForwardContext& ctx, const Tensor& dout, const Saved& s) {
    trace::Span span(backward_span_, trace::Kind::Compute);
    Tensor dh = norm2_.backward(moe_ ? moe_->backward(ctx, dout, s.moe) : mlp_->backward(dout, s.mlp), s.norm2);
    add(Backend{}, dout.numel(), dout.data(), dh.data());
    Tensor dx = norm1_.backward(mla_ ? mla_->backward(ctx, dh, s.mla) : attn_->backward(ctx, dh, s.attn), s.norm1);
    add(Backend{}, dh.numel(), dh.data(), dx.data());
    return dx;
  }

  std::vector<Parameter*> parameters() {
    std::vector<Parameter*> p{&norm1_.weight()};
    for (auto* a : mla_ ? mla_->parameters() : attn_->parameters()) p.push_back(a);
    p.push_back(&norm2_.weight());
    for (auto* m : moe_ ? moe_->parameters() : mlp_->parameters()) p.push_back(m);
    return p;
  }
  /// Saved state that gradients do not train (an MoE layer's expert bias).
  std::vector<Parameter*> buffers() { return moe_ ? moe_->buffers() : std::vector<Parameter*>{}; }
  /// The MoE layer, null in a dense layer.
  MoELayer<Policy>* moe() { return moe_.get(); }
  /// GQA's K/V gradient of heads replicated over TP ranks (empty for MLA, which all-reduces its
  /// replicated projections' input gradients itself).
  std::span<float> replicated_kv_grad() { return mla_ ? std::span<float>{} : attn_->replicated_kv_grad(); }
  /// The MLA attention, null in a GQA layer.
  MLAttention<Policy>* mla() { return mla_.get(); }
  /// Values per token in this layer's paged KV cache on this rank: 2 x kv_heads/TP x head_dim
  /// for GQA (Attention::kv_values_per_token), kv_lora_rank + qk_rope_head_dim for MLA (its
  /// latent, on every TP rank).
  std::int64_t kv_values_per_token() const {
    return mla_ ? mla_->latent_values_per_token() : attn_->kv_values_per_token();
  }

 private:
  RMSNorm<Policy> norm1_;
  std::unique_ptr<Attention<Policy>> attn_;  // GQA layer
  std::unique_ptr<MLAttention<Policy>> mla_;  // MLA layer
  RMSNorm<Policy> norm2_;
  std::unique_ptr<MLP<Policy>> mlp_;          // dense layer
  std::unique_ptr<MoELayer<Policy>> moe_;  // MoE layer
  std::int64_t layer_;                        // global layer index
  std::string forward_span_, backward_span_;  // trace names: "layers.{layer}.forward", ...
};

}  // namespace dsp::model
