#pragma once
// KvCachePool: one rank's paged KV cache storage, a pool of num_blocks blocks per layer
// (layout in backend/paged_kv.hpp) in the current memory space, in fp32 or really 16 bits.
// How many values a token takes in a layer comes from that layer's attention
// (model::CausalLM::kv_values_per_token: 2 x kv_heads/TP x head_dim for GQA), so the pool and
// the block manager know nothing of the attention's details.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "dsp/backend/paged_kv.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/core/memory_space.hpp"
#include "dsp/core/space_buffer.hpp"

namespace dsp::serve {

class KvCachePool {
 public:
  /// Bytes one block takes over every layer: block_size x sum(values_per_token) x the dtype's
  /// size.
  static std::int64_t bytes_per_block(const std::vector<std::int64_t>& values_per_token, std::int64_t block_size,
                                      backend::KvCacheDType dtype) {
    std::int64_t values = 0;
    for (auto v : values_per_token) values += v;
    return block_size * values * static_cast<std::int64_t>(backend::kv_cache_dtype_size(dtype));
  }

  /// Pools for the layers [first_layer, first_layer + values_per_token.size()) of a model of
  /// num_layers layers, values_per_token[i] values per token in layer first_layer + i, in
  /// `space` (null: host memory), counted as Activations (the ledger's serving row). Throws
  /// ConfigError for no block or a block size below 1, and what the space throws when memory
  /// runs out.
  KvCachePool(std::int64_t num_layers, std::int64_t first_layer, const std::vector<std::int64_t>& values_per_token,
              std::int64_t num_blocks, std::int64_t block_size, backend::KvCacheDType dtype,
              MemorySpace* space = current_memory_space())
      : num_blocks_(num_blocks), block_size_(block_size), dtype_(dtype), pointers_(static_cast<std::size_t>(num_layers)) {
    DSP_CHECK_AS(ConfigError, num_blocks >= 1 && block_size >= 1, "KV cache pool of ", num_blocks, " blocks of ",
                 block_size, " tokens");
    DSP_CHECK(first_layer >= 0 && first_layer + static_cast<std::int64_t>(values_per_token.size()) <= num_layers,
              "KV cache pool: layers [", first_layer, ", ", first_layer + values_per_token.size(),
              ") outside the model's ", num_layers);
    const std::size_t element = backend::kv_cache_dtype_size(dtype);
    for (std::size_t i = 0; i < values_per_token.size(); ++i) {
      const auto bytes = static_cast<std::size_t>(num_blocks * block_size * values_per_token[i]) * element;
      auto& buffer = buffers_.emplace_back(bytes, memory::Category::Activations, space);
      pointers_[static_cast<std::size_t>(first_layer) + i] = buffer.data();
      bytes_ += static_cast<std::int64_t>(bytes);
    }
  }
  KvCachePool(const KvCachePool&) = delete;
  KvCachePool& operator=(const KvCachePool&) = delete;

  /// Every layer's pool by global layer index (null for layers of other pipeline stages).
  const std::vector<void*>& pools() const { return pointers_; }
  std::int64_t num_blocks() const { return num_blocks_; }
  std::int64_t block_size() const { return block_size_; }
  backend::KvCacheDType dtype() const { return dtype_; }
  /// Bytes of every layer's pool on this rank.
  std::int64_t bytes() const { return bytes_; }

 private:
  std::int64_t num_blocks_, block_size_;
  backend::KvCacheDType dtype_;
  std::vector<SpaceBuffer<std::byte>> buffers_;
  std::vector<void*> pointers_;
  std::int64_t bytes_ = 0;
};

}  // namespace dsp::serve
