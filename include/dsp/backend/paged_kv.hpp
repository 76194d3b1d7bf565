#pragma once
// The paged KV cache as the attention ops see it (vLLM's PagedAttention, Kwon et al., SOSP'23):
// each layer's keys and values live in a pool of fixed-size blocks of token rows, a sequence's
// tokens in the blocks its block table lists, in order. Written once for the ops of every
// backend; serve::KvCachePool owns the pools, model::Attention hands them to the ops.
//
// Layout of one layer's pool: [num_blocks, block_size, 2, kv_heads, head_dim] elements of the
// cache dtype: token row r (= block * block_size + offset, vLLM's "slot") holds its key heads
// then its value heads. Token j of sequence s lives at row
// block_tables[s * max_blocks + j / block_size] * block_size + j % block_size.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "dsp/core/dtype.hpp"
#include "dsp/core/error.hpp"

namespace dsp::backend {

/// What a KV cache stores: fp32, or 16-bit values (rounded to nearest even when written,
/// widened to fp32 when attention reads them; half the bytes of fp32).
enum class KvCacheDType { Fp32, Bf16, Fp16 };

/// Bytes of one cached value.
constexpr std::size_t kv_cache_dtype_size(KvCacheDType t) { return t == KvCacheDType::Fp32 ? 4 : 2; }

/// "fp32", "bf16", "fp16" (vLLM's --kv-cache-dtype spelling).
constexpr std::string_view kv_cache_dtype_name(KvCacheDType t) {
  switch (t) {
    case KvCacheDType::Fp32: return "fp32";
    case KvCacheDType::Bf16: return "bf16";
    case KvCacheDType::Fp16: return "fp16";
  }
  return "?";
}

/// Inverse of kv_cache_dtype_name ("float32", "bfloat16" and "float16" also accepted); throws
/// ConfigError naming the value otherwise.
inline KvCacheDType kv_cache_dtype_from_name(std::string_view name) {
  if (name == "fp32" || name == "float32" || name == "float") return KvCacheDType::Fp32;
  if (name == "bf16" || name == "bfloat16") return KvCacheDType::Bf16;
  if (name == "fp16" || name == "float16" || name == "half") return KvCacheDType::Fp16;
  throw ConfigError(dsp::detail::concat("--kv-cache-dtype must be fp32, bf16 or fp16, got '", name, "'"));
}

/// Calls f(T{}) with the element type of t (float, bf16 or fp16).
template <class F>
decltype(auto) with_kv_cache_type(KvCacheDType t, F&& f) {
  switch (t) {
    case KvCacheDType::Bf16: return f(bf16{});
    case KvCacheDType::Fp16: return f(fp16{});
    case KvCacheDType::Fp32: break;
  }
  return f(float{});
}

/// One layer's pool and the batch's block tables, as the paged ops read them. Every pointer is
/// in the memory the backend's ops read (host memory, or a device's).
struct PagedKvLayer {
  void* pool = nullptr;                       ///< [num_blocks, block_size, 2, kv_heads, head_dim]
  KvCacheDType dtype = KvCacheDType::Fp32;    ///< element type of the pool
  std::int64_t block_size = 16;               ///< token rows per block
  const std::int32_t* block_tables = nullptr; ///< [seqs, max_blocks]: block ids of each sequence
  std::int64_t max_blocks = 0;                ///< row stride of block_tables
  const std::int32_t* slots = nullptr;        ///< [tokens]: the pool row each token's K/V goes to
  const std::int32_t* token_seq = nullptr;    ///< [tokens]: the block-table row of each token
};

namespace detail {
// Where query head h finds its key and value in a pool row of `row` values: the key of kv
// head g = h / (q_heads / kv_heads) at g * key_dim, its value at value_base + g * value_dim.
// GQA: row [2, kv_heads, head_dim] (value_base = kv_heads * head_dim); MLA's latent: one
// shared head whose key is the whole row and whose value its first value_dim values.
struct PagedRowLayout {
  std::int64_t row, kv_heads, key_dim, value_dim, value_base;
  float scale;
};
}  // namespace detail

}  // namespace dsp::backend
