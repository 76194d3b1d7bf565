#pragma once
// Attention over a paged KV cache on the host (backend/paged_kv.hpp has the layout): a ragged
// batch of tokens, each of its own sequence and position (prefill chunks and decode tokens of
// different sequences in one call, no padding), each query reading its sequence's keys
// 0..position through the block table. Two row layouts: GQA's keys and values
// (paged_attention_forward), and MLA's latent, one head shared by every query head whose key is
// the whole row and whose value its first kv_lora_rank values (paged_latent_attention_forward).
//
// Batch invariance: a query's output is computed by the same operations whatever else is in
// the call and however its sequence's prompt was chunked: scores q . k_j in 8 fixed lanes over
// head_dim summed by one tree, then in increasing j the maximum, the exponentials and their
// sum, and sum_j e_j v_j, divided by the sum at the end. So a token's attention output is the
// same bitwise in a decode batch of 64, alone, in a prefill chunk of 7 or of 64.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "dsp/backend/host/parallel_for.hpp"
#include "dsp/backend/paged_kv.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/error.hpp"

namespace dsp::backend {

namespace detail {

inline float kv_widen(float v) { return v; }
inline float kv_widen(bf16 v) { return bf16::to_float(v.bits); }
inline float kv_widen(fp16 v) { return fp16::to_float(v.bits); }
template <class T>
T kv_narrow(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return T(v);
}

// q . k over head_dim in 8 lanes (lane l takes elements l, l + 8, ...), summed by a fixed tree.
inline float paged_dot(const float* q, const float* k, std::int64_t d) {
  float acc[8] = {};
  std::int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] = acc[l] + q[i + l] * k[i + l];
  for (int l = 0; i + l < d; ++l) acc[l] = acc[l] + q[i + l] * k[i + l];
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// dst[i] = widen(src[i]) for i < d. Loops of a fixed 8 (and a remainder) are what gcc -O2
// turns into vector code; each element is converted on its own, so the chunking changes no bit.
template <class T>
void kv_widen_row(const T* __restrict src, float* __restrict dst, std::int64_t d) {
  std::int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    for (int l = 0; l < 8; ++l) dst[i + l] = kv_widen(src[i + l]);
  for (; i < d; ++i) dst[i] = kv_widen(src[i]);
}

// acc[i] += e * v[i] for i < d (each element on its own, as kv_widen_row).
inline void kv_accumulate_row(float e, const float* __restrict v, float* __restrict acc, std::int64_t d) {
  std::int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    for (int l = 0; l < 8; ++l) acc[i + l] += e * v[i + l];
  for (; i < d; ++i) acc[i] += e * v[i];
}

// Row j of sequence table `table` in a pool of `row`-value token rows.
template <class T>
const T* kv_row(const T* pool, const std::int32_t* table, std::int64_t block_size, std::int64_t row, std::int64_t j) {
  return pool + (static_cast<std::int64_t>(table[j / block_size]) * block_size + j % block_size) * row;
}

template <class T>
void paged_attention_token(const PagedKvLayer& kv, const PagedRowLayout& l, const float* q, std::int32_t position,
                           std::int64_t t, std::int64_t q_heads, float* out, std::vector<float>& scores,
                           std::vector<float>& key, std::vector<float>& acc) {
  const T* pool = static_cast<const T*>(kv.pool);
  const std::int64_t group = q_heads / l.kv_heads, keys = position + 1;
  const std::int32_t* table = kv.block_tables + static_cast<std::int64_t>(kv.token_seq[t]) * kv.max_blocks;
  scores.resize(static_cast<std::size_t>(keys));
  key.resize(static_cast<std::size_t>(std::max(l.key_dim, l.value_dim)));
  acc.resize(static_cast<std::size_t>(l.value_dim));
  // `width` values of row j from `offset` as fp32: the pool itself when it holds fp32.
  const auto widened = [&](std::int64_t j, std::int64_t offset, std::int64_t width) -> const float* {
    const T* src = kv_row(pool, table, kv.block_size, l.row, j) + offset;
    if constexpr (std::is_same_v<T, float>) {
      return src;
    } else {
      kv_widen_row(src, key.data(), width);
      return key.data();
    }
  };
  for (std::int64_t h = 0; h < q_heads; ++h) {
    const std::int64_t g = h / group;
    const float* qh = q + (t * q_heads + h) * l.key_dim;
    float top = -INFINITY;
    for (std::int64_t j = 0; j < keys; ++j) {
      scores[static_cast<std::size_t>(j)] = paged_dot(qh, widened(j, g * l.key_dim, l.key_dim), l.key_dim) * l.scale;
      top = std::max(top, scores[static_cast<std::size_t>(j)]);
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    float sum = 0.0f;
    for (std::int64_t j = 0; j < keys; ++j) {
      const float e = std::exp(scores[static_cast<std::size_t>(j)] - top);
      sum += e;
      kv_accumulate_row(e, widened(j, l.value_base + g * l.value_dim, l.value_dim), acc.data(), l.value_dim);
    }
    float* oh = out + (t * q_heads + h) * l.value_dim;
    for (std::int64_t i = 0; i < l.value_dim; ++i) oh[i] = acc[static_cast<std::size_t>(i)] / sum;
  }
}

// Every token of a ragged batch through paged_attention_token, over enough tasks to be worth it.
inline void paged_attention_batch(Host h, const PagedKvLayer& kv, const PagedRowLayout& l, const float* q,
                                  const std::int32_t* positions, std::int64_t tokens, std::int64_t q_heads,
                                  float* out) {
  DSP_CHECK(l.kv_heads > 0 && q_heads % l.kv_heads == 0, "paged attention: q_heads=", q_heads,
            " is not a multiple of kv_heads=", l.kv_heads);
  for (std::int64_t t = 0; t < tokens; ++t)
    DSP_CHECK(positions[t] >= 0, "paged attention: token ", t, " at negative position ", positions[t]);
  std::int64_t work = 0;  // multiply-adds, to decide whether helpers are worth waking
  for (std::int64_t t = 0; t < tokens; ++t) work += (positions[t] + 1) * q_heads * (l.key_dim + l.value_dim);
  const std::int64_t tasks = work < (1 << 19) ? 1 : std::min<std::int64_t>(tokens, 4 * host_threads(h));
  with_kv_cache_type(kv.dtype, [&]<class T>(T) {
    parallel_for(h, tasks, [&](std::int64_t task) {
      std::vector<float> scores, key, acc;
      for (std::int64_t t = task; t < tokens; t += tasks)
        paged_attention_token<T>(kv, l, q, positions[t], t, q_heads, out, scores, key, acc);
    });
  });
}

}  // namespace detail

/// Writes `width` values of each token of a ragged batch, src [tokens, width], into its pool
/// row kv.slots[t] (rows of `row` values) from value `offset` on, rounded to the pool's dtype
/// (to nearest even). Token rows of one call must be distinct.
inline void paged_rows_write(Host, const PagedKvLayer& kv, const float* src, std::int64_t tokens, std::int64_t width,
                             std::int64_t row, std::int64_t offset) {
  with_kv_cache_type(kv.dtype, [&]<class T>(T) {
    T* pool = static_cast<T*>(kv.pool);
    for (std::int64_t t = 0; t < tokens; ++t) {
      T* dst = pool + static_cast<std::int64_t>(kv.slots[t]) * row + offset;
      for (std::int64_t i = 0; i < width; ++i) dst[i] = detail::kv_narrow<T>(src[t * width + i]);
    }
  });
}

/// Writes the keys and values of a ragged batch, k and v [tokens, kv_heads, head_dim], into
/// their pool rows kv.slots[t] (rounded to the pool's dtype, to nearest even). Token rows of
/// one call must be distinct.
inline void paged_kv_write(Host h, const PagedKvLayer& kv, const float* k, const float* v, std::int64_t tokens,
                           std::int64_t kv_heads, std::int64_t head_dim) {
  const std::int64_t width = kv_heads * head_dim;
  paged_rows_write(h, kv, k, tokens, width, 2 * width, 0);
  paged_rows_write(h, kv, v, tokens, width, 2 * width, width);
}

/// out [tokens, q_heads, head_dim] = causal attention of each query q [tokens, q_heads,
/// head_dim] over its own sequence in the pool: token t of sequence kv.token_seq[t] at
/// positions[t] attends that sequence's keys at positions 0..positions[t] (which must have been
/// written, this call's tokens included), scale 1/sqrt(head_dim), query head h reading kv head
/// h / (q_heads / kv_heads). Batch-invariant (see the header comment). Throws Error for a
/// q_heads that is not a multiple of kv_heads or a negative position.
inline void paged_attention_forward(Host h, const PagedKvLayer& kv, const float* q, const std::int32_t* positions,
                                    std::int64_t tokens, std::int64_t q_heads, std::int64_t kv_heads,
                                    std::int64_t head_dim, float* out) {
  const detail::PagedRowLayout l{2 * kv_heads * head_dim, kv_heads, head_dim, head_dim, kv_heads * head_dim,
                                 1.0f / std::sqrt(static_cast<float>(head_dim))};
  detail::paged_attention_batch(h, kv, l, q, positions, tokens, q_heads, out);
}

/// Multi-query attention over a latent cache (MLA's absorbed form, model/mla_attention.hpp):
/// the pool's rows are [width] latents (written by paged_rows_write); query head h of token t,
/// q [tokens, q_heads, width], scores row j by q . row_j x scale and reads the first value_dim
/// values of row j as its value: out [tokens, q_heads, value_dim]. Causal and batch-invariant
/// as paged_attention_forward. Throws Error for value_dim > width or a negative position.
inline void paged_latent_attention_forward(Host h, const PagedKvLayer& kv, const float* q,
                                           const std::int32_t* positions, std::int64_t tokens, std::int64_t q_heads,
                                           std::int64_t width, std::int64_t value_dim, float scale, float* out) {
  DSP_CHECK(value_dim > 0 && value_dim <= width, "paged latent attention: value_dim ", value_dim,
            " outside (0, width ", width, "]");
  detail::paged_attention_batch(h, kv, {width, 1, width, value_dim, 0, scale}, q, positions, tokens, q_heads, out);
}

}  // namespace dsp::backend
