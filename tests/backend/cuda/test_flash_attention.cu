// CUDA flash attention (backend/cuda/flash_attention.cuh) against the Host op
// (backend/host/flash_attention.hpp) on the same inputs: grouped-query heads, a multi-tile
// prefill with a partial last tile, a KV-cache decode step, rows that see no key, head_dim 128
// (the kernels' opt-in shared memory above 48 KiB), lse nullptr, and a bitwise-repeatable
// backward; the output also against the materialising Host attention_forward. The same in a
// bf16 and an fp16 matmul scope, where the CUDA op runs its tensor-core kernels.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../../relative_error.hpp"
#include "../gradcheck.hpp"
#include "device_vectors.hpp"
#include "dsp/backend/attention.hpp"
#include "dsp/backend/cuda/flash_attention.cuh"
#include "dsp/backend/host/flash_attention.hpp"
#include "dsp/backend/matmul_precision.hpp"

using dsp::backend::Cuda;
using dsp::backend::DeviceBuffer;
using dsp::backend::Host;
using dsp::test::on_device;
using dsp::test::on_host;
using dsp::test::random_vector;
using dsp::test::relative_error;

namespace {

// Both sides accumulate in fp32 dot products over head_dim (40 or 128) terms and sums over
// kv_len (<= 150) keys or q_len query rows times the group's 2 heads, in different orders
// (BLAS GEMMs per 64-row tile on the host; per-lane sums over 32-row tiles with an online
// softmax on the GPU): ~1e-6 relative (the attention test's bound); 1e-5 is the fp32 bound.
constexpr double kTol = 1e-5;

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

struct Shape {
  std::int64_t batch, q_len, kv_len, q_heads, kv_heads, head_dim;
};

/// Positions first, first + 1, ... per batch.
std::vector<std::int32_t> consecutive_positions(const Shape& s, std::int64_t first) {
  std::vector<std::int32_t> positions(s.batch * s.q_len);
  for (std::int64_t i = 0; i < s.batch * s.q_len; ++i) positions[i] = std::int32_t(first + i % s.q_len);
  return positions;
}

/// Positions in no order within a tile (a row may see more or fewer keys than the row before
/// it), each in [-2, kv_len + 1], from a linear congruential generator seeded with `seed`.
std::vector<std::int32_t> shuffled_positions(const Shape& s, std::uint32_t seed) {
  std::vector<std::int32_t> p(std::size_t(s.batch * s.q_len));
  for (auto& x : p) {
    seed = seed * 1664525u + 1013904223u;
    x = std::int32_t(seed >> 8) % std::int32_t(s.kv_len + 4) - 2;
  }
  return p;
}

/// Same size and the same bits (unlike ==, tells -0 from 0).
bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// lse against the Host's: -inf exactly where the Host has -inf, the finite entries within tol.
void check_lse(const std::vector<float>& got, const std::vector<float>& want, double tol) {
  REQUIRE(got.size() == want.size());
  std::vector<float> got_finite, want_finite;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (want[i] == kMinusInf) {
      CHECK(got[i] == kMinusInf);
    } else {
      CHECK(std::isfinite(got[i]));
      got_finite.push_back(got[i]);
      want_finite.push_back(want[i]);
    }
  }
  if (!want_finite.empty()) CHECK(relative_error(got_finite, want_finite) < tol);
}

