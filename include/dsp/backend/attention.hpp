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
  const std::int64_t group = q_heads / kv_heads;
  const std::int64_t ldq = q_heads * head_dim, ldk = kv_heads * head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  auto p_scratch = scratch(hst, probs ? 0 : q_len * kv_len);
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t h = 0; h < q_heads; ++h) {
      const std::int64_t g = h / group;
      const float* qb = q + b * q_len * ldq + h * head_dim;
      const float* kb = k + b * kv_len * ldk + g * head_dim;
      const float* vb = v + b * kv_len * ldk + g * head_dim;
      float* p = probs ? probs + (b * q_heads + h) * q_len * kv_len : p_scratch.data();
      matmul(hst, false, true, q_len, kv_len, head_dim, scale, qb, ldq, kb, ldk, 0.0f, p, kv_len);
      if (q_key_begin)
        causal_softmax_forward(hst, p, q_len, kv_len, q_positions + b * q_len, q_key_begin + b * q_len);
      else
        causal_softmax_forward(hst, p, q_len, kv_len, q_positions + b * q_len);
      matmul(hst, false, false, q_len, head_dim, kv_len, 1.0f, p, kv_len, vb, ldk, 0.0f,
             out + b * q_len * ldq + h * head_dim, ldq);
    }
  }
}

/// Gradients of attention_forward from its inputs q, k, v, the saved probs and
/// dout [batch, q_len, q_heads, head_dim]:
/// dP = dO V^T, dS = P * (dP - rowsum(P * dP)), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO,
/// where dK and dV of a kv head sum over the q heads of its group. Overwrites
/// dq [batch, q_len, q_heads, head_dim], dk and dv [batch, kv_len, kv_heads, head_dim].
template <class Backend>
void attention_backward(Backend hst, const float* q, const float* k, const float* v, const float* probs,
                        const float* dout, std::int64_t batch, std::int64_t q_len, std::int64_t kv_len,
                        std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim, float* dq, float* dk,
                        float* dv) {
  detail::check_attention_shape(q_heads, kv_heads, head_dim);
  const std::int64_t group = q_heads / kv_heads;
  const std::int64_t ldq = q_heads * head_dim, ldk = kv_heads * head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  auto ds = scratch(hst, q_len * kv_len);
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t h = 0; h < q_heads; ++h) {
      const std::int64_t g = h / group;
      const float beta = h % group == 0 ? 0.0f : 1.0f;  // first q head of a group overwrites dk/dv
      const std::int64_t qoff = b * q_len * ldq + h * head_dim, koff = b * kv_len * ldk + g * head_dim;
      const float* p = probs + (b * q_heads + h) * q_len * kv_len;
      matmul(hst, false, true, q_len, kv_len, head_dim, 1.0f, dout + qoff, ldq, v + koff, ldk, 0.0f, ds.data(),
             kv_len);
      softmax_backward(hst, p, ds.data(), q_len, kv_len, ds.data());
      matmul(hst, false, false, q_len, head_dim, kv_len, scale, ds.data(), kv_len, k + koff, ldk, 0.0f, dq + qoff,
             ldq);
      matmul(hst, true, false, kv_len, head_dim, q_len, scale, ds.data(), kv_len, q + qoff, ldq, beta, dk + koff,
             ldk);
      matmul(hst, true, false, kv_len, head_dim, q_len, 1.0f, p, kv_len, dout + qoff, ldq, beta, dv + koff, ldk);
    }
  }
}

}  // namespace dsp::backend
