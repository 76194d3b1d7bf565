#pragma once
// Causal scaled-dot-product attention (Vaswani et al. 2017) with grouped-query attention
// (GQA, Ainslie et al. 2023) and a KV cache: per (batch, q head) two GEMMs around a masked
// row softmax, S = scale Q K^T, P = softmax(S), O = P V. Written once for every backend from
// its ops (matmul: gemm in the thread's matmul precision, backend/matmul_precision.hpp;
// causal_softmax_forward, softmax_backward, scratch), found by
// argument-dependent lookup on the backend tag: the Host ops come with this header, the CUDA
// ones with backend/cuda/attention.cuh.
//
// Shapes: q, out [batch, q_len, q_heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim];
// probs [batch, q_heads, q_len, kv_len]; q_positions [batch * q_len].
// Query head h reads kv head h / (q_heads / kv_heads). Query (b, i) attends keys
// j <= q_positions[b * q_len + i] (and j < kv_len); scale = 1 / sqrt(head_dim).
// Packed documents (Megatron's --reset-attention-mask): with q_key_begin [batch * q_len], query
// (b, i) sees only keys q_key_begin[b * q_len + i] <= j <= q_positions[b * q_len + i], the keys
// of its own document (q_key_begin: its document's first row; nullptr: 0, plain causal). The
// backward needs no mask: masked probabilities are exactly 0, so are their gradients.
#include <cmath>
#include <cstdint>

#include "dsp/backend/matmul_precision.hpp"
#include "dsp/backend/host/softmax.hpp"
#include "dsp/core/error.hpp"

namespace dsp::backend {

namespace detail {
inline void check_attention_shape(std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim) {
  DSP_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "attention: q_heads=", q_heads,
            " is not a multiple of kv_heads=", kv_heads);
  DSP_CHECK(head_dim > 0, "attention: head_dim must be positive, got ", head_dim);
}
}  // namespace detail

/// The widths, strides and scale of one attention call whose query/key width differs from
/// its value width (Multi-head Latent Attention: qk = nope + rope, v = v_head_dim; its
/// absorbed decode form: qk = kv_lora_rank + rope, v = kv_lora_rank, the values being the
/// first v_dim columns of the key rows, ldv = ldk).
/// Shapes: q [batch, q_len, q_heads, qk_dim]; out [batch, q_len, q_heads, v_dim];
/// k rows [batch, kv_len] of ldk values, kv head g at columns g * qk_dim; v rows of ldv values,
/// kv head g at columns g * v_dim.
struct AttentionDims {
  std::int64_t batch = 1, q_len = 1, kv_len = 1, q_heads = 1, kv_heads = 1, qk_dim = 1, v_dim = 1;
  float scale = 1.0f;     ///< multiplies q k^T before the softmax
  std::int64_t ldk = 0;   ///< key row stride; 0: kv_heads * qk_dim
  std::int64_t ldv = 0;   ///< value row stride; 0: kv_heads * v_dim
  std::int64_t key_stride() const { return ldk > 0 ? ldk : kv_heads * qk_dim; }
  std::int64_t value_stride() const { return ldv > 0 ? ldv : kv_heads * v_dim; }
};

/// out = softmax(scale q k^T, causal mask) v with the widths and strides of `d` (mask as
/// above: query (b, i) sees keys q_key_begin[b * q_len + i] (or 0) <= j <= q_positions[b * q_len + i]).
/// Overwrites out, and probs [batch, q_heads, q_len, kv_len] unless nullptr (then a
/// [q_len, kv_len] scratch). Throws Error when q_heads is not a multiple of kv_heads or a
/// width is < 1.
template <class Backend>
void scaled_attention_forward(Backend hst, const float* q, const float* k, const float* v,
                              const std::int32_t* q_positions, const AttentionDims& d, float* out, float* probs,
                              const std::int32_t* q_key_begin = nullptr) {
  detail::check_attention_shape(d.q_heads, d.kv_heads, d.qk_dim);
  detail::check_attention_shape(d.q_heads, d.kv_heads, d.v_dim);
  const std::int64_t group = d.q_heads / d.kv_heads, q_len = d.q_len, kv_len = d.kv_len;
  const std::int64_t ldq = d.q_heads * d.qk_dim, ldo = d.q_heads * d.v_dim, ldk = d.key_stride(),
                     ldv = d.value_stride();
  auto p_scratch = scratch(hst, probs ? 0 : q_len * kv_len);
  for (std::int64_t b = 0; b < d.batch; ++b) {
    for (std::int64_t h = 0; h < d.q_heads; ++h) {
      const std::int64_t g = h / group;
      const float* qb = q + b * q_len * ldq + h * d.qk_dim;
      const float* kb = k + b * kv_len * ldk + g * d.qk_dim;
      const float* vb = v + b * kv_len * ldv + g * d.v_dim;
      float* p = probs ? probs + (b * d.q_heads + h) * q_len * kv_len : p_scratch.data();
      matmul(hst, false, true, q_len, kv_len, d.qk_dim, d.scale, qb, ldq, kb, ldk, 0.0f, p, kv_len);
      if (q_key_begin)
        causal_softmax_forward(hst, p, q_len, kv_len, q_positions + b * q_len, q_key_begin + b * q_len);
      else
        causal_softmax_forward(hst, p, q_len, kv_len, q_positions + b * q_len);
      matmul(hst, false, false, q_len, d.v_dim, kv_len, 1.0f, p, kv_len, vb, ldv, 0.0f,
             out + b * q_len * ldo + h * d.v_dim, ldo);
    }
  }
}

