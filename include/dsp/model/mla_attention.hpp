#pragma once
// Multi-head Latent Attention (MLA; DeepSeek-V2, DeepSeek-AI 2024, section 2.1; also
// DeepSeek-V3), causal, with RoPE on interleaved pairs and YaRN (model/yarn.hpp). Names and
// shapes as Hugging Face's DeepseekV3Attention / DeepseekV2Attention (transformers 5.25):
//   q path:  x -> q_a_proj [q_lora, hidden] -> q_a_layernorm -> q_b_proj [heads * qk, q_lora]
//            (or q_proj [heads * qk, hidden] when q_lora_rank is null, as in V2-Lite);
//            each head's query = [q_nope (nope) | q_pe (rope)], qk = nope + rope
//   kv path: x -> kv_a_proj_with_mqa [kv_lora + rope, hidden] -> [c_kv | k_pe];
//            c_kv -> kv_a_layernorm -> kv_b_proj [heads * (nope + v), kv_lora] -> per head [k_nope | v];
//            k_pe (one rotary key shared by all heads) -> key = [k_nope | k_pe]
//   RoPE on q_pe and k_pe, interleaved pairs, YaRN-scaled; softmax scale 1/sqrt(qk) x mscale^2
//   softmax(scale q k^T + causal) v [tokens, heads * v] -> o_proj [hidden, heads * v].
// The RMSNorms use eps 1e-6 (DeepseekV3RMSNorm's default; transformers does not pass
// rms_norm_eps to them). Tensor parallel as Megatron-Core's MLASelfAttention and vLLM: q_a_proj,
// kv_a_proj_with_mqa and both norms replicated (every rank computes them on the same x),
// q_b_proj / q_proj and kv_b_proj column-parallel by heads, o_proj row-parallel (one all-reduce
// forward); backward all-reduces the gradients of the query latent and c_kv (inside the
// column-parallel layers) and of k_pe (each rank holds its heads' part), so the replicated
// weights get the full gradient on every rank.
//
// Serving, the absorbed form (DeepSeek-V2 section 2.1.2, "W^UK absorbed into W^Q, W^UV into
// W^O"), for prefill chunks and decode tokens alike: a token's entry in the paged cache is its
// normalised c_kv and rotated k_pe, kv_lora + rope values per layer on every TP rank; a query
// attends over them as one shared key/value head: q_abs = [q_nope W_UK | q_pe] against
// [c_kv | k_pe], the output latent sum_j p_j c_kv_j mapped by W_UV, then o_proj.
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dsp/backend/attention.hpp"
#include "dsp/backend/host/copy_columns.hpp"
#include "dsp/backend/host/elementwise.hpp"
#include "dsp/backend/host/paged_attention.hpp"
#include "dsp/backend/host/rope_interleaved.hpp"
#include "dsp/backend/host/transpose.hpp"
#include "dsp/backend/linear.hpp"
#include "dsp/precision/activation_precision.hpp"
#include "dsp/model/config.hpp"
#include "dsp/model/forward_context.hpp"
#include "dsp/model/parts.hpp"
#include "dsp/model/rms_norm.hpp"
#include "dsp/model/yarn.hpp"
#include "dsp/tp/column_parallel_linear.hpp"
#include "dsp/tp/mappings.hpp"
#include "dsp/tp/row_parallel_linear.hpp"

namespace dsp::model {

/// Bytes one token's MLA cache entry takes in one layer (on every TP rank: the latent is not
/// split): (kv_lora_rank + qk_rope_head_dim) x dtype_bytes. DeepSeek-V3 in bf16:
/// (512 + 64) x 2 = 1,152 per layer, x 61 layers = 70,272 bytes per token (GQA with the same
/// 128 heads of 128 would cache 2 x 128 x 128 x 2 = 65,536 per layer). Throws ConfigError for a
/// config without MLA.
inline std::int64_t mla_cache_bytes_per_token(const ModelConfig& c, std::int64_t dtype_bytes) {
  DSP_CHECK_AS(ConfigError, c.is_mla(), "MLA cache size asked of a config without MLA (kv_lora_rank = 0)");
  return (c.kv_lora_rank + c.qk_rope_head_dim) * dtype_bytes;
}

template <class Policy>
class MLAttention {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;
  /// The MLA RMSNorms' epsilon (transformers' DeepseekV3RMSNorm / DeepSeek's RMSNorm default).
  static constexpr float kLatentNormEps = 1e-6f;

