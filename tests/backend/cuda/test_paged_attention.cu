// CUDA paged attention (backend/cuda/paged_attention.cuh) against the Host op on the same pool:
// the K/V write gives the Host op's bits in fp32, bf16 and fp16 pools; attention over a ragged
// batch of decode tokens, whole prompts and a chunk, through shuffled block tables, with GQA and a
// head_dim (80) that leaves lanes idle; and each query's output bitwise the same alone and in
// the batch on the device. The same for MLA's latent rows (paged_rows_write and
// paged_latent_attention_forward: 576 values as DeepSeek-V3's, and 20).
//
// Tolerance: the two ops differ in the order of the q . k sums only (8 lanes then a tree on the
// host, 32 lanes then a butterfly of shuffles here) and in expf's last bit: ~1e-7 relative per
// score, 1e-5 relative (relative_error, the norm of the difference over the norm) on outputs of
// magnitude ~1 with up to 70 keys.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../../relative_error.hpp"
#include "../gradcheck.hpp"
#include "device_vectors.hpp"
#include "dsp/backend/cuda/paged_attention.cuh"
#include "dsp/backend/host/paged_attention.hpp"

namespace cuda_paged_attention_test {

using namespace dsp;
using backend::Cuda;
using backend::DeviceBuffer;
using backend::Host;
using backend::KvCacheDType;
using test::on_device;
using test::on_host;

constexpr std::int64_t kHeads = 4, kKvHeads = 2, kDim = 80, kBlock = 4, kRow = 2 * kKvHeads * kDim;

template <class T>
constexpr KvCacheDType dtype_of() {
  if constexpr (std::is_same_v<T, bf16>) return KvCacheDType::Bf16;
  else if constexpr (std::is_same_v<T, fp16>) return KvCacheDType::Fp16;
  else return KvCacheDType::Fp32;
}

// Sequences of these lengths in blocks of a pool taken in a shuffled order (block b of the
// pool is the (b * 7 mod blocks)-th one handed out), their keys, values and a query at every
// position.
struct Case {
  std::vector<std::int64_t> lengths{1, 7, 70, 16, 33};
  std::vector<std::int64_t> chunk{1, 7, 1, 5, 33};  // queries: the last chunk[i] positions
  std::int64_t max_blocks = 0, blocks = 0;
  std::vector<std::int32_t> tables, slots, seq_of_token, positions, query_seq;
  std::vector<float> k, v, q;
  Case() {
    for (auto len : lengths) max_blocks = std::max(max_blocks, (len + kBlock - 1) / kBlock);
    for (auto len : lengths) blocks += (len + kBlock - 1) / kBlock;
    blocks += 3;  // never used
    tables.assign(lengths.size() * static_cast<std::size_t>(max_blocks), 0);
    std::int64_t next = 0;
    for (std::size_t i = 0; i < lengths.size(); ++i)
      for (std::int64_t b = 0; b * kBlock < lengths[i]; ++b)
        tables[i * static_cast<std::size_t>(max_blocks) + static_cast<std::size_t>(b)] =
            static_cast<std::int32_t>(next++ * 7 % blocks);  // 7 and blocks (30) are coprime
    for (std::size_t i = 0; i < lengths.size(); ++i)
      for (std::int64_t p = 0; p < lengths[i]; ++p) {
        slots.push_back(tables[i * static_cast<std::size_t>(max_blocks) + static_cast<std::size_t>(p / kBlock)] *
                            static_cast<std::int32_t>(kBlock) + static_cast<std::int32_t>(p % kBlock));
        seq_of_token.push_back(static_cast<std::int32_t>(i));
        if (p >= lengths[i] - chunk[i]) {
          positions.push_back(static_cast<std::int32_t>(p));
          query_seq.push_back(static_cast<std::int32_t>(i));
        }
      }
    k = test::random_vector(slots.size() * kKvHeads * kDim, 11, -2.0f, 2.0f);
    v = test::random_vector(slots.size() * kKvHeads * kDim, 12);
    q = test::random_vector(positions.size() * kHeads * kDim, 13, -2.0f, 2.0f);
  }
};

// The device pool holds the Host pool's bits (the writes round alike).
template <class T>
bool same_pool_bits(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) return false;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if constexpr (std::is_same_v<T, float>) {
      if (got[i] != want[i]) return false;
    } else if (got[i].bits != want[i].bits) {
      return false;
    }
  }
  return true;
}

