#pragma once
// Memory-efficient causal attention on the host: the contract of FlashAttention (Dao et al.
// 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness";
// FlashAttention-2, Dao 2023, algorithms 1 and 2). The forward keeps only each query row's
// log-sum-exp lse = log sum_j exp(s_j) of its scaled scores instead of the probabilities
// [batch, q_heads, q_len, kv_len]; the backward recomputes P = exp(S - lse) from q, k and lse.
// Saved activations drop from O(seq^2) to O(seq) per head, for one more Q K^T GEMM in backward.
//
// The host works one tile of kQueryTile query rows at a time against the keys the tile can see
// (up to its last visible key, so the causal upper triangle past that is never computed), with
// BLAS GEMMs on the tile; scratch is one [min(kQueryTile, q_len), kv_len] buffer in the
// forward, two in the backward. The CUDA op (backend/cuda/flash_attention.cuh) tiles the keys
// as well.
//
// Shapes and mask as backend/attention.hpp: q, out, dout, dq [batch, q_len, q_heads, head_dim];
// k, v, dk, dv [batch, kv_len, kv_heads, head_dim]; lse [batch, q_heads, q_len] fp32;
// q_positions [batch * q_len]. Query head h reads kv head h / (q_heads / kv_heads); query
// (b, i) sees keys j <= q_positions[b * q_len + i] and j < kv_len; scale = 1 / sqrt(head_dim).
// With q_key_begin [batch * q_len] (packed documents, Megatron's --reset-attention-mask) also
// only keys j >= q_key_begin[b * q_len + i], its document's; a tile then computes only the key
// range [min key_begin, max visible key] of its rows, so packed documents cost less.
//
// The tile GEMMs are matmul() calls (backend/matmul_precision.hpp): inside a bf16 or fp16
// scope their inputs are rounded (Q, K, V, dO, the normalised probabilities P and dS), as the
// tensor-core kernels of the CUDA op round them; the softmax and dS = P * (dP - D) stay fp32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "dsp/backend/attention.hpp"
#include "dsp/backend/host/elementwise.hpp"
#include "dsp/backend/host/gemm.hpp"
#include "dsp/backend/host/host.hpp"
#include "dsp/backend/matmul_precision.hpp"