  struct Saved {
    Tensor x;                                ///< [tokens, hidden]
    Tensor q_latent;                         ///< normalised q_a_proj output [tokens, q_lora] (empty without q_lora)
    typename RMSNorm<Policy>::Saved q_norm;  ///< q_a_layernorm's input and rstd
    typename RMSNorm<Policy>::Saved kv_norm; ///< kv_a_layernorm's input and rstd
    Tensor kv_latent;                        ///< normalised c_kv [tokens, kv_lora]
    Tensor q, k;                             ///< rotated [tokens, heads/tp, nope + rope]
    Tensor v;                                ///< [tokens, heads/tp, v]
    Tensor probs;                            ///< [batch, heads/tp, seq, seq] (empty under selective recomputation)
    Tensor context;                          ///< [tokens, heads/tp * v]
    /// The activations.
    std::vector<Tensor*> tensors() {
      return {&x, &q_latent, &q_norm.x, &kv_norm.x, &kv_latent, &q, &k, &v, &probs, &context};
    }
  };

  /// Builds this rank's shards of `spec` (MlaAttentionSpec::describe); layer: global layer index. Throws ConfigError when c
  /// is not an MLA config (kv_lora_rank = 0), heads do not split over TP, or a width is invalid;
  /// Error with use_flash_attn (MLA has no flash path yet).
  MLAttention(Comm& tp, const ModelConfig& c, const MlaAttentionSpec& spec, std::int64_t layer, std::uint64_t seed)
      : tp_(&tp),
        layer_(layer),
        heads_(checked(c, tp.size()).num_attention_heads / tp.size()),
        q_lora_(c.q_lora_rank),
        kv_lora_(c.kv_lora_rank),
        nope_(c.qk_nope_head_dim),
        rope_(c.qk_rope_head_dim),
        v_dim_(c.v_head_dim),
        scale_(static_cast<float>(mla_softmax_scale(nope_ + rope_, c.rope_scaling))),
        freq_(rope_frequencies(rope_, c.rope_theta, c.rope_scaling)),
        inv_freq_(freq_.inv_freq),
        kv_a_(spec.kv_a, seed, tp.size(), tp.rank()),
        kv_norm_(spec.kv_a_norm, kLatentNormEps, tp.size(), tp.rank()),
        kv_b_(tp, spec.kv_b.tensor, spec.kv_b.init, seed),
        o_(tp, spec.o.tensor, spec.o.init, seed) {
    DSP_CHECK(!c.use_flash_attn, "MLA (layer ", layer, "): --use-flash-attn is not implemented for MLA");
    if (spec.q_a) {
      q_a_.emplace(*spec.q_a, seed, tp.size(), tp.rank());
      q_norm_.emplace(*spec.q_a_norm, kLatentNormEps, tp.size(), tp.rank());
    }
    q_b_.emplace(tp, spec.q_b.tensor, spec.q_b.init, seed);
  }