/// Gradients of scaled_attention_forward from its inputs q, k, v, the saved probs and
/// dout [batch, q_len, q_heads, v_dim]:
/// dP = dO V^T, dS = P * (dP - rowsum(P * dP)), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO,
/// where dK and dV of a kv head sum over the q heads of its group. Overwrites dq (shaped like
/// q), dk (shaped and strided like k) and dv (like v); dk and dv must not share memory.
template <class Backend>
void scaled_attention_backward(Backend hst, const float* q, const float* k, const float* v, const float* probs,
                               const float* dout, const AttentionDims& d, float* dq, float* dk, float* dv) {
  detail::check_attention_shape(d.q_heads, d.kv_heads, d.qk_dim);
  detail::check_attention_shape(d.q_heads, d.kv_heads, d.v_dim);
  const std::int64_t group = d.q_heads / d.kv_heads, q_len = d.q_len, kv_len = d.kv_len;
  const std::int64_t ldq = d.q_heads * d.qk_dim, ldo = d.q_heads * d.v_dim, ldk = d.key_stride(),
                     ldv = d.value_stride();
  auto ds = scratch(hst, q_len * kv_len);
  for (std::int64_t b = 0; b < d.batch; ++b) {
    for (std::int64_t h = 0; h < d.q_heads; ++h) {
      const std::int64_t g = h / group;
      const float beta = h % group == 0 ? 0.0f : 1.0f;  // first q head of a group overwrites dk/dv
      const std::int64_t qoff = b * q_len * ldq + h * d.qk_dim, ooff = b * q_len * ldo + h * d.v_dim;
      const std::int64_t koff = b * kv_len * ldk + g * d.qk_dim, voff = b * kv_len * ldv + g * d.v_dim;
      const float* p = probs + (b * d.q_heads + h) * q_len * kv_len;
      matmul(hst, false, true, q_len, kv_len, d.v_dim, 1.0f, dout + ooff, ldo, v + voff, ldv, 0.0f, ds.data(),
             kv_len);
      softmax_backward(hst, p, ds.data(), q_len, kv_len, ds.data());
      matmul(hst, false, false, q_len, d.qk_dim, kv_len, d.scale, ds.data(), kv_len, k + koff, ldk, 0.0f,
             dq + qoff, ldq);
      matmul(hst, true, false, kv_len, d.qk_dim, q_len, d.scale, ds.data(), kv_len, q + qoff, ldq, beta,
             dk + koff, ldk);
      matmul(hst, true, false, kv_len, d.v_dim, q_len, 1.0f, p, kv_len, dout + ooff, ldo, beta, dv + voff, ldv);
    }
  }
}

/// out [batch, q_len, q_heads, head_dim] = softmax(q k^T / sqrt(head_dim), causal mask) v
/// (shapes and mask above). Overwrites out, and probs [batch, q_heads, q_len, kv_len] with the
/// softmax probabilities for the backward (masked entries exactly 0; a query with no visible
/// key gets a zero row and a zero output). probs may be nullptr (inference): a
/// [q_len, kv_len] scratch buffer is used instead. q_key_begin [batch * q_len] or nullptr: the
/// document mask above (the backend's causal_softmax_forward overload with key_begin; Host and
/// Cuda have it). Throws Error when q_heads is not a multiple of kv_heads or head_dim < 1.
template <class Backend>
void attention_forward(Backend hst, const float* q, const float* k, const float* v, const std::int32_t* q_positions,
                       std::int64_t batch, std::int64_t q_len, std::int64_t kv_len, std::int64_t q_heads,
                       std::int64_t kv_heads, std::int64_t head_dim, float* out, float* probs,
                       const std::int32_t* q_key_begin = nullptr) {
  detail::check_attention_shape(q_heads, kv_heads, head_dim);
  const AttentionDims d{batch, q_len, kv_len, q_heads, kv_heads, head_dim, head_dim,
                        1.0f / std::sqrt(static_cast<float>(head_dim))};
  scaled_attention_forward(hst, q, k, v, q_positions, d, out, probs, q_key_begin);
}

/// Gradients of attention_forward (scaled_attention_backward with qk_dim = v_dim = head_dim,
/// scale 1 / sqrt(head_dim)). Overwrites dq [batch, q_len, q_heads, head_dim], dk and dv
/// [batch, kv_len, kv_heads, head_dim].
template <class Backend>
void attention_backward(Backend hst, const float* q, const float* k, const float* v, const float* probs,
                        const float* dout, std::int64_t batch, std::int64_t q_len, std::int64_t kv_len,
                        std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim, float* dq, float* dk,
                        float* dv) {
  detail::check_attention_shape(q_heads, kv_heads, head_dim);
  const AttentionDims d{batch, q_len, kv_len, q_heads, kv_heads, head_dim, head_dim,
                        1.0f / std::sqrt(static_cast<float>(head_dim))};
  scaled_attention_backward(hst, q, k, v, probs, dout, d, dq, dk, dv);
}

}  // namespace dsp::backend
