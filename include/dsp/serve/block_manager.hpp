#pragma once
// BlockManager: the bookkeeping of a paged KV cache (vLLM's KV cache manager): which of the
// pool's blocks each sequence holds, reference counts, a free queue, and the prefix cache.
// It knows no tensors and no attention details: blocks are numbers, sized by the pool
// (serve/kv_cache_pool.hpp). Every rank of a serving group runs the same calls in the same
// order, so every rank's block tables are equal.
//
// Prefix caching (--enable-prefix-caching): once a block is full, its key is hash(parent
// block's key, the block's token ids) and it is registered under it; a new sequence whose
// prompt starts with the same full blocks shares them (reference counted) instead of
// computing them. A block whose count drops to 0 goes to the back of the free queue but
// keeps its key (its contents stay valid) until it is taken from the front for new tokens:
// least recently freed first (LRU). A sequence's blocks are freed last block first, so its
// prefix, the part others are likeliest to share, is evicted last. Matches are checked
// against the block's stored token ids and parent key, so a hash collision cannot give a
// sequence another prompt's keys and values.
#include <algorithm>
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "dsp/core/error.hpp"

namespace dsp::serve {

/// The blocks one sequence holds, in order (token j lives in blocks[j / block_size]), and
/// the prefix-cache keys of its first `hashed` full blocks.
struct BlockTable {
  std::vector<std::int32_t> blocks;
  std::vector<std::uint64_t> keys;  ///< keys[i]: key of blocks[i] (for i < keys.size())
};

/// A sequence's cached prefix: the shared full blocks and their keys.
struct PrefixHit {
  std::vector<std::int32_t> blocks;
  std::vector<std::uint64_t> keys;
};

class BlockManager {
 public:
  /// A pool of num_blocks blocks of block_size tokens. Throws ConfigError for sizes below 1.
  BlockManager(std::int64_t num_blocks, std::int64_t block_size, bool enable_prefix_caching)
      : block_size_(block_size), caching_(enable_prefix_caching) {
    DSP_CHECK_AS(ConfigError, num_blocks >= 1, "the KV cache has no block (", num_blocks,
                 "): raise --kv-cache-memory or --gpu-memory-utilization");
    DSP_CHECK_AS(ConfigError, block_size >= 1, "--block-size must be >= 1, got ", block_size);
    meta_.resize(static_cast<std::size_t>(num_blocks));
    for (std::int32_t b = 0; b < num_blocks; ++b) push_back_free(b);
  }