namespace dsp::backend {

namespace detail {

/// Query rows per host tile: [64, kv_len] fp32 scores stay in cache for kv_len up to a few K.
inline constexpr std::int64_t kQueryTile = 64;

/// Keys query row i of positions sees: clamp(positions[i] + 1, 0, kv_len).
inline std::int64_t visible_keys(const std::int32_t* positions, std::int64_t i, std::int64_t kv_len) {
  return std::clamp<std::int64_t>(positions[i] + 1, 0, kv_len);
}

/// The most keys any row of [first, first + rows) sees: the tile's key range.
inline std::int64_t tile_visible_keys(const std::int32_t* positions, std::int64_t first, std::int64_t rows,
                                      std::int64_t kv_len) {
  std::int64_t most = 0;
  for (std::int64_t i = first; i < first + rows; ++i) most = std::max(most, visible_keys(positions, i, kv_len));
  return most;
}

/// The first key query row i sees: clamp(key_begin[i], 0, its visible keys); 0 without key_begin.
inline std::int64_t first_key(const std::int32_t* positions, const std::int32_t* key_begin, std::int64_t i,
                              std::int64_t kv_len) {
  return key_begin ? std::clamp<std::int64_t>(key_begin[i], 0, visible_keys(positions, i, kv_len)) : 0;
}

/// The first key any row of [first, first + rows) sees (0 without key_begin): the tile's keys
/// are [tile_first_key, tile_visible_keys).
inline std::int64_t tile_first_key(const std::int32_t* positions, const std::int32_t* key_begin, std::int64_t first,
                                   std::int64_t rows, std::int64_t kv_len) {
  if (!key_begin) return 0;
  std::int64_t least = kv_len;
  for (std::int64_t i = first; i < first + rows; ++i) least = std::min(least, first_key(positions, key_begin, i, kv_len));
  return least;
}

/// Scores s [cols] of one row -> its softmax over the columns [begin, visible) in place
/// (max-subtracted, summed in fp64), exactly 0 outside them; returns the row's log-sum-exp
/// mx + log(sum), -inf for a row that sees no key (all zeros).
inline float row_softmax(float* s, std::int64_t cols, std::int64_t visible, std::int64_t begin = 0) {
  std::fill(s, s + begin, 0.0f);
  std::fill(s + visible, s + cols, 0.0f);
  if (visible <= begin) return -std::numeric_limits<float>::infinity();
  const float mx = *std::max_element(s + begin, s + visible);
  double sum = 0.0;
  for (std::int64_t j = begin; j < visible; ++j) sum += s[j] = std::exp(s[j] - mx);
  const float inv = static_cast<float>(1.0 / sum);
  for (std::int64_t j = begin; j < visible; ++j) s[j] *= inv;
  return mx + static_cast<float>(std::log(sum));
}

/// The backward's recomputation: scores s [cols] of one row -> probabilities exp(s - lse) in
/// place over the columns [begin, visible), exactly 0 outside them.
inline void row_probabilities(float* s, std::int64_t cols, std::int64_t visible, float lse, std::int64_t begin = 0) {
  std::fill(s, s + begin, 0.0f);
  for (std::int64_t j = begin; j < visible; ++j) s[j] = std::exp(s[j] - lse);
  std::fill(s + visible, s + cols, 0.0f);
}

}  // namespace detail

/// out [batch, q_len, q_heads, head_dim] = softmax(q k^T / sqrt(head_dim), causal mask) v, as
/// attention_forward, keeping lse [batch, q_heads, q_len] (fp32; -inf for a query that sees no
/// key, whose output row is 0) instead of the probabilities. lse may be nullptr (inference).
/// q_key_begin [batch * q_len] or nullptr: the document mask (header comment).
/// Throws Error when q_heads is not a multiple of kv_heads or head_dim < 1.
inline void flash_attention_forward(Host h, const float* q, const float* k, const float* v,
                                    const std::int32_t* q_positions, std::int64_t batch, std::int64_t q_len,
                                    std::int64_t kv_len, std::int64_t q_heads, std::int64_t kv_heads,
                                    std::int64_t head_dim, float* out, float* lse,
                                    const std::int32_t* q_key_begin = nullptr) {
  detail::check_attention_shape(q_heads, kv_heads, head_dim);
  const std::int64_t group = q_heads / kv_heads, ldq = q_heads * head_dim, ldk = kv_heads * head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  auto s = scratch(h, std::min(detail::kQueryTile, q_len) * kv_len);
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int32_t* pos = q_positions + b * q_len;
    const std::int32_t* kbeg = q_key_begin ? q_key_begin + b * q_len : nullptr;
    for (std::int64_t hd = 0; hd < q_heads; ++hd) {
      const std::int64_t g = hd / group;
      for (std::int64_t i0 = 0; i0 < q_len; i0 += detail::kQueryTile) {
        const std::int64_t rows = std::min(detail::kQueryTile, q_len - i0);
        const std::int64_t k0 = detail::tile_first_key(pos, kbeg, i0, rows, kv_len);
        const std::int64_t keys = std::max<std::int64_t>(detail::tile_visible_keys(pos, i0, rows, kv_len) - k0, 0);
        const float* kb = k + (b * kv_len + k0) * ldk + g * head_dim;  // the tile's first key
        const float* vb = v + (b * kv_len + k0) * ldk + g * head_dim;
        const float* qt = q + (b * q_len + i0) * ldq + hd * head_dim;
        float* ot = out + (b * q_len + i0) * ldq + hd * head_dim;
        matmul(h, false, true, rows, keys, head_dim, scale, qt, ldq, kb, ldk, 0.0f, s.data(), keys);
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t visible = detail::visible_keys(pos, i0 + r, kv_len) - k0;
          const std::int64_t begin = detail::first_key(pos, kbeg, i0 + r, kv_len) - k0;
          const float l = detail::row_softmax(s.data() + r * keys, keys, std::max<std::int64_t>(visible, 0),
                                              std::max<std::int64_t>(begin, 0));
          if (lse) lse[(b * q_heads + hd) * q_len + i0 + r] = l;
        }
        if (keys == 0) {
          for (std::int64_t r = 0; r < rows; ++r) fill(h, head_dim, 0.0f, ot + r * ldq);
          continue;
        }
        matmul(h, false, false, rows, head_dim, keys, 1.0f, s.data(), keys, vb, ldk, 0.0f, ot, ldq);
      }
    }
  }
}