// Every fifth query of the case alone on the device (q: its `in` values per token, the batch's
// output `out` values per token): bitwise its row of the batch. attend(kv, q, positions, out)
// runs the op on one token.
template <class Attend>
void check_alone_is_batch(const Case& c, Cuda b, const backend::PagedKvLayer& pool, const std::vector<float>& q,
                          std::int64_t in, std::int64_t out, const std::vector<float>& together, Attend attend) {
  const auto queries = static_cast<std::int64_t>(c.positions.size());
  for (std::int64_t t = 0; t < queries; t += 5) {
    CAPTURE(t);
    const std::vector<std::int32_t> pos{c.positions[static_cast<std::size_t>(t)]},
        seq{c.query_seq[static_cast<std::size_t>(t)]};
    const std::vector<float> qt(q.begin() + t * in, q.begin() + (t + 1) * in);
    auto d_pos1 = on_device(b, pos), d_seq1 = on_device(b, seq);
    auto d_q1 = on_device(b, qt);
    backend::PagedKvLayer one = pool;
    one.token_seq = d_seq1.data();
    DeviceBuffer<float> d_alone(b, static_cast<std::size_t>(out));
    attend(one, d_q1.data(), d_pos1.data(), d_alone.data());
    const std::vector<float> alone = on_host(d_alone);
    CHECK(std::equal(alone.begin(), alone.end(), together.begin() + t * out));
  }
}

template <class T>
void check_against_host() {
  CAPTURE(backend::kv_cache_dtype_name(dtype_of<T>()));
  const Case c;
  const Cuda b{};
  const auto tokens = static_cast<std::int64_t>(c.slots.size()), queries = static_cast<std::int64_t>(c.positions.size());
  // Host pool.
  std::vector<T> pool(static_cast<std::size_t>(c.blocks * kBlock * kRow), T{});
  const backend::PagedKvLayer host_kv{pool.data(), dtype_of<T>(), kBlock, c.tables.data(), c.max_blocks,
                                      c.slots.data(), c.seq_of_token.data()};
  paged_kv_write(Host{}, host_kv, c.k.data(), c.v.data(), tokens, kKvHeads, kDim);
  std::vector<float> want(c.q.size());
  const backend::PagedKvLayer host_q{pool.data(), dtype_of<T>(), kBlock, c.tables.data(), c.max_blocks, nullptr,
                                     c.query_seq.data()};
  paged_attention_forward(Host{}, host_q, c.q.data(), c.positions.data(), queries, kHeads, kKvHeads, kDim, want.data());
  // Device pool, the same calls.
  DeviceBuffer<T> d_pool(b, pool.size());
  cudaMemsetAsync(d_pool.data(), 0, pool.size() * sizeof(T), b.stream);
  auto d_tables = on_device(b, c.tables), d_slots = on_device(b, c.slots), d_seq = on_device(b, c.seq_of_token);
  auto d_qseq = on_device(b, c.query_seq), d_pos = on_device(b, c.positions);
  auto d_k = on_device(b, c.k), d_v = on_device(b, c.v), d_q = on_device(b, c.q);
  const backend::PagedKvLayer dev_kv{d_pool.data(), dtype_of<T>(), kBlock, d_tables.data(), c.max_blocks,
                                     d_slots.data(), d_seq.data()};
  paged_kv_write(b, dev_kv, d_k.data(), d_v.data(), tokens, kKvHeads, kDim);
  CHECK(same_pool_bits(on_host(d_pool), pool));  // the write rounds as the host does
  const backend::PagedKvLayer dev_q{d_pool.data(), dtype_of<T>(), kBlock, d_tables.data(), c.max_blocks, nullptr,
                                    d_qseq.data()};
  DeviceBuffer<float> d_out(b, want.size());
  paged_attention_forward(b, dev_q, d_q.data(), d_pos.data(), queries, kHeads, kKvHeads, kDim, d_out.data());
  const std::vector<float> together = on_host(d_out);
  CHECK(test::relative_error(together, want) < 1e-5);
  // Each query alone on the device: bitwise its row of the batch.
  check_alone_is_batch(c, b, dev_q, c.q, kHeads * kDim, kHeads * kDim, together,
                       [&](const backend::PagedKvLayer& kv, const float* q1, const std::int32_t* p1, float* o) {
                         paged_attention_forward(b, kv, q1, p1, 1, kHeads, kKvHeads, kDim, o);
                       });
}

TEST_CASE("CUDA paged attention equals the Host op (fp32, bf16, fp16 pools) and is batch-invariant") {
  check_against_host<float>();
  check_against_host<bf16>();
  check_against_host<fp16>();
}