  std::int64_t num_blocks() const { return static_cast<std::int64_t>(meta_.size()); }
  std::int64_t block_size() const { return block_size_; }
  bool prefix_caching() const { return caching_; }
  /// Blocks no sequence holds (cached ones among them can still be shared or evicted).
  std::int64_t num_free_blocks() const { return free_count_; }
  /// Blocks held by at least one sequence.
  std::int64_t num_used_blocks() const { return num_blocks() - free_count_; }
  /// Blocks a sequence of `tokens` tokens needs.
  std::int64_t blocks_for(std::int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  /// The longest run of cached full blocks that `tokens` starts with, limited to the first
  /// tokens.size() - 1 tokens (the last token is always computed, for its logits). Empty
  /// without prefix caching. Counts a query of tokens.size() tokens and the hit tokens.
  PrefixHit find_cached_prefix(std::span<const std::int32_t> tokens) {
    PrefixHit hit;
    if (!caching_ || tokens.empty()) return hit;
    query_tokens_ += static_cast<std::int64_t>(tokens.size());
    const std::int64_t full = (static_cast<std::int64_t>(tokens.size()) - 1) / block_size_;
    std::uint64_t parent = root_key;
    for (std::int64_t i = 0; i < full; ++i) {
      const auto block = tokens.subspan(static_cast<std::size_t>(i * block_size_), static_cast<std::size_t>(block_size_));
      const std::uint64_t key = block_key(parent, block);
      const auto it = cached_.find(key);
      if (it == cached_.end()) break;
      const Meta& m = meta_[static_cast<std::size_t>(it->second)];
      if (m.parent != parent || !std::equal(block.begin(), block.end(), m.tokens.begin(), m.tokens.end())) break;
      hit.blocks.push_back(it->second);
      hit.keys.push_back(key);
      parent = key;
    }
    hit_tokens_ += static_cast<std::int64_t>(hit.blocks.size()) * block_size_;
    return hit;
  }

  /// Grows `table` to hold `tokens` tokens: first (when the table is empty) the blocks of
  /// `hit`, shared, then new blocks from the front of the free queue (evicting their cached
  /// keys). Returns false, changing nothing, when the free blocks do not suffice.
  bool allocate(BlockTable& table, std::int64_t tokens, const PrefixHit* hit = nullptr) {
    const bool take_hit = hit && table.blocks.empty() && !hit->blocks.empty();
    const auto have = static_cast<std::int64_t>(table.blocks.size() + (take_hit ? hit->blocks.size() : 0));
    const std::int64_t fresh = std::max<std::int64_t>(0, blocks_for(tokens) - have);
    std::int64_t reclaimed = 0;  // hit blocks that are free now (they leave the free queue)
    if (take_hit)
      for (auto b : hit->blocks) reclaimed += meta_[static_cast<std::size_t>(b)].refs == 0;
    if (fresh + reclaimed > free_count_) return false;
    if (take_hit) {
      for (auto b : hit->blocks) {
        Meta& m = meta_[static_cast<std::size_t>(b)];
        if (m.refs++ == 0) unlink_free(b);
        table.blocks.push_back(b);
      }
      table.keys = hit->keys;
    }
    for (std::int64_t i = 0; i < fresh; ++i) {
      const std::int32_t b = free_head_;
      unlink_free(b);
      Meta& m = meta_[static_cast<std::size_t>(b)];
      if (m.cached) uncache(b);
      m.refs = 1;
      table.blocks.push_back(b);
    }
    return true;
  }

  /// Registers the full blocks among the first `computed` tokens of a sequence (whose ids are
  /// `tokens`) that are not registered yet, so later sequences can share them. No-op without
  /// prefix caching. A block another sequence registered first under the same key stays that
  /// one; this sequence keeps its own copy (not shared) for the rest of its life.
  void cache_full_blocks(BlockTable& table, std::span<const std::int32_t> tokens, std::int64_t computed) {
    if (!caching_) return;
    const std::int64_t full = std::min<std::int64_t>(computed, static_cast<std::int64_t>(tokens.size())) / block_size_;
    for (auto i = static_cast<std::int64_t>(table.keys.size()); i < full; ++i) {
      const std::uint64_t parent = i == 0 ? root_key : table.keys[static_cast<std::size_t>(i - 1)];
      const auto block = tokens.subspan(static_cast<std::size_t>(i * block_size_), static_cast<std::size_t>(block_size_));
      const std::uint64_t key = block_key(parent, block);
      table.keys.push_back(key);
      const std::int32_t b = table.blocks[static_cast<std::size_t>(i)];
      if (cached_.contains(key)) continue;
      Meta& m = meta_[static_cast<std::size_t>(b)];
      m.cached = true;
      m.key = key;
      m.parent = parent;
      m.tokens.assign(block.begin(), block.end());
      cached_.emplace(key, b);
    }
  }

  /// Releases every block of `table` (last first) and empties it. A block whose count reaches
  /// 0 joins the back of the free queue (a cached one keeps its key until evicted).
  void free(BlockTable& table) {
    for (auto it = table.blocks.rbegin(); it != table.blocks.rend(); ++it) {
      Meta& m = meta_[static_cast<std::size_t>(*it)];
      DSP_CHECK(m.refs > 0, "BlockManager: block ", *it, " freed more often than allocated");
      if (--m.refs == 0) push_back_free(*it);
    }
    table = {};
  }

  /// Prefix-cache statistics since construction: tokens of the prompts looked up, and of those
  /// the tokens found in cached blocks (vLLM's prefix_cache_queries / hits).
  std::int64_t prefix_cache_queries() const { return query_tokens_; }
  std::int64_t prefix_cache_hits() const { return hit_tokens_; }
  /// Reference count of a block (tests).
  std::int32_t refs(std::int32_t block) const { return meta_.at(static_cast<std::size_t>(block)).refs; }

  /// hash(parent key, block token ids): splitmix64 steps over the token ids (Steele et al.,
  /// "Fast splittable pseudorandom number generators", OOPSLA 2014).
  static std::uint64_t block_key(std::uint64_t parent, std::span<const std::int32_t> block) {
    std::uint64_t h = mix(parent ^ 0x9e3779b97f4a7c15ULL);
    for (auto id : block) h = mix(h ^ static_cast<std::uint32_t>(id));
    return h;
  }

 private:
  static constexpr std::uint64_t root_key = 0x6473702d6b760001ULL;  // the parent of a first block
  static std::uint64_t mix(std::uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  }

  struct Meta {
    std::int32_t refs = 0;
    std::int32_t prev = -1, next = -1;  // free queue links (valid while refs == 0)
    bool cached = false;
    std::uint64_t key = 0, parent = 0;
    std::vector<std::int32_t> tokens;
  };

  void push_back_free(std::int32_t b) {
    Meta& m = meta_[static_cast<std::size_t>(b)];
    m.prev = free_tail_;
    m.next = -1;
    if (free_tail_ >= 0) meta_[static_cast<std::size_t>(free_tail_)].next = b;
    else free_head_ = b;
    free_tail_ = b;
    ++free_count_;
  }
  void unlink_free(std::int32_t b) {
    Meta& m = meta_[static_cast<std::size_t>(b)];
    if (m.prev >= 0) meta_[static_cast<std::size_t>(m.prev)].next = m.next;
    else free_head_ = m.next;
    if (m.next >= 0) meta_[static_cast<std::size_t>(m.next)].prev = m.prev;
    else free_tail_ = m.prev;
    m.prev = m.next = -1;
    --free_count_;
  }
  void uncache(std::int32_t b) {
    Meta& m = meta_[static_cast<std::size_t>(b)];
    if (auto it = cached_.find(m.key); it != cached_.end() && it->second == b) cached_.erase(it);
    m.cached = false;
    m.tokens.clear();
  }

  std::int64_t block_size_;
  bool caching_;
  std::vector<Meta> meta_;
  std::int32_t free_head_ = -1, free_tail_ = -1;
  std::int64_t free_count_ = 0;
  std::unordered_map<std::uint64_t, std::int32_t> cached_;
  std::int64_t query_tokens_ = 0, hit_tokens_ = 0;
};

}  // namespace dsp::serve
