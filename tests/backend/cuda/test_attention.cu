// CUDA causal attention (the backend-generic attention on the CUDA ops) against the Host op on
// the same inputs: grouped-query heads, prefill and a KV-cache decode step, forward and backward.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "../../relative_error.hpp"
#include "../gradcheck.hpp"
#include "device_vectors.hpp"
#include "dsp/backend/attention.hpp"
#include "dsp/backend/cuda/attention.cuh"

using dsp::backend::Cuda;
using dsp::backend::DeviceBuffer;
using dsp::backend::Host;
using dsp::test::on_device;
using dsp::test::on_host;
using dsp::test::random_vector;
using dsp::test::relative_error;

// The same GEMMs (fp32 accumulation over head_dim = 40 or kv_len <= 70 terms) and softmax on
// both sides, in different summation orders: ~1e-6 relative (the gemm test's bound); 1e-5 is
// the issue's fp32 bound.
constexpr double kTol = 1e-5;

TEST_CASE("attention forward (out, probs; probs may be null) and backward equal the Host op") {
  const Cuda b{};
  const std::int64_t batch = 2, q_heads = 4, kv_heads = 2, head_dim = 40;
  struct Shape {
    std::int64_t q_len, kv_len, first_position;
  };
  // Prefill (positions 0..69 over 70 keys; 70 columns > 64 threads' worth per warp) and a decode
  // step of 3 queries at positions 7..9 against a 10-entry KV cache.
  for (const Shape& s : {Shape{70, 70, 0}, Shape{3, 10, 7}}) {
    CAPTURE(s.q_len);
    std::vector<std::int32_t> positions(batch * s.q_len);
    for (std::int64_t i = 0; i < batch * s.q_len; ++i) positions[i] = std::int32_t(s.first_position + i % s.q_len);
    const auto q = random_vector(batch * s.q_len * q_heads * head_dim, 1);
    const auto k = random_vector(batch * s.kv_len * kv_heads * head_dim, 2);
    const auto v = random_vector(batch * s.kv_len * kv_heads * head_dim, 3);
    const auto dout = random_vector(q.size(), 4);
    std::vector<float> out(q.size()), probs(batch * q_heads * s.q_len * s.kv_len), dq(q.size()), dk(k.size()),
        dv(v.size());
    attention_forward(Host{}, q.data(), k.data(), v.data(), positions.data(), batch, s.q_len, s.kv_len, q_heads,
                      kv_heads, head_dim, out.data(), probs.data());
    attention_backward(Host{}, q.data(), k.data(), v.data(), probs.data(), dout.data(), batch, s.q_len, s.kv_len,
                       q_heads, kv_heads, head_dim, dq.data(), dk.data(), dv.data());

    auto d_q = on_device(b, q), d_k = on_device(b, k), d_v = on_device(b, v), d_dout = on_device(b, dout);
    auto d_pos = on_device(b, positions);
    DeviceBuffer<float> d_out(b, out.size()), d_probs(b, probs.size()), d_dq(b, dq.size()), d_dk(b, dk.size()),
        d_dv(b, dv.size());
    attention_forward(b, d_q.data(), d_k.data(), d_v.data(), d_pos.data(), batch, s.q_len, s.kv_len, q_heads,
                      kv_heads, head_dim, d_out.data(), d_probs.data());
    CHECK(relative_error(on_host(d_out), out) < kTol);
    const auto got_probs = on_host(d_probs);
    CHECK(relative_error(got_probs, probs) < kTol);
    for (std::size_t i = 0; i < probs.size(); ++i)
      if (probs[i] == 0.0f) CHECK(got_probs[i] == 0.0f);  // the causal mask is exact
    attention_backward(b, d_q.data(), d_k.data(), d_v.data(), d_probs.data(), d_dout.data(), batch, s.q_len,
                       s.kv_len, q_heads, kv_heads, head_dim, d_dq.data(), d_dk.data(), d_dv.data());
    CHECK(relative_error(on_host(d_dq), dq) < kTol);
    CHECK(relative_error(on_host(d_dk), dk) < kTol);
    CHECK(relative_error(on_host(d_dv), dv) < kTol);

    // Inference: no probs kept, the same output.
    DeviceBuffer<float> d_out2(b, out.size());
    attention_forward(b, d_q.data(), d_k.data(), d_v.data(), d_pos.data(), batch, s.q_len, s.kv_len, q_heads,
                      kv_heads, head_dim, d_out2.data(), static_cast<float*>(nullptr));
    CHECK(relative_error(on_host(d_out2), out) < kTol);
  }
}

