// serve::BlockManager: reference counts and the free queue, prefix-cache hits and their
// limits, LRU eviction, and that a failed allocation changes nothing.
#include <doctest/doctest.h>

#include <numeric>
#include <vector>

#include "dsp/serve/block_manager.hpp"

using namespace dsp;

namespace serve_block_manager_test {
using serve::BlockManager;
using serve::BlockTable;

namespace {
std::vector<std::int32_t> tokens(std::int32_t first, std::size_t n) {
  std::vector<std::int32_t> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}
}  // namespace

TEST_CASE("block manager: blocks per token count, allocation in order, free returns everything") {
  BlockManager m(8, 4, false);
  CHECK(m.blocks_for(0) == 0);
  CHECK(m.blocks_for(1) == 1);
  CHECK(m.blocks_for(4) == 1);
  CHECK(m.blocks_for(5) == 2);
  BlockTable a, b;
  REQUIRE(m.allocate(a, 6));  // 2 blocks
  CHECK(a.blocks == std::vector<std::int32_t>{0, 1});
  REQUIRE(m.allocate(a, 9));  // grows by one
  CHECK(a.blocks == std::vector<std::int32_t>{0, 1, 2});
  REQUIRE(m.allocate(b, 20));  // 5 blocks: exactly the rest
  CHECK(m.num_free_blocks() == 0);
  BlockTable c;
  CHECK_FALSE(m.allocate(c, 1));
  CHECK(c.blocks.empty());
  CHECK_FALSE(m.allocate(a, 13));  // a needs a 4th block: none free, a unchanged
  CHECK(a.blocks.size() == 3);
  m.free(b);
  CHECK(b.blocks.empty());
  CHECK(m.num_free_blocks() == 5);
  m.free(a);
  CHECK(m.num_free_blocks() == 8);
  CHECK(m.num_used_blocks() == 0);
  CHECK_THROWS_AS(BlockManager(0, 16, false), ConfigError);
  CHECK_THROWS_AS(BlockManager(4, 0, false), ConfigError);
}

TEST_CASE("block manager: a prefix of full blocks is shared by reference, never the last token") {
  BlockManager m(16, 4, true);
  const auto prompt = tokens(10, 10);  // 2 full blocks + 2 tokens
  BlockTable a;
  CHECK(m.find_cached_prefix(prompt).blocks.empty());  // nothing cached yet
  REQUIRE(m.allocate(a, 10));
  m.cache_full_blocks(a, prompt, 10);
  CHECK(a.keys.size() == 2);
  // The same prompt: its 2 full blocks hit (the partial third never does).
  const auto hit = m.find_cached_prefix(prompt);
  REQUIRE(hit.blocks.size() == 2);
  CHECK(hit.blocks == std::vector<std::int32_t>{a.blocks[0], a.blocks[1]});
  BlockTable b;
  REQUIRE(m.allocate(b, 10, &hit));
  CHECK(b.blocks[0] == a.blocks[0]);
  CHECK(b.blocks[1] == a.blocks[1]);
  CHECK(b.blocks[2] != a.blocks[2]);
  CHECK(m.refs(a.blocks[0]) == 2);
  CHECK(m.num_used_blocks() == 4);
  // A prompt of exactly 8 tokens hits one block only: its last token must be computed.
  CHECK(m.find_cached_prefix(tokens(10, 8)).blocks.size() == 1);
  // Another first block breaks the chain from the start.
  auto other = prompt;
  other[0] = 99;
  CHECK(m.find_cached_prefix(other).blocks.empty());
  // A different second block hits the first only.
  other = prompt;
  other[5] = 99;
  CHECK(m.find_cached_prefix(other).blocks.size() == 1);
  CHECK(m.prefix_cache_queries() == 10 + 10 + 8 + 10 + 10);
  CHECK(m.prefix_cache_hits() == 8 + 4 + 0 + 4);
  m.free(a);
  CHECK(m.refs(b.blocks[0]) == 1);
  m.free(b);
  CHECK(m.num_used_blocks() == 0);
}

TEST_CASE("block manager: freed cached blocks stay hits until evicted, least recently freed first") {
  BlockManager m(4, 2, true);
  const auto p = tokens(0, 5), q = tokens(50, 5);  // 2 full blocks each
  BlockTable a;
  REQUIRE(m.allocate(a, 5));  // blocks 0, 1, 2
  m.cache_full_blocks(a, p, 5);
  m.free(a);  // freed last first: 2, 1, 0 join the back of the queue behind 3
  CHECK(m.num_free_blocks() == 4);
  CHECK(m.find_cached_prefix(p).blocks == std::vector<std::int32_t>{0, 1});  // still cached
  BlockTable b;
  REQUIRE(m.allocate(b, 3));  // takes 3 then 2 from the front: the cached blocks survive
  CHECK(b.blocks == std::vector<std::int32_t>{3, 2});
  CHECK(m.find_cached_prefix(p).blocks.size() == 2);
  m.cache_full_blocks(b, q, 3);
  BlockTable c;
  REQUIRE(m.allocate(c, 2));  // takes block 1: p's second block is evicted, its first survives
  CHECK(c.blocks == std::vector<std::int32_t>{1});
  CHECK(m.find_cached_prefix(p).blocks == std::vector<std::int32_t>{0});
  // Taking a free cached block for a hit removes it from the free queue.
  const auto hit = m.find_cached_prefix(p);
  BlockTable d;
  REQUIRE(m.allocate(d, 2, &hit));
  CHECK(d.blocks == std::vector<std::int32_t>{0});
  CHECK(m.num_free_blocks() == 0);
  BlockTable e;
  CHECK_FALSE(m.allocate(e, 1));
}

TEST_CASE("block manager: a hit that does not fit changes nothing; a duplicate registration keeps the first") {
  BlockManager m(3, 2, true);
  const auto p = tokens(0, 3);
  BlockTable a;
  REQUIRE(m.allocate(a, 3));  // blocks 0, 1
  m.cache_full_blocks(a, p, 3);
  m.free(a);
  const auto hit = m.find_cached_prefix(p);  // block 0
  REQUIRE(hit.blocks.size() == 1);
  BlockTable b;
  CHECK_FALSE(m.allocate(b, 8, &hit));  // 4 blocks > 3
  CHECK(b.blocks.empty());
  CHECK(m.num_free_blocks() == 3);
  CHECK(m.refs(0) == 0);
  // Two sequences compute the same first block without sharing: the key keeps the first one.
  BlockTable x, y;
  REQUIRE(m.allocate(x, 2));
  REQUIRE(m.allocate(y, 2));
  m.cache_full_blocks(x, tokens(7, 2), 2);
  m.cache_full_blocks(y, tokens(7, 2), 2);
  CHECK(m.find_cached_prefix(tokens(7, 3)).blocks == x.blocks);
}

}  // namespace serve_block_manager_test
