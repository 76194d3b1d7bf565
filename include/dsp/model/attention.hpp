#pragma once
// Causal self-attention with grouped-query attention (GQA, Ainslie et al. 2023) and RoPE,
// tensor-parallel as in Megatron-LM: the fused [q; k; v] projection is column-parallel
// (query heads split, key/value heads split per KV group or replicated when kv heads < TP),
// the output projection row-parallel.
//   x [tokens, hidden] -> qkv [tokens, (h_local + 2 kv_local) * d] -> q, k, v
//   -> rope(q), rope(k) -> softmax(q k^T / sqrt(d) + causal) v [tokens, h_local * d]
//   (causal within each packed document when ctx.key_begin is set: --reset-attention-mask)
//   -> o_proj -> [tokens, hidden] (all-reduced)
#include <cmath>
#include <span>
#include <string>

#include "dsp/backend/attention.hpp"
#include "dsp/backend/host/copy_columns.hpp"
#include "dsp/backend/host/elementwise.hpp"
#include "dsp/backend/host/flash_attention.hpp"
#include "dsp/backend/host/paged_attention.hpp"
#include "dsp/backend/host/rope.hpp"
#include "dsp/model/config.hpp"
#include "dsp/model/forward_context.hpp"
#include "dsp/model/parts.hpp"
#include "dsp/tp/column_parallel_linear.hpp"
#include "dsp/tp/row_parallel_linear.hpp"

namespace dsp::model {

template <class Policy>
class Attention {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;
  struct Saved {
    Tensor x, q, k, v, probs, context;
    Tensor lse;  ///< --use-flash-attn: [batch, heads/tp, seq], and no probs
    /// The activations (lse is an fp32 statistic).
    std::vector<Tensor*> tensors() { return {&x, &q, &k, &v, &probs, &context}; }
  };

  /// Builds this TP rank's shards of `spec` (GqaAttentionSpec::describe); layer: global layer
  /// index (KV cache slot).
  Attention(Comm& tp, const ModelConfig& c, const GqaAttentionSpec& spec, std::int64_t layer, std::uint64_t seed)
      : layer_(layer),
        tp_size_(tp.size()),
        d_(c.head_dim()),
        heads_(c.num_attention_heads / tp.size()),
        kv_heads_(c.num_query_groups >= tp.size() ? c.num_query_groups / tp.size() : 1),
        theta_(c.rope_theta),
        flash_(c.use_flash_attn),
        qkv_(tp, spec.qkv.tensor, spec.qkv.init, seed),
        o_(tp, spec.o.tensor, spec.o.init, seed) {}

  /// x [tokens, hidden] -> [tokens, hidden]. With ctx.paged (serving), this call's keys and
  /// values are written to their cache slots and each token attends its sequence's cached
  /// keys up to its position (backend/host/paged_attention.hpp). Training on packed documents
  /// (ctx.key_begin / ctx.mask_positions, model/document_mask.hpp): RoPE at ctx.positions, each
  /// token attending its own document's keys up to itself, in both attention paths; a paged
  /// (serving) call with them throws Error.
  /// saved keeps what backward needs: q, k, v, the context and (unless selective
  /// recomputation) the softmax probabilities [batch, heads/tp, seq, seq], each rounded to
  /// ctx.activations (the softmax itself computes in fp32); with use_flash_attn the fp32
  /// log-sum-exp [batch, heads/tp, seq] instead of the probabilities, whatever the recomputation.
  Tensor forward(const ForwardContext& ctx, const Tensor& x, Saved* saved) {
    const std::int64_t n = ctx.tokens(), qw = heads_ * d_, kw = kv_heads_ * d_;
    const Tensor qkv = qkv_.forward(x);
    const SpaceArray<std::int32_t> positions(ctx.positions);  // where the tensors are
    const DocumentMask mask(ctx, positions);
    Tensor q({n, qw}), k({n, kw}), v({n, kw});
    copy_columns(Backend{}, qkv.data(), qw + 2 * kw, 0, q.data(), qw, 0, n, qw);
    copy_columns(Backend{}, qkv.data(), qw + 2 * kw, qw, k.data(), kw, 0, n, kw);
    copy_columns(Backend{}, qkv.data(), qw + 2 * kw, qw + kw, v.data(), kw, 0, n, kw);
    rope_forward(Backend{}, q.data(), positions.data(), n, heads_, d_, theta_, q.data());
    rope_forward(Backend{}, k.data(), positions.data(), n, kv_heads_, d_, theta_, k.data());
    for (Tensor* t : {&q, &k, &v}) round_activations(Backend{}, ctx.activations, *t);

    Tensor context({n, qw});
    Tensor probs, lse;
    if (ctx.paged) {  // serving: this call's keys/values into the cache, attention over it
      DSP_CHECK(!ctx.masks_documents(), "attention: document masks (key_begin, mask_positions) are for training; "
                                        "a paged serving batch keeps each sequence apart already");
      const backend::PagedKvLayer kv = ctx.paged->layer(layer_);
      paged_kv_write(Backend{}, kv, k.data(), v.data(), n, kv_heads_, d_);
      paged_attention_forward(Backend{}, kv, q.data(), positions.data(), n, heads_, kv_heads_, d_, context.data());
    } else if (flash_) {
      if (saved) lse = Tensor({ctx.batch, heads_, ctx.seq});
      flash_attention_forward(Backend{}, q.data(), k.data(), v.data(), mask.last, ctx.batch, ctx.seq, ctx.seq,
                              heads_, kv_heads_, d_, context.data(), saved ? lse.data() : nullptr, mask.begin);
    } else {  // selective recomputation: the probabilities are recomputed in backward
      if (saved && !ctx.recompute.selective()) probs = Tensor({ctx.batch, heads_, ctx.seq, ctx.seq});
      attention_forward(Backend{}, q.data(), k.data(), v.data(), mask.last, ctx.batch, ctx.seq, ctx.seq, heads_,
                        kv_heads_, d_, context.data(), probs.numel() > 0 ? probs.data() : nullptr, mask.begin);
      round_activations(Backend{}, ctx.activations, probs);
    }
    round_activations(Backend{}, ctx.activations, context);
    Tensor y = o_.forward(context);
    if (saved)
      *saved = {x, std::move(q), std::move(k), std::move(v), std::move(probs), std::move(context), std::move(lse)};
    return y;
  }