TEST_CASE("attention with a document mask (key_begin, --reset-attention-mask) equals the Host op") {
  // Two sequences of 70 tokens, each packing documents [0, 5), [5, 42), [42, 70) and
  // [0, 30), [30, 70): query i sees keys key_begin[i] .. i. Tolerance kTol as above.
  const Cuda b{};
  const std::int64_t batch = 2, q_len = 70, q_heads = 4, kv_heads = 2, head_dim = 40;
  std::vector<std::int32_t> positions(batch * q_len), key_begin(batch * q_len);
  for (std::int64_t i = 0; i < batch * q_len; ++i) {
    const std::int64_t row = i % q_len;
    positions[i] = std::int32_t(row);
    key_begin[i] = std::int32_t(i < q_len ? (row < 5 ? 0 : row < 42 ? 5 : 42) : (row < 30 ? 0 : 30));
  }
  const auto q = random_vector(batch * q_len * q_heads * head_dim, 11);
  const auto k = random_vector(batch * q_len * kv_heads * head_dim, 12);
  const auto v = random_vector(batch * q_len * kv_heads * head_dim, 13);
  const auto dout = random_vector(q.size(), 14);
  std::vector<float> out(q.size()), probs(batch * q_heads * q_len * q_len), dq(q.size()), dk(k.size()),
      dv(v.size());
  attention_forward(Host{}, q.data(), k.data(), v.data(), positions.data(), batch, q_len, q_len, q_heads, kv_heads,
                    head_dim, out.data(), probs.data(), key_begin.data());
  attention_backward(Host{}, q.data(), k.data(), v.data(), probs.data(), dout.data(), batch, q_len, q_len, q_heads,
                     kv_heads, head_dim, dq.data(), dk.data(), dv.data());
  auto d_q = on_device(b, q), d_k = on_device(b, k), d_v = on_device(b, v), d_dout = on_device(b, dout);
  auto d_pos = on_device(b, positions), d_begin = on_device(b, key_begin);
  DeviceBuffer<float> d_out(b, out.size()), d_probs(b, probs.size()), d_dq(b, dq.size()), d_dk(b, dk.size()),
      d_dv(b, dv.size());
  attention_forward(b, d_q.data(), d_k.data(), d_v.data(), d_pos.data(), batch, q_len, q_len, q_heads, kv_heads,
                    head_dim, d_out.data(), d_probs.data(), d_begin.data());
  CHECK(relative_error(on_host(d_out), out) < kTol);
  const auto got_probs = on_host(d_probs);
  CHECK(relative_error(got_probs, probs) < kTol);
  for (std::size_t i = 0; i < probs.size(); ++i)
    if (probs[i] == 0.0f) CHECK(got_probs[i] == 0.0f);  // the document mask is exact
  attention_backward(b, d_q.data(), d_k.data(), d_v.data(), d_probs.data(), d_dout.data(), batch, q_len, q_len,
                     q_heads, kv_heads, head_dim, d_dq.data(), d_dk.data(), d_dv.data());
  CHECK(relative_error(on_host(d_dq), dq) < kTol);
  CHECK(relative_error(on_host(d_dk), dk) < kTol);
  CHECK(relative_error(on_host(d_dv), dv) < kTol);
}