/// Gradients of flash_attention_forward from q, k, v, its out and lse, and dout (FlashAttention-2
/// algorithm 2): P = exp(scale Q K^T - lse) recomputed per tile, dP = dO V^T,
/// D = rowsum(dO * O), dS = P * (dP - D), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO, dK
/// and dV of a kv head summed over the q heads of its group. Overwrites
/// dq [batch, q_len, q_heads, head_dim], dk and dv [batch, kv_len, kv_heads, head_dim].
/// q_key_begin: the forward's document mask (nullptr: none). Throws Error as flash_attention_forward.
inline void flash_attention_backward(Host h, const float* q, const float* k, const float* v, const float* out,
                                     const float* dout, const float* lse, const std::int32_t* q_positions,
                                     std::int64_t batch, std::int64_t q_len, std::int64_t kv_len,
                                     std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim, float* dq,
                                     float* dk, float* dv, const std::int32_t* q_key_begin = nullptr) {
  detail::check_attention_shape(q_heads, kv_heads, head_dim);
  const std::int64_t group = q_heads / kv_heads, ldq = q_heads * head_dim, ldk = kv_heads * head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  fill(h, batch * kv_len * ldk, 0.0f, dk);
  fill(h, batch * kv_len * ldk, 0.0f, dv);
  auto p = scratch(h, std::min(detail::kQueryTile, q_len) * kv_len);
  auto ds = scratch(h, std::min(detail::kQueryTile, q_len) * kv_len);
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int32_t* pos = q_positions + b * q_len;
    const std::int32_t* kbeg = q_key_begin ? q_key_begin + b * q_len : nullptr;
    for (std::int64_t hd = 0; hd < q_heads; ++hd) {
      const std::int64_t g = hd / group;
      for (std::int64_t i0 = 0; i0 < q_len; i0 += detail::kQueryTile) {
        const std::int64_t rows = std::min(detail::kQueryTile, q_len - i0);
        const std::int64_t k0 = detail::tile_first_key(pos, kbeg, i0, rows, kv_len);
        const std::int64_t keys = std::max<std::int64_t>(detail::tile_visible_keys(pos, i0, rows, kv_len) - k0, 0);
        const std::int64_t koff = (b * kv_len + k0) * ldk + g * head_dim;  // the tile's first key
        const std::int64_t qoff = (b * q_len + i0) * ldq + hd * head_dim;
        if (keys == 0) {
          for (std::int64_t r = 0; r < rows; ++r) fill(h, head_dim, 0.0f, dq + qoff + r * ldq);
          continue;
        }
        matmul(h, false, true, rows, keys, head_dim, scale, q + qoff, ldq, k + koff, ldk, 0.0f, p.data(), keys);
        matmul(h, false, true, rows, keys, head_dim, 1.0f, dout + qoff, ldq, v + koff, ldk, 0.0f, ds.data(), keys);
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t visible = std::max<std::int64_t>(detail::visible_keys(pos, i0 + r, kv_len) - k0, 0);
          const std::int64_t begin = std::max<std::int64_t>(detail::first_key(pos, kbeg, i0 + r, kv_len) - k0, 0);
          float* pr = p.data() + r * keys;
          detail::row_probabilities(pr, keys, visible, lse[(b * q_heads + hd) * q_len + i0 + r], begin);
          double d = 0.0;  // D = dO . O of this row
          for (std::int64_t c = 0; c < head_dim; ++c)
            d += static_cast<double>(dout[qoff + r * ldq + c]) * out[qoff + r * ldq + c];
          float* dsr = ds.data() + r * keys;
          for (std::int64_t j = 0; j < keys; ++j) dsr[j] = pr[j] * (dsr[j] - static_cast<float>(d));
        }
        matmul(h, false, false, rows, head_dim, keys, scale, ds.data(), keys, k + koff, ldk, 0.0f, dq + qoff, ldq);
        matmul(h, true, false, keys, head_dim, rows, scale, ds.data(), keys, q + qoff, ldq, 1.0f, dk + koff, ldk);
        matmul(h, true, false, keys, head_dim, rows, 1.0f, p.data(), keys, dout + qoff, ldq, 1.0f, dv + koff, ldk);
      }
    }
  }
}

}  // namespace dsp::backend
