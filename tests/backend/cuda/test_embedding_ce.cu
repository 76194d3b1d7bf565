// CUDA embedding and (vocab-parallel) cross-entropy against the Host ops on the same inputs.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "../../relative_error.hpp"
#include "../gradcheck.hpp"
#include "device_vectors.hpp"
#include "dsp/backend/cuda/cross_entropy.cuh"
#include "dsp/backend/cuda/embedding.cuh"
#include "dsp/backend/host/cross_entropy.hpp"
#include "dsp/backend/host/embedding.hpp"

using dsp::backend::Cuda;
using dsp::backend::DeviceBuffer;
using dsp::backend::Host;
using dsp::test::on_device;
using dsp::test::on_host;
using dsp::test::random_vector;
using dsp::test::relative_error;

// Gathers and copies are exact; the embedding backward adds the same fp32 values in another
// order (a few repeats per row: ~1e-7 relative); cross-entropy differs by expf/logf (2 and 1
// ulp) and the order of its fp64 sums: ~1e-7. 1e-5 is the issue's fp32 bound.
constexpr double kTol = 1e-5;

TEST_CASE("embedding forward and backward equal the Host op, vocab-parallel offsets, repeated ids") {
  const Cuda b{};
  const std::int64_t tokens = 300, rows = 50, row_offset = 20, hidden = 96;
  std::vector<std::int32_t> ids(tokens);
  for (std::int64_t t = 0; t < tokens; ++t) ids[t] = std::int32_t((t * 37) % 100);  // some outside [20, 70)
  const auto table = random_vector(rows * hidden, 1), dout = random_vector(tokens * hidden, 2);
  const auto dtable0 = random_vector(rows * hidden, 3);
  std::vector<float> out(tokens * hidden), dtable = dtable0;
  embedding_forward(Host{}, ids.data(), tokens, table.data(), rows, row_offset, hidden, out.data());
  embedding_backward(Host{}, ids.data(), tokens, dout.data(), rows, row_offset, hidden, dtable.data());
  auto d_ids = on_device(b, ids);
  auto d_table = on_device(b, table), d_dout = on_device(b, dout), d_dtable = on_device(b, dtable0);
  DeviceBuffer<float> d_out(b, out.size());
  embedding_forward(b, d_ids.data(), tokens, d_table.data(), rows, row_offset, hidden, d_out.data());
  embedding_backward(b, d_ids.data(), tokens, d_dout.data(), rows, row_offset, hidden, d_dtable.data());
  CHECK(on_host(d_out) == out);  // a gather: exact
  CHECK(relative_error(on_host(d_dtable), dtable) < kTol);
}

TEST_CASE("cross-entropy forward, building blocks and backward equal the Host ops; bad targets throw") {
  const Cuda b{};
  const std::int64_t tokens = 40, cols = 1100, valid = 1000, col_offset = 500;
  const auto logits = random_vector(tokens * cols, 4, -8.0f, 8.0f), dloss = random_vector(tokens, 5);
  std::vector<std::int32_t> targets(tokens);
  for (std::int64_t t = 0; t < tokens; ++t) targets[t] = std::int32_t((t * 131) % valid);
  targets[3] = -1;  // ignored
  auto d_logits = on_device(b, logits), d_dloss = on_device(b, dloss);
  auto d_targets = on_device(b, targets);

  // Single rank.
  std::vector<float> loss(tokens), mx(tokens), se(tokens), dlogits(logits.size());
  cross_entropy_forward(Host{}, logits.data(), targets.data(), tokens, cols, valid, loss.data(), mx.data(), se.data());
  cross_entropy_backward(Host{}, logits.data(), targets.data(), tokens, cols, valid, 0, mx.data(), se.data(),
                         dloss.data(), dlogits.data());
  DeviceBuffer<float> d_loss(b, tokens), d_mx(b, tokens), d_se(b, tokens), d_dlogits(b, logits.size());
  cross_entropy_forward(b, d_logits.data(), d_targets.data(), tokens, cols, valid, d_loss.data(), d_mx.data(),
                        d_se.data());
  cross_entropy_backward(b, d_logits.data(), d_targets.data(), tokens, cols, valid, 0, d_mx.data(), d_se.data(),
                         d_dloss.data(), d_dlogits.data());
  CHECK(on_host(d_mx) == mx);  // a maximum: exact
  CHECK(relative_error(on_host(d_se), se) < kTol);
  const auto got_loss = on_host(d_loss);
  CHECK(got_loss[3] == 0.0f);
  CHECK(relative_error(got_loss, loss) < kTol);
  const auto got_dlogits = on_host(d_dlogits);
  CHECK(relative_error(got_dlogits, dlogits) < kTol);
  for (std::int64_t j = 0; j < cols; ++j) CHECK(got_dlogits[3 * cols + j] == 0.0f);  // the ignored row

  // This rank's vocab slice [col_offset, col_offset + cols): targets elsewhere give 0.
  std::vector<float> tl(tokens);
  gather_target_logit(Host{}, logits.data(), targets.data(), tokens, cols, col_offset, tl.data());
  DeviceBuffer<float> d_tl(b, tokens);
  gather_target_logit(b, d_logits.data(), d_targets.data(), tokens, cols, col_offset, d_tl.data());
  CHECK(on_host(d_tl) == tl);
  cross_entropy_backward(Host{}, logits.data(), targets.data(), tokens, cols, valid, col_offset, mx.data(), se.data(),
                         dloss.data(), dlogits.data());
  cross_entropy_backward(b, d_logits.data(), d_targets.data(), tokens, cols, valid, col_offset, d_mx.data(),
                         d_se.data(), d_dloss.data(), d_logits.data());  // in place: dlogits == logits
  CHECK(relative_error(on_host(d_logits), dlogits) < kTol);

  // A target past the valid columns is refused, naming it.
  targets[7] = std::int32_t(valid + 5);
  auto d_bad = on_device(b, targets);
  CHECK_THROWS_WITH_AS(cross_entropy_forward(b, d_dlogits.data(), d_bad.data(), tokens, cols, valid, d_loss.data(),
                                             d_mx.data(), d_se.data()),
                       "cross_entropy_forward: 1 targets >= valid=1000 (largest 1005)", dsp::Error);
}
