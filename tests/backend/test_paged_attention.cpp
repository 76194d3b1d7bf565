// Host paged attention (backend/host/paged_attention.hpp) against the contiguous attention op
// (backend/attention.hpp) on the same keys and values, through shuffled block tables, for a
// ragged batch of prefill chunks and decode tokens; its batch invariance; and the 16-bit pools.
// The latent form (MLA's cache, paged_latent_attention_forward) against the contiguous
// scaled_attention_forward over the same latents as one shared key/value head.
//
// Tolerance: the two ops differ in fp32 summation order only (the paged op sums q . k in 8
// lanes and divides by the softmax sum at the end; the contiguous one runs two GEMMs on
// normalised probabilities): 1e-5 relative on outputs of magnitude ~1, head_dim 16, up to 70
// keys (observed ~1e-7).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "dsp/backend/attention.hpp"
#include "dsp/backend/host/paged_attention.hpp"
#include "dsp/core/rng.hpp"
#include "gradcheck.hpp"

namespace backend_paged_attention_test {

using namespace dsp;
using backend::Host;
using backend::KvCacheDType;

namespace {

constexpr std::int64_t kHeads = 4, kKvHeads = 2, kDim = 16, kBlock = 4;

// Sequences of these lengths, each with its keys and values [len, kv_heads, dim].
struct Sequences {
  std::vector<std::int64_t> lengths;
  std::vector<std::vector<float>> k, v, q;  // q [len, heads, dim]: a query at every position
};

Sequences make_sequences(std::vector<std::int64_t> lengths) {
  Sequences s{lengths, {}, {}, {}};
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    const auto n = static_cast<std::size_t>(lengths[i]);
    s.k.push_back(test::random_vector(n * kKvHeads * kDim, static_cast<unsigned>(10 + i)));
    s.v.push_back(test::random_vector(n * kKvHeads * kDim, static_cast<unsigned>(20 + i)));
    s.q.push_back(test::random_vector(n * kHeads * kDim, static_cast<unsigned>(30 + i)));
  }
  return s;
}

// A pool holding every sequence's keys and values in blocks taken in a shuffled order, and
// its block tables [seqs, max_blocks].
template <class T>
struct Pool {
  std::vector<T> data;
  std::vector<std::int32_t> tables;
  std::int64_t max_blocks = 0;
  std::vector<std::int32_t> slot_of(std::size_t s, std::int64_t first, std::int64_t n) const {
    std::vector<std::int32_t> out;
    for (std::int64_t p = first; p < first + n; ++p)
      out.push_back(tables[s * static_cast<std::size_t>(max_blocks) + static_cast<std::size_t>(p / kBlock)] *
                        static_cast<std::int32_t>(kBlock) + static_cast<std::int32_t>(p % kBlock));
    return out;
  }
};

template <class T>
Pool<T> make_pool(const Sequences& s) {
  Pool<T> pool;
  std::int64_t blocks = 0;
  for (auto len : s.lengths) pool.max_blocks = std::max(pool.max_blocks, (len + kBlock - 1) / kBlock);
  for (auto len : s.lengths) blocks += (len + kBlock - 1) / kBlock;
  std::vector<std::int32_t> order(static_cast<std::size_t>(blocks + 3));  // 3 blocks never used
  std::iota(order.begin(), order.end(), 0);
  const CounterRng rng(5, 0);
  for (std::size_t i = order.size(); i-- > 1;)  // Fisher-Yates
    std::swap(order[i], order[static_cast<std::size_t>(rng.uniform(i) * static_cast<double>(i + 1))]);
  pool.data.assign(order.size() * kBlock * 2 * kKvHeads * kDim, T{});
  pool.tables.assign(s.lengths.size() * static_cast<std::size_t>(pool.max_blocks), 0);
  std::size_t next = 0;
  for (std::size_t i = 0; i < s.lengths.size(); ++i)
    for (std::int64_t b = 0; b * kBlock < s.lengths[i]; ++b)
      pool.tables[i * static_cast<std::size_t>(pool.max_blocks) + static_cast<std::size_t>(b)] = order[next++];
  return pool;
}

template <class T>
backend::PagedKvLayer view(Pool<T>& pool, const std::vector<std::int32_t>& slots, const std::vector<std::int32_t>& seq) {
  KvCacheDType dtype = KvCacheDType::Fp32;
  if constexpr (std::is_same_v<T, bf16>) dtype = KvCacheDType::Bf16;
  if constexpr (std::is_same_v<T, fp16>) dtype = KvCacheDType::Fp16;
  return {pool.data.data(), dtype, kBlock, pool.tables.data(), pool.max_blocks, slots.data(), seq.data()};
}

// Writes every sequence's keys and values into the pool through paged_kv_write.
template <class T>
void fill(Pool<T>& pool, const Sequences& s) {
  for (std::size_t i = 0; i < s.lengths.size(); ++i) {
    const auto slots = pool.slot_of(i, 0, s.lengths[i]);
    const std::vector<std::int32_t> seq(slots.size(), static_cast<std::int32_t>(i));
    paged_kv_write(Host{}, view(pool, slots, seq), s.k[i].data(), s.v[i].data(), s.lengths[i], kKvHeads, kDim);
  }
}

// The ragged batch: the last `chunk[i]` positions of each sequence as queries.
struct Batch {
  std::vector<float> q;
  std::vector<std::int32_t> positions, seq;
};
Batch batch_of(const Sequences& s, const std::vector<std::int64_t>& chunk) {
  Batch b;
  for (std::size_t i = 0; i < s.lengths.size(); ++i)
    for (std::int64_t p = s.lengths[i] - chunk[i]; p < s.lengths[i]; ++p) {
      const auto* row = s.q[i].data() + p * kHeads * kDim;
      b.q.insert(b.q.end(), row, row + kHeads * kDim);
      b.positions.push_back(static_cast<std::int32_t>(p));
      b.seq.push_back(static_cast<std::int32_t>(i));
    }
  return b;
}

// Rounds values the way a 16-bit pool stores them.
template <class T>
std::vector<float> stored(const std::vector<float>& x) {
  std::vector<float> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = std::is_same_v<T, float> ? x[i] : static_cast<float>(T(x[i]));
  return out;
}

template <class T>
void check_against_contiguous() {
  const Sequences s = make_sequences({1, 7, 70, 16, 33});
  Pool<T> pool = make_pool<T>(s);
  fill(pool, s);
  const std::vector<std::int64_t> chunk{1, 7, 1, 5, 33};  // decodes, whole prompts, a chunk
  const Batch b = batch_of(s, chunk);
  std::vector<float> out(b.q.size());
  const auto n = static_cast<std::int64_t>(b.positions.size());
  paged_attention_forward(Host{}, view(pool, {}, b.seq), b.q.data(), b.positions.data(), n, kHeads, kKvHeads, kDim,
                          out.data());
  std::int64_t row = 0;
  for (std::size_t i = 0; i < s.lengths.size(); ++i) {
    CAPTURE(i);
    const std::int64_t len = s.lengths[i], c = chunk[i];
    std::vector<float> ref(static_cast<std::size_t>(c * kHeads * kDim));
    const std::vector<std::int32_t> pos(b.positions.begin() + row, b.positions.begin() + row + c);
    const auto k = stored<T>(s.k[i]), v = stored<T>(s.v[i]);
    backend::attention_forward(Host{}, b.q.data() + row * kHeads * kDim, k.data(), v.data(), pos.data(), 1, c, len,
                               kHeads, kKvHeads, kDim, ref.data(), nullptr);
    const std::vector<float> got(out.begin() + row * kHeads * kDim, out.begin() + (row + c) * kHeads * kDim);
    CHECK(test::max_rel_diff(got, std::vector<double>(ref.begin(), ref.end())) <= 1e-5);
    row += c;
  }
}

// MLA's latent pool: rows of kLatent values (a key of all of them, a value of the first
// kLatentValue), one head shared by kLatentHeads query heads; fp32 and bf16 pools against the
// contiguous op over the (rounded) latents, and a token alone against the batch, bitwise.
template <class T>
void check_latent_against_contiguous() {
  constexpr std::int64_t kLatent = 12, kLatentValue = 8, kLatentHeads = 3;
  constexpr float kScale = 0.3f;
  const std::vector<std::int64_t> lengths{1, 9, 33};
  const std::vector<std::int32_t> tables{7, 0, 0, 0, 0, 0, 0, 0, 0,  // [3 seqs, 9 blocks]: shuffled
                                         3, 11, 5, 0, 0, 0, 0, 0, 0,
                                         1, 12, 4, 9, 2, 13, 6, 8, 10};
  std::vector<T> pool(14 * kBlock * kLatent, T{});
  KvCacheDType dtype = KvCacheDType::Fp32;
  if constexpr (std::is_same_v<T, bf16>) dtype = KvCacheDType::Bf16;
  std::vector<std::vector<float>> latents, queries;
  std::vector<float> q_all;
  std::vector<std::int32_t> positions, seq;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    const auto n = static_cast<std::size_t>(lengths[i]);
    latents.push_back(test::random_vector(n * kLatent, static_cast<unsigned>(40 + i)));
    queries.push_back(test::random_vector(n * kLatentHeads * kLatent, static_cast<unsigned>(50 + i)));
    std::vector<std::int32_t> slots, sq(n, static_cast<std::int32_t>(i));
    for (std::int64_t p = 0; p < lengths[i]; ++p) {
      slots.push_back(tables[i * 9 + static_cast<std::size_t>(p / kBlock)] * static_cast<std::int32_t>(kBlock) +
                      static_cast<std::int32_t>(p % kBlock));
      positions.push_back(static_cast<std::int32_t>(p));
      seq.push_back(static_cast<std::int32_t>(i));
    }
    q_all.insert(q_all.end(), queries.back().begin(), queries.back().end());
    paged_rows_write(Host{}, {pool.data(), dtype, kBlock, tables.data(), 9, slots.data(), sq.data()},
                     latents.back().data(), lengths[i], kLatent, kLatent, 0);
  }
  const auto n = static_cast<std::int64_t>(positions.size());
  std::vector<float> out(static_cast<std::size_t>(n * kLatentHeads * kLatentValue));
  const backend::PagedKvLayer kv{pool.data(), dtype, kBlock, tables.data(), 9, nullptr, seq.data()};
  paged_latent_attention_forward(Host{}, kv, q_all.data(), positions.data(), n, kLatentHeads, kLatent, kLatentValue,
                                 kScale, out.data());
  std::int64_t row = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    CAPTURE(i);
    const std::int64_t len = lengths[i];
    const auto lat = stored<T>(latents[i]);
    std::vector<float> ref(static_cast<std::size_t>(len * kLatentHeads * kLatentValue));
    const backend::AttentionDims d{.batch = 1, .q_len = len, .kv_len = len, .q_heads = kLatentHeads, .kv_heads = 1,
                                   .qk_dim = kLatent, .v_dim = kLatentValue, .scale = kScale, .ldk = kLatent,
                                   .ldv = kLatent};
    backend::scaled_attention_forward(Host{}, queries[i].data(), lat.data(), lat.data(), positions.data() + row, d,
                                      ref.data(), nullptr);
    const std::vector<float> got(out.begin() + row * kLatentHeads * kLatentValue,
                                 out.begin() + (row + len) * kLatentHeads * kLatentValue);
    CHECK(test::max_rel_diff(got, std::vector<double>(ref.begin(), ref.end())) <= 1e-5);
    row += len;
  }
  for (std::int64_t t = 0; t < n; t += 5) {  // each query alone: bitwise the batch's
    CAPTURE(t);
    std::vector<float> alone(kLatentHeads * kLatentValue);
    paged_latent_attention_forward(Host{}, {pool.data(), dtype, kBlock, tables.data(), 9, nullptr, &seq[t]},
                                   q_all.data() + t * kLatentHeads * kLatent, &positions[t], 1, kLatentHeads, kLatent,
                                   kLatentValue, kScale, alone.data());
    CHECK(std::equal(alone.begin(), alone.end(), out.begin() + t * kLatentHeads * kLatentValue));
  }
  CHECK_THROWS_AS(paged_latent_attention_forward(Host{}, kv, q_all.data(), positions.data(), 1, kLatentHeads, kLatent,
                                                 kLatent + 1, kScale, out.data()),
                  Error);
}

}  // namespace