  /// Training (and un-absorbed inference) over ctx's [batch, seq] layout: x [tokens, hidden] ->
  /// [tokens, hidden] (the same on every TP rank). Causal over positions 0..seq-1 of each row
  /// (ctx.positions give RoPE's angles and the mask). saved (may be null) keeps what backward
  /// needs, each rounded to ctx.activations; under selective recomputation not the probabilities.
  /// With ctx.paged (serving) the absorbed form over the latent cache instead (forward_paged;
  /// saved must be null). Throws Error for packed-document masks (not yet supported for MLA).
  Tensor forward(const ForwardContext& ctx, const Tensor& x, Saved* saved) {
    if (ctx.paged) {
      DSP_CHECK(!saved, "MLA: a paged serving batch keeps nothing for backward");
      return forward_paged(ctx, x);
    }
    DSP_CHECK(!ctx.masks_documents(), "MLA: packed-document masks (key_begin, mask_positions) are not supported yet");
    const std::int64_t n = ctx.tokens(), qk = nope_ + rope_;
    DSP_CHECK(static_cast<std::int64_t>(ctx.positions.size()) == n && x.dim(0) == n, "MLA: ", x.dim(0),
              " input rows and ", ctx.positions.size(), " positions for ", n, " tokens");
    Saved local;
    Saved& s = saved ? *saved : local;
    const SpaceArray<std::int32_t> positions(ctx.positions);
    s.q = query(x, positions.data(), &s);
    Tensor latent = project_latent(x, positions.data(), &s);
    s.kv_latent = Tensor({n, kv_lora_});
    copy_columns(Backend{}, latent.data(), kv_lora_ + rope_, 0, s.kv_latent.data(), kv_lora_, 0, n, kv_lora_);
    const Tensor kv = kv_b_.forward(s.kv_latent);  // [tokens, heads/tp * (nope + v)]
    s.k = Tensor({n, heads_ * qk});
    s.v = Tensor({n, heads_ * v_dim_});
    const std::int64_t kvw = heads_ * (nope_ + v_dim_);
    for (std::int64_t h = 0; h < heads_; ++h) {
      copy_columns(Backend{}, kv.data(), kvw, h * (nope_ + v_dim_), s.k.data(), heads_ * qk, h * qk, n, nope_);
      copy_columns(Backend{}, latent.data(), kv_lora_ + rope_, kv_lora_, s.k.data(), heads_ * qk, h * qk + nope_, n,
                   rope_);
      copy_columns(Backend{}, kv.data(), kvw, h * (nope_ + v_dim_) + nope_, s.v.data(), heads_ * v_dim_, h * v_dim_,
                   n, v_dim_);
    }
    for (Tensor* t : {&s.q, &s.k, &s.v}) round_activations(Backend{}, ctx.activations, *t);
    s.context = Tensor({n, heads_ * v_dim_});
    if (saved && !ctx.recompute.selective()) s.probs = Tensor({ctx.batch, heads_, ctx.seq, ctx.seq});
    scaled_attention_forward(Backend{}, s.q.data(), s.k.data(), s.v.data(), positions.data(), dims(ctx), s.context.data(),
                             s.probs.numel() > 0 ? s.probs.data() : nullptr);
    round_activations(Backend{}, ctx.activations, s.probs);
    round_activations(Backend{}, ctx.activations, s.context);
    Tensor y = o_.forward(s.context);
    if (saved) s.x = x;
    return y;
  }