// MLA's latent rows (DeepSeek-V3's width: kv_lora 512 + rope 64, over the kernel's 256 of a
// GQA head; and a narrow one), written by paged_rows_write and attended by every query head as
// one shared key/value head: the Host op's bits in the pool, its outputs within 1e-5, and each
// query alone bitwise its row of the batch.
template <class T>
void check_latent_against_host(std::int64_t width, std::int64_t value_dim) {
  CAPTURE(backend::kv_cache_dtype_name(dtype_of<T>()));
  CAPTURE(width);
  const Case c;
  const Cuda b{};
  const auto tokens = static_cast<std::int64_t>(c.slots.size()), queries = static_cast<std::int64_t>(c.positions.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(width));
  const auto latent = test::random_vector(static_cast<std::size_t>(tokens * width), 14, -2.0f, 2.0f);
  const auto q = test::random_vector(static_cast<std::size_t>(queries * kHeads * width), 15, -0.5f, 0.5f);
  std::vector<T> pool(static_cast<std::size_t>(c.blocks * kBlock * width), T{});
  const backend::PagedKvLayer host_kv{pool.data(), dtype_of<T>(), kBlock, c.tables.data(), c.max_blocks,
                                      c.slots.data(), c.seq_of_token.data()};
  paged_rows_write(Host{}, host_kv, latent.data(), tokens, width, width, 0);
  const backend::PagedKvLayer host_q{pool.data(), dtype_of<T>(), kBlock, c.tables.data(), c.max_blocks, nullptr,
                                     c.query_seq.data()};
  std::vector<float> want(static_cast<std::size_t>(queries * kHeads * value_dim));
  paged_latent_attention_forward(Host{}, host_q, q.data(), c.positions.data(), queries, kHeads, width, value_dim, scale,
                                 want.data());
  DeviceBuffer<T> d_pool(b, pool.size());
  cudaMemsetAsync(d_pool.data(), 0, pool.size() * sizeof(T), b.stream);
  auto d_tables = on_device(b, c.tables), d_slots = on_device(b, c.slots), d_seq = on_device(b, c.seq_of_token);
  auto d_qseq = on_device(b, c.query_seq), d_pos = on_device(b, c.positions);
  auto d_latent = on_device(b, latent), d_q = on_device(b, q);
  const backend::PagedKvLayer dev_kv{d_pool.data(), dtype_of<T>(), kBlock, d_tables.data(), c.max_blocks,
                                     d_slots.data(), d_seq.data()};
  paged_rows_write(b, dev_kv, d_latent.data(), tokens, width, width, 0);
  CHECK(same_pool_bits(on_host(d_pool), pool));
  const backend::PagedKvLayer dev_q{d_pool.data(), dtype_of<T>(), kBlock, d_tables.data(), c.max_blocks, nullptr,
                                    d_qseq.data()};
  DeviceBuffer<float> d_out(b, want.size());
  paged_latent_attention_forward(b, dev_q, d_q.data(), d_pos.data(), queries, kHeads, width, value_dim, scale,
                                 d_out.data());
  const std::vector<float> together = on_host(d_out);
  CHECK(test::relative_error(together, want) < 1e-5);
  check_alone_is_batch(c, b, dev_q, q, kHeads * width, kHeads * value_dim, together,
                       [&](const backend::PagedKvLayer& kv, const float* q1, const std::int32_t* p1, float* o) {
                         paged_latent_attention_forward(b, kv, q1, p1, 1, kHeads, width, value_dim, scale, o);
                       });
}

TEST_CASE("CUDA paged latent attention (MLA) equals the Host op (fp32, bf16 pools) and is batch-invariant") {
  check_latent_against_host<float>(576, 512);
  check_latent_against_host<bf16>(576, 512);
  check_latent_against_host<float>(20, 16);
}

TEST_CASE("CUDA paged attention: a q_heads not a multiple of kv_heads, a head_dim over 640, a latent value wider than its row throw") {
  const Cuda b{};
  const backend::PagedKvLayer kv{};
  CHECK_THROWS_AS(paged_attention_forward(b, kv, nullptr, nullptr, 1, 3, 2, 64, nullptr), Error);
  CHECK_THROWS_AS(paged_attention_forward(b, kv, nullptr, nullptr, 1, 4, 2, 641, nullptr), Error);
  CHECK_THROWS_AS(paged_latent_attention_forward(b, kv, nullptr, nullptr, 1, 4, 16, 17, 1.0f, nullptr), Error);
}

}  // namespace cuda_paged_attention_test