TEST_CASE("paged attention: a ragged batch through shuffled block tables equals contiguous attention") {
  check_against_contiguous<float>();
}

TEST_CASE("paged attention: bf16 and fp16 pools store 16 bits and attend the rounded values") {
  check_against_contiguous<bf16>();
  check_against_contiguous<fp16>();
  // The write rounds to nearest even: a value exactly between two bf16 values keeps the even one.
  Pool<bf16> pool;
  pool.data.assign(2 * kKvHeads * kDim, bf16{});
  pool.tables = {0};
  pool.max_blocks = 1;
  std::vector<float> k(kKvHeads * kDim, 1.0f + 1.0f / 256.0f), v(kKvHeads * kDim, -2.0f);  // 1 + 2^-8: a tie
  const std::vector<std::int32_t> slots{0}, seq{0};
  paged_kv_write(Host{}, {pool.data.data(), KvCacheDType::Bf16, 1, pool.tables.data(), 1, slots.data(), seq.data()},
                 k.data(), v.data(), 1, kKvHeads, kDim);
  CHECK(static_cast<float>(pool.data[0]) == 1.0f);
  CHECK(static_cast<float>(pool.data[kKvHeads * kDim]) == -2.0f);
}

TEST_CASE("paged attention: a token's output is bitwise the same alone, in a batch and in any chunk") {
  const Sequences s = make_sequences({40, 3, 25, 64});
  Pool<float> pool = make_pool<float>(s);
  fill(pool, s);
  const Batch all = batch_of(s, {40, 3, 25, 64});
  std::vector<float> together(all.q.size());
  paged_attention_forward(Host{}, view(pool, {}, all.seq), all.q.data(), all.positions.data(),
                          static_cast<std::int64_t>(all.positions.size()), kHeads, kKvHeads, kDim, together.data());
  for (std::size_t t = 0; t < all.positions.size(); t += 7) {  // each query alone
    CAPTURE(t);
    std::vector<float> alone(kHeads * kDim);
    const std::vector<std::int32_t> pos{all.positions[t]}, seq{all.seq[t]};
    paged_attention_forward(Host{}, view(pool, {}, seq), all.q.data() + t * kHeads * kDim, pos.data(), 1, kHeads,
                            kKvHeads, kDim, alone.data());
    CHECK(std::equal(alone.begin(), alone.end(), together.begin() + static_cast<std::ptrdiff_t>(t * kHeads * kDim)));
  }
  CHECK_THROWS_AS(paged_attention_forward(Host{}, view(pool, {}, all.seq), all.q.data(), all.positions.data(), 1, 3,
                                          2, kDim, together.data()),
                  Error);
}

TEST_CASE("paged attention: MLA's latent pool (fp32, bf16) equals contiguous attention over the latents") {
  check_latent_against_contiguous<float>();
  check_latent_against_contiguous<bf16>();
}

}  // namespace backend_paged_attention_test