  /// dy [tokens, hidden] -> dx [tokens, hidden] (the full gradient on every TP rank);
  /// accumulates the gradients of every projection and norm weight.
  Tensor backward(const ForwardContext& ctx, const Tensor& dy, const Saved& s) {
    const std::int64_t n = ctx.tokens(), qk = nope_ + rope_;
    const Tensor dcontext = o_.backward(s.context, dy);
    const SpaceArray<std::int32_t> positions(ctx.positions);
    const backend::AttentionDims d = dims(ctx);
    Tensor recomputed;  // the probabilities when the forward did not keep them
    if (s.probs.numel() == 0) {
      recomputed = Tensor({ctx.batch, heads_, ctx.seq, ctx.seq});
      Tensor context({n, heads_ * v_dim_});
      scaled_attention_forward(Backend{}, s.q.data(), s.k.data(), s.v.data(), positions.data(), d, context.data(),
                               recomputed.data());
      round_activations(Backend{}, ctx.activations, recomputed);
    }
    const Tensor& probs = s.probs.numel() > 0 ? s.probs : recomputed;
    Tensor dq({n, heads_ * qk}), dk({n, heads_ * qk}), dv({n, heads_ * v_dim_});
    scaled_attention_backward(Backend{}, s.q.data(), s.k.data(), s.v.data(), probs.data(), dcontext.data(), d,
                              dq.data(), dk.data(), dv.data());
    // k_pe is shared by the heads: its gradient sums over this rank's heads, then over TP
    Tensor dk_pe({n, rope_}), head_part({n, rope_});
    dk_pe.zero();
    const std::int64_t kvw = heads_ * (nope_ + v_dim_);
    Tensor dkv({n, kvw});
    for (std::int64_t h = 0; h < heads_; ++h) {
      copy_columns(Backend{}, dk.data(), heads_ * qk, h * qk + nope_, head_part.data(), rope_, 0, n, rope_);
      add(Backend{}, n * rope_, head_part.data(), dk_pe.data());
      copy_columns(Backend{}, dk.data(), heads_ * qk, h * qk, dkv.data(), kvw, h * (nope_ + v_dim_), n, nope_);
      copy_columns(Backend{}, dv.data(), heads_ * v_dim_, h * v_dim_, dkv.data(), kvw, h * (nope_ + v_dim_) + nope_,
                   n, v_dim_);
    }
    tp::CopyToTpRegion::backward(*tp_, dk_pe);
    rotate({dk_pe.data(), n, 1, rope_, rope_, rope_}, positions.data(), true);
    const Tensor dkv_latent = kv_b_.backward(s.kv_latent, dkv);  // summed over TP
    const Tensor dc_kv = kv_norm_.backward(dkv_latent, s.kv_norm);
    Tensor dkv_a({n, kv_lora_ + rope_});
    copy_columns(Backend{}, dc_kv.data(), kv_lora_, 0, dkv_a.data(), kv_lora_ + rope_, 0, n, kv_lora_);
    copy_columns(Backend{}, dk_pe.data(), rope_, 0, dkv_a.data(), kv_lora_ + rope_, kv_lora_, n, rope_);
    Tensor dx = replicated_backward(kv_a_, s.x, dkv_a);

    rotate(rope_slices(dq, n), positions.data(), true);
    if (q_lora_ > 0) {
      const Tensor dq_latent = q_b_->backward(s.q_latent, dq);  // summed over TP
      add(Backend{}, dx.numel(), replicated_backward(*q_a_, s.x, q_norm_->backward(dq_latent, s.q_norm)).data(),
          dx.data());
    } else {
      add(Backend{}, dx.numel(), q_b_->backward(s.x, dq).data(), dx.data());
    }
    return dx;
  }

  /// kv_b_proj's weight [heads/tp * (nope + v), kv_lora]: the absorbed attention of serving
  /// reads it per head, in slices (W_UK_h, W_UV_h), never as one matrix.
  Parameter& kv_b_weight() { return kv_b_.weight(); }

  /// Every weight of this layer: q_a_proj, q_a_layernorm, q_b_proj (or q_proj),
  /// kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj.
  std::vector<Parameter*> parameters() {
    std::vector<Parameter*> p;
    if (q_a_) p.insert(p.end(), {&*q_a_, &q_norm_->weight()});
    p.insert(p.end(), {&q_b_->weight(), &kv_a_, &kv_norm_.weight(), &kv_b_.weight(), &o_.weight()});
    return p;
  }

  // --- serving: the absorbed form over the paged latent cache ---

  /// Values per token of this layer's latent cache on this rank: kv_lora_rank + qk_rope_head_dim
  /// (not divided by TP: every rank caches the whole latent, as vLLM does).
  std::int64_t latent_values_per_token() const { return kv_lora_ + rope_; }

  std::int64_t layer() const { return layer_; }
  std::int64_t heads_local() const { return heads_; }
  /// The softmax scale: 1/sqrt(nope + rope) x YaRN's mscale^2 (mla_softmax_scale).
  float softmax_scale() const { return scale_; }

 private:
  static const ModelConfig& checked(const ModelConfig& c, int tp) {
    DSP_CHECK_AS(ConfigError, c.is_mla(), "MLAttention needs kv_lora_rank > 0");
    DSP_CHECK_AS(ConfigError, c.qk_nope_head_dim > 0 && c.v_head_dim > 0 && c.qk_rope_head_dim > 0,
                 "MLA widths must be positive: qk_nope_head_dim ", c.qk_nope_head_dim, ", qk_rope_head_dim ",
                 c.qk_rope_head_dim, ", v_head_dim ", c.v_head_dim);
    divide(c.num_attention_heads, tp, "number of attention heads", "tensor-model-parallel-size");
    return c;
  }