/// Forward and backward of the CUDA op against the Host op on random inputs with `positions`,
/// within tol (norm-wise relative); the output also against attention_forward; lse nullptr
/// gives bitwise the same output; a second backward gives bitwise the same gradients; rows that
/// see no key give exactly out 0, lse -inf and dq 0.
void check_against_host(const Shape& s, const std::vector<std::int32_t>& positions,
                        double tol = kTol) {
  CAPTURE(s.q_len);
  CAPTURE(s.kv_len);
  CAPTURE(s.head_dim);
  const Cuda b{};
  const std::int64_t q_size = s.batch * s.q_len * s.q_heads * s.head_dim;
  const std::int64_t kv_size = s.batch * s.kv_len * s.kv_heads * s.head_dim;
  const std::int64_t lse_size = s.batch * s.q_heads * s.q_len;
  const auto q = random_vector(q_size, 1);
  const auto k = random_vector(kv_size, 2);
  const auto v = random_vector(kv_size, 3);
  const auto dout = random_vector(q_size, 4);

  std::vector<float> out(q_size), lse(lse_size), dq(q_size), dk(kv_size), dv(kv_size);
  flash_attention_forward(Host{}, q.data(), k.data(), v.data(), positions.data(), s.batch, s.q_len, s.kv_len,
                          s.q_heads, s.kv_heads, s.head_dim, out.data(), lse.data());
  flash_attention_backward(Host{}, q.data(), k.data(), v.data(), out.data(), dout.data(), lse.data(),
                           positions.data(), s.batch, s.q_len, s.kv_len, s.q_heads, s.kv_heads, s.head_dim,
                           dq.data(), dk.data(), dv.data());
  std::vector<float> reference_out(q_size), probs(s.batch * s.q_heads * s.q_len * s.kv_len);
  attention_forward(Host{}, q.data(), k.data(), v.data(), positions.data(), s.batch, s.q_len, s.kv_len, s.q_heads,
                    s.kv_heads, s.head_dim, reference_out.data(), probs.data());

  auto d_q = on_device(b, q), d_k = on_device(b, k), d_v = on_device(b, v), d_dout = on_device(b, dout);
  auto d_pos = on_device(b, positions);
  DeviceBuffer<float> d_out(b, q_size), d_lse(b, lse_size), d_dq(b, q_size), d_dk(b, kv_size), d_dv(b, kv_size);
  flash_attention_forward(b, d_q.data(), d_k.data(), d_v.data(), d_pos.data(), s.batch, s.q_len, s.kv_len,
                          s.q_heads, s.kv_heads, s.head_dim, d_out.data(), d_lse.data());
  const auto got_out = on_host(d_out), got_lse = on_host(d_lse);
  CHECK(relative_error(got_out, out) < tol);
  CHECK(relative_error(got_out, reference_out) < tol);
  check_lse(got_lse, lse, tol);

  // Inference: no lse, bitwise the same output (lse is only written, never read).
  DeviceBuffer<float> d_out2(b, q_size);
  flash_attention_forward(b, d_q.data(), d_k.data(), d_v.data(), d_pos.data(), s.batch, s.q_len, s.kv_len,
                          s.q_heads, s.kv_heads, s.head_dim, d_out2.data(), static_cast<float*>(nullptr));
  CHECK(bitwise_equal(on_host(d_out2), got_out));

  // The backward from the device's own out and lse, against the Host's gradients.
  flash_attention_backward(b, d_q.data(), d_k.data(), d_v.data(), d_out.data(), d_dout.data(), d_lse.data(),
                           d_pos.data(), s.batch, s.q_len, s.kv_len, s.q_heads, s.kv_heads, s.head_dim, d_dq.data(),
                           d_dk.data(), d_dv.data());
  const auto got_dq = on_host(d_dq), got_dk = on_host(d_dk), got_dv = on_host(d_dv);
  CHECK(relative_error(got_dq, dq) < tol);
  CHECK(relative_error(got_dk, dk) < tol);
  CHECK(relative_error(got_dv, dv) < tol);

  // Deterministic: a second backward into buffers holding other values (the outputs are
  // overwritten, not accumulated) gives bitwise the same gradients.
  auto d_dq2 = on_device(b, random_vector(q_size, 5)), d_dk2 = on_device(b, random_vector(kv_size, 6)),
       d_dv2 = on_device(b, random_vector(kv_size, 7));
  flash_attention_backward(b, d_q.data(), d_k.data(), d_v.data(), d_out.data(), d_dout.data(), d_lse.data(),
                           d_pos.data(), s.batch, s.q_len, s.kv_len, s.q_heads, s.kv_heads, s.head_dim,
                           d_dq2.data(), d_dk2.data(), d_dv2.data());
  CHECK(bitwise_equal(on_host(d_dq2), got_dq));
  CHECK(bitwise_equal(on_host(d_dk2), got_dk));
  CHECK(bitwise_equal(on_host(d_dv2), got_dv));

  // A query that sees no key (position -1): out row 0, lse -inf, dq row 0, exactly.
  for (std::int64_t bi = 0; bi < s.batch; ++bi) {
    for (std::int64_t i = 0; i < s.q_len; ++i) {
      if (positions[bi * s.q_len + i] >= 0) continue;
      for (std::int64_t h = 0; h < s.q_heads; ++h) {
        CHECK(got_lse[(bi * s.q_heads + h) * s.q_len + i] == kMinusInf);
        for (std::int64_t c = 0; c < s.head_dim; ++c) {
          const std::int64_t at = ((bi * s.q_len + i) * s.q_heads + h) * s.head_dim + c;
          CHECK(got_out[at] == 0.0f);
          CHECK(got_dq[at] == 0.0f);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("flash attention prefill over several tiles (GQA 4/2, head_dim 40) equals the Host op") {
  // 150 rows: 4 full 32-row tiles and a partial one of 22 on the GPU, 2 full 64-row tiles and a
  // partial one on the host.
  const Shape s{2, 150, 150, 4, 2, 40};
  check_against_host(s, consecutive_positions(s, 0));
}

TEST_CASE("flash attention KV-cache decode step equals the Host op") {
  // 3 queries at positions 7..9 against a 10-entry cache.
  const Shape s{2, 3, 10, 4, 2, 40};
  check_against_host(s, consecutive_positions(s, 7));
}

TEST_CASE("flash attention chunked prefill (queries after cached keys) equals the Host op") {
  // 40 queries at positions 30..69 against 70 keys: two query tiles, three key tiles, of which
  // the first query tile sees two (up to key 61) and the second all three.
  const Shape s{2, 40, 70, 4, 2, 40};
  check_against_host(s, consecutive_positions(s, 30));
}

TEST_CASE("flash attention rows at position -1 see no key: out 0, lse -inf, dq 0") {
  // Rows at -1 first, in the middle and last, among rows over two key tiles: batch 0 up to
  // position 45, past kv_len (clamped to all 40 keys); in batch 1 the last key any row sees is
  // 32, the first of the second tile (which only the row at 32 reaches).
  const Shape s{2, 6, 40, 4, 2, 40};
  const std::vector<std::int32_t> positions{-1, 0, -1, 17, 45, -1, 5, -1, 31, 32, 12, -1};
  check_against_host(s, positions);
}

TEST_CASE("flash attention at head_dim 128 (over 48 KiB of shared memory per block) equals the Host op") {
  // Forward 3 * 32 * 129 * 4 = 49536 bytes, backward 66048 bytes of shared memory: the kernels
  // opt in to more than the default 48 KiB.
  const Shape s{1, 70, 70, 4, 2, 128};
  check_against_host(s, consecutive_positions(s, 0));
}

TEST_CASE("flash attention at head_dim 256 with one kv head, and multi-head at 64, out-of-order positions") {
  // head_dim 256: the 8-column register accumulators and 96.4 / 128.5 KiB of shared memory (sm_80
  // and sm_90 allow it; a device that does not throws Error naming head_dim). Positions follow
  // no order within a tile (a row may see more or fewer keys than the row before it).
  const Shape gqa1{1, 70, 70, 4, 1, 256}, mha{2, 40, 70, 4, 4, 64};
  check_against_host(gqa1, shuffled_positions(gqa1, 5));
  check_against_host(mha, shuffled_positions(mha, 6));
}

// In a bf16 / fp16 matmul scope (mixed-precision training opens one) the CUDA op runs its
// tensor-core kernels (backend/cuda/flash_attention_mma.cuh) and the Host op rounds its tile
// GEMMs' inputs at the same points (Q, K, V, dO, P, dS), so both multiply the same 16-bit
// numbers and sum in fp32 in different orders. The fp32 differences (~1e-6) flip a rounding of
// P or dS by one 16-bit ulp (bf16 2^-8 relative) on ~1e-6 / 2^-8 ~ 3e-4 of those elements; a
// flip moves one term of a sum by 2^-8 of itself, so the norm-wise difference stays near
// 3e-4^(1/2) x 2^-8 ~ 7e-5: 1e-3 bounds it (backend/test_attention's naive loop over the same
// contract agrees with the Host op to 6e-5 at most). That the tensor-core path ran is checked
// apart: its output differs from the fp32 Host op's by more than a quarter of the type's unit
// roundoff (bf16 2^-9, fp16 2^-12) norm-wise; every input and P are rounded, so it moves by
// about one to two unit roundoffs. Shapes: head_dim 40 (padded to 48 in the 16-bit tiles), 64
// and 128 (the two kernel instantiations, over 48 KiB of shared memory; 128 only where the
// device allows the backward's 121 KiB, flash_attention_mma_fits), multi-tile prefill with a
// partial tile, decode, chunked prefill, rows at -1, out-of-order positions.
TEST_CASE("flash attention in a bf16 / fp16 matmul scope: the tensor-core kernels equal the Host op in that scope within 1e-3") {
  using dsp::backend::MatmulPrecision;
  constexpr double kTol16 = 1e-3;
  const Shape prefill{2, 150, 150, 4, 2, 40};
  const auto prefill_positions = consecutive_positions(prefill, 0);
  const std::int64_t q_size = prefill.batch * prefill.q_len * prefill.q_heads * prefill.head_dim;
  const std::int64_t kv_size = prefill.batch * prefill.kv_len * prefill.kv_heads * prefill.head_dim;
  const auto q = random_vector(q_size, 11), k = random_vector(kv_size, 12), v = random_vector(kv_size, 13);
  // The fp32 Host output, for the check that the 16-bit path ran.
  std::vector<float> fp32_out(q_size), fp32_lse(prefill.batch * prefill.q_heads * prefill.q_len);
  flash_attention_forward(Host{}, q.data(), k.data(), v.data(), prefill_positions.data(), prefill.batch,
                          prefill.q_len, prefill.kv_len, prefill.q_heads, prefill.kv_heads, prefill.head_dim,
                          fp32_out.data(), fp32_lse.data());
  for (auto [precision, roundoff] :
       {std::pair{MatmulPrecision::Bf16, 0x1p-9}, std::pair{MatmulPrecision::Fp16, 0x1p-12}}) {
    CAPTURE(static_cast<int>(precision));
    dsp::backend::MatmulPrecisionScope scope(precision);
    const Cuda b{};
    auto d_q = on_device(b, q), d_k = on_device(b, k), d_v = on_device(b, v);
    auto d_pos = on_device(b, prefill_positions);
    DeviceBuffer<float> d_out(b, q_size), d_lse(b, fp32_lse.size());
    flash_attention_forward(b, d_q.data(), d_k.data(), d_v.data(), d_pos.data(), prefill.batch, prefill.q_len,
                            prefill.kv_len, prefill.q_heads, prefill.kv_heads, prefill.head_dim, d_out.data(),
                            d_lse.data());
    CHECK(relative_error(on_host(d_out), fp32_out) > roundoff / 4);

    const Shape decode{2, 3, 10, 4, 2, 40}, chunked{2, 40, 70, 4, 2, 40};
    check_against_host(prefill, prefill_positions, kTol16);
    check_against_host(decode, consecutive_positions(decode, 7), kTol16);
    check_against_host(chunked, consecutive_positions(chunked, 30), kTol16);
    const Shape masked{2, 6, 40, 4, 2, 40};
    check_against_host(masked, {-1, 0, -1, 17, 45, -1, 5, -1, 31, 32, 12, -1}, kTol16);
    const Shape wide{1, 140, 140, 4, 2, 128}, mha{2, 40, 70, 4, 4, 64};
    if (dsp::backend::detail::flash_attention_mma_fits(wide.head_dim))
      check_against_host(wide, consecutive_positions(wide, 0), kTol16);
    else
      MESSAGE("head_dim 128: this device's shared memory per block is too small for the tensor-core backward");
    check_against_host(mha, shuffled_positions(mha, 9), kTol16);
  }
}

TEST_CASE("flash attention throws Error for a bad shape before launching") {
  const Cuda b{};
  // q_heads not a multiple of kv_heads; head_dim past the kernels' 256. The pointers are never used.
  CHECK_THROWS_AS(flash_attention_forward(b, nullptr, nullptr, nullptr, nullptr, 1, 1, 1, 3, 2, 40, nullptr, nullptr),
                  dsp::Error);
  CHECK_THROWS_AS(flash_attention_forward(b, nullptr, nullptr, nullptr, nullptr, 1, 1, 1, 2, 2, 257, nullptr, nullptr),
                  dsp::Error);
  CHECK_THROWS_AS(flash_attention_backward(b, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 1, 1,
                                           2, 2, 257, nullptr, nullptr, nullptr),
                  dsp::Error);
}

TEST_CASE("flash attention on CUDA refuses a document mask (key_begin) with an Error naming the way out") {
  const Cuda b{};
  const std::int64_t q_len = 4, heads = 1, head_dim = 8;
  std::vector<std::int32_t> positions{0, 1, 2, 3}, key_begin{0, 0, 2, 2};
  const auto x = random_vector(q_len * heads * head_dim, 21);
  auto d_x = on_device(b, x);
  auto d_pos = on_device(b, positions), d_begin = on_device(b, key_begin);
  DeviceBuffer<float> d_out(b, x.size()), d_lse(b, q_len), d_dq(b, x.size()), d_dk(b, x.size()), d_dv(b, x.size());
  CHECK_THROWS_WITH_AS(flash_attention_forward(b, d_x.data(), d_x.data(), d_x.data(), d_pos.data(), 1, q_len, q_len,
                                               heads, heads, head_dim, d_out.data(), d_lse.data(), d_begin.data()),
                       doctest::Contains("--use-flash-attn"), dsp::Error);
  CHECK_THROWS_WITH_AS(flash_attention_backward(b, d_x.data(), d_x.data(), d_x.data(), d_out.data(), d_x.data(),
                                                d_lse.data(), d_pos.data(), 1, q_len, q_len, heads, heads, head_dim,
                                                d_dq.data(), d_dk.data(), d_dv.data(), d_begin.data()),
                       doctest::Contains("--use-flash-attn"), dsp::Error);
}