  /// dy [tokens, hidden] -> dx [tokens, hidden] (summed over TP); accumulates weight grads.
  Tensor backward(const ForwardContext& ctx, const Tensor& dy, const Saved& s) {
    const std::int64_t n = ctx.tokens(), qw = heads_ * d_, kw = kv_heads_ * d_;
    const Tensor dcontext = o_.backward(s.context, dy);
    const SpaceArray<std::int32_t> positions(ctx.positions);
    const DocumentMask mask(ctx, positions);
    Tensor dq({n, qw}), dk({n, kw}), dv({n, kw});
    if (flash_) {
      flash_attention_backward(Backend{}, s.q.data(), s.k.data(), s.v.data(), s.context.data(), dcontext.data(),
                               s.lse.data(), mask.last, ctx.batch, ctx.seq, ctx.seq, heads_, kv_heads_, d_,
                               dq.data(), dk.data(), dv.data(), mask.begin);
    } else {
      Tensor recomputed;  // the softmax probabilities when the forward did not keep them
      if (s.probs.numel() == 0) {
        recomputed = Tensor({ctx.batch, heads_, ctx.seq, ctx.seq});
        Tensor context({n, qw});
        attention_forward(Backend{}, s.q.data(), s.k.data(), s.v.data(), mask.last, ctx.batch, ctx.seq, ctx.seq,
                          heads_, kv_heads_, d_, context.data(), recomputed.data(), mask.begin);
        round_activations(Backend{}, ctx.activations, recomputed);  // as the forward would have kept them
      }
      const Tensor& probs = s.probs.numel() > 0 ? s.probs : recomputed;
      attention_backward(Backend{}, s.q.data(), s.k.data(), s.v.data(), probs.data(), dcontext.data(), ctx.batch,
                         ctx.seq, ctx.seq, heads_, kv_heads_, d_, dq.data(), dk.data(), dv.data());
    }
    rope_backward(Backend{}, dq.data(), positions.data(), n, heads_, d_, theta_, dq.data());
    rope_backward(Backend{}, dk.data(), positions.data(), n, kv_heads_, d_, theta_, dk.data());
    Tensor dqkv({n, qw + 2 * kw});
    copy_columns(Backend{}, dq.data(), qw, 0, dqkv.data(), qw + 2 * kw, 0, n, qw);
    copy_columns(Backend{}, dk.data(), kw, 0, dqkv.data(), qw + 2 * kw, qw, n, kw);
    copy_columns(Backend{}, dv.data(), kw, 0, dqkv.data(), qw + 2 * kw, qw + kw, n, kw);
    return qkv_.backward(s.x, dqkv);
  }

  std::vector<Parameter*> parameters() { return {&qkv_.weight(), &o_.weight()}; }

  /// When kv heads < TP, each K/V head is replicated on TP / kv_heads ranks and each replica
  /// holds only the gradient from its own query heads: the K/V rows of the qkv gradient
  /// [2 kv_local * d, hidden], to be summed over the replicas once per step. Empty otherwise.
  std::span<float> replicated_kv_grad() {
    Parameter& w = qkv_.weight();
    if (!w.spec.has_partial_replicas(tp_size_)) return {};
    const std::int64_t offset = heads_ * d_ * w.value.dim(1);
    return {w.grad.data() + offset, static_cast<std::size_t>(w.grad.numel() - offset)};
  }
  /// Values a token's keys and values take in this rank's paged KV cache of this layer:
  /// 2 x kv_heads_local x head_dim (the ledger's formula, plan/ledger.hpp).
  std::int64_t kv_values_per_token() const { return 2 * kv_heads_ * d_; }


 private:
  // The attention mask of ctx where the tensors are: last = mask_positions (or the positions
  // themselves), begin = key_begin (or nullptr: plain causal).
  struct DocumentMask {
    SpaceArray<std::int32_t> begin_array, last_array;
    const std::int32_t* begin = nullptr;
    const std::int32_t* last = nullptr;
    DocumentMask(const ForwardContext& ctx, const SpaceArray<std::int32_t>& positions) {
      const auto n = static_cast<std::size_t>(ctx.tokens());
      DSP_CHECK(ctx.key_begin.empty() || ctx.key_begin.size() == n, "attention: key_begin holds ",
                ctx.key_begin.size(), " entries for ", n, " tokens");
      DSP_CHECK(ctx.mask_positions.empty() || ctx.mask_positions.size() == n, "attention: mask_positions holds ",
                ctx.mask_positions.size(), " entries for ", n, " tokens");
      if (!ctx.key_begin.empty()) {
        begin_array = SpaceArray<std::int32_t>(ctx.key_begin);
        begin = begin_array.data();
      }
      if (!ctx.mask_positions.empty()) last_array = SpaceArray<std::int32_t>(ctx.mask_positions);
      last = ctx.mask_positions.empty() ? positions.data() : last_array.data();
    }
  };

  std::int64_t layer_;
  int tp_size_;
  std::int64_t d_, heads_, kv_heads_;
  float theta_;
  bool flash_;
  tp::ColumnParallelLinear<Policy> qkv_;
  tp::RowParallelLinear<Policy> o_;
};

}  // namespace dsp::model