  backend::AttentionDims dims(const ForwardContext& ctx) const {
    return {.batch = ctx.batch, .q_len = ctx.seq, .kv_len = ctx.seq, .q_heads = heads_, .kv_heads = heads_,
            .qk_dim = nope_ + rope_, .v_dim = v_dim_, .scale = scale_};
  }

  /// The rope slices of q [tokens, heads/tp, nope + rope].
  backend::RotarySlices rope_slices(Tensor& q, std::int64_t n) const {
    return {q.data() + nope_, n, heads_, rope_, heads_ * (nope_ + rope_), nope_ + rope_};
  }

  /// Serving, absorbed (DeepSeek-V2 section 2.1.2): writes each token's latent
  /// [kv_a_layernorm(c_kv) | RoPE(k_pe)] into its slot of this layer's pool in ctx.paged, then
  /// every query head attends its sequence's latents 0..position as one shared key/value head
  /// (backend paged_latent_attention_forward) with q_abs = [q_nope W_UK | q_pe]; the output
  /// latent goes through W_UV and o_proj. x [tokens, hidden] -> [tokens, hidden], equal to
  /// forward() over each whole sequence within fp32 rounding (the products associate
  /// differently: q_nope (W_UK c) vs (q_nope W_UK) c). Every GEMM goes through
  /// linear_forward_strided, so a token's output is batch-invariant in a BatchInvariantScope.
  Tensor forward_paged(const ForwardContext& ctx, const Tensor& x) const {
    const std::int64_t n = x.dim(0), qk = nope_ + rope_, lw = kv_lora_ + rope_, kvw = nope_ + v_dim_;
    DSP_CHECK(static_cast<std::int64_t>(ctx.positions.size()) == n, "MLA: ", n, " input rows and ",
              ctx.positions.size(), " positions");
    const SpaceArray<std::int32_t> positions(ctx.positions);
    const backend::PagedKvLayer kv = ctx.paged->layer(layer_);
    const Tensor latent = project_latent(x, positions.data(), nullptr);
    paged_rows_write(Backend{}, kv, latent.data(), n, lw, lw, 0);
    const Tensor q = query(x, positions.data(), nullptr);
    const float* w_kv = kv_b_.weight().value.data();  // [heads/tp * (nope + v), kv_lora]: W_UK_h | W_UV_h per head
    Tensor w_uk_t({kv_lora_, nope_});                  // one head's W_UK^T, the [out, in] linear_forward takes
    Tensor q_abs({n, heads_ * lw});                    // [q_nope W_UK | q_pe] per head
    for (std::int64_t h = 0; h < heads_; ++h) {
      transpose(Backend{}, nope_, kv_lora_, w_kv + h * kvw * kv_lora_, kv_lora_, w_uk_t.data(), nope_);
      linear_forward_strided(Backend{}, q.data() + h * qk, heads_ * qk, w_uk_t.data(), nope_, q_abs.data() + h * lw,
                             heads_ * lw, n, nope_, kv_lora_);
      copy_columns(Backend{}, q.data(), heads_ * qk, h * qk + nope_, q_abs.data(), heads_ * lw, h * lw + kv_lora_, n,
                   rope_);
    }
    Tensor out_latent({n, heads_ * kv_lora_});  // sum_j p_j c_kv_j per head
    paged_latent_attention_forward(Backend{}, kv, q_abs.data(), positions.data(), n, heads_, lw, kv_lora_, scale_,
                                   out_latent.data());
    Tensor context({n, heads_ * v_dim_});  // out_latent_h W_UV_h^T
    for (std::int64_t h = 0; h < heads_; ++h)
      linear_forward_strided(Backend{}, out_latent.data() + h * kv_lora_, heads_ * kv_lora_,
                             w_kv + (h * kvw + nope_) * kv_lora_, kv_lora_, context.data() + h * v_dim_,
                             heads_ * v_dim_, n, kv_lora_, v_dim_);
    return o_.forward(context);
  }

  /// x -> the rotated query [tokens, heads/tp * (nope + rope)]; keeps q_latent and q_norm in s.
  Tensor query(const Tensor& x, const std::int32_t* positions, Saved* s) const {
    Tensor q;
    if (q_lora_ > 0) {
      Tensor q_latent = q_norm_->forward(replicated_forward(*q_a_, x), s ? &s->q_norm : nullptr);
      q = q_b_->forward(q_latent);
      if (s) s->q_latent = std::move(q_latent);
    } else {
      q = q_b_->forward(x);
    }
    rotate(rope_slices(q, x.dim(0)), positions, false);
    return q;
  }

  // RoPE on the interleaved pairs of s (the backend's rope_interleaved_forward: host/ or
  // cuda/rope_interleaved), or its transpose.
  void rotate(const backend::RotarySlices& s, const std::int32_t* positions, bool transpose) const {
    if (transpose) rope_interleaved_backward(Backend{}, s, positions, inv_freq_.data(), freq_.attention_factor);
    else rope_interleaved_forward(Backend{}, s, positions, inv_freq_.data(), freq_.attention_factor);
  }

  /// x -> [tokens, kv_lora + rope] = [kv_a_layernorm(c_kv) | RoPE(k_pe)]; keeps kv_norm in s.
  Tensor project_latent(const Tensor& x, const std::int32_t* positions, Saved* s) const {
    const std::int64_t n = x.dim(0), lw = kv_lora_ + rope_;
    Tensor latent = replicated_forward(kv_a_, x);
    Tensor c_kv({n, kv_lora_});
    copy_columns(Backend{}, latent.data(), lw, 0, c_kv.data(), kv_lora_, 0, n, kv_lora_);
    const Tensor normed = kv_norm_.forward(c_kv, s ? &s->kv_norm : nullptr);
    copy_columns(Backend{}, normed.data(), kv_lora_, 0, latent.data(), lw, 0, n, kv_lora_);
    rotate({latent.data() + kv_lora_, n, 1, rope_, lw, rope_}, positions, false);
    return latent;
  }

  /// A replicated projection: x [tokens, in] -> [tokens, out] with w [out, in].
  static Tensor replicated_forward(const Parameter& w, const Tensor& x) {
    Tensor y({x.dim(0), w.value.dim(0)});
    linear_forward(Backend{}, x.data(), w.value.data(), y.data(), x.dim(0), w.value.dim(1), w.value.dim(0));
    return y;
  }
  /// Its backward: dw += dy^T x, returns dx [tokens, in].
  static Tensor replicated_backward(Parameter& w, const Tensor& x, const Tensor& dy) {
    linear_backward_weight(Backend{}, dy.data(), x.data(), w.grad.data(), x.dim(0), w.value.dim(1), w.value.dim(0));
    Tensor dx({x.dim(0), w.value.dim(1)});
    linear_backward_input(Backend{}, dy.data(), w.value.data(), dx.data(), x.dim(0), w.value.dim(1), w.value.dim(0));
    return dx;
  }

  Comm* tp_;
  std::int64_t layer_, heads_, q_lora_, kv_lora_, nope_, rope_, v_dim_;
  float scale_;
  RopeFrequencies freq_;
  SpaceArray<double> inv_freq_;                        ///< freq_.inv_freq where the ops read it
  std::optional<Parameter> q_a_;                       ///< q_a_proj [q_lora, hidden], replicated
  std::optional<RMSNorm<Policy>> q_norm_;              ///< q_a_layernorm [q_lora], replicated
  std::optional<tp::ColumnParallelLinear<Policy>> q_b_;  ///< q_b_proj (or q_proj), split by heads
  Parameter kv_a_;                                     ///< kv_a_proj_with_mqa [kv_lora + rope, hidden], replicated
  RMSNorm<Policy> kv_norm_;                            ///< kv_a_layernorm [kv_lora], replicated
  tp::ColumnParallelLinear<Policy> kv_b_;               ///< kv_b_proj, split by heads
  tp::RowParallelLinear<Policy> o_;                    ///< o_proj, split along its input
};

}  // namespace dsp::model
