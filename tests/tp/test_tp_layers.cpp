// Tensor-parallel layers against their TP1 results: a ColumnParallelLinear -> RowParallelLinear
// pair (one all-reduce forward, one backward), gather_output / input_is_parallel=false, and the
// vocab-parallel embedding + cross-entropy with vocabulary padding. Inputs and weights are
// drawn per global index, so every TP size computes the same global function; tolerance
// 1e-5 relative (norm-wise) covers the different summation order of the TP all-reduce.
#include <doctest/doctest.h>

#include <cmath>
#include <mutex>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/policy.hpp"
#include "dsp/tp/column_parallel_linear.hpp"
#include "dsp/tp/row_parallel_linear.hpp"
#include "dsp/tp/vocab_parallel_cross_entropy.hpp"
#include "dsp/tp/vocab_parallel_embedding.hpp"
#include "../gather_global.hpp"
#include "../relative_error.hpp"

using namespace dsp;

namespace tp_tp_layers_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

Tensor input(std::int64_t rows, std::int64_t cols) {
  Tensor x({rows, cols});
  const CounterRng rng(5, "input");
  for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = static_cast<float>(rng.normal(static_cast<std::uint64_t>(i)));
  return x;
}

struct PairResult {
  Tensor y, dx, w1, w2;  // output, input gradient, gathered weight gradients
};

// y = Row(Column(x)), backward with dy = y; gradients gathered to global tensors.
PairResult run_pair(int tp, bool gather_output) {
  PairResult out;
  std::mutex mu;
  comm::launch(tp, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
    auto& g = mesh.tensor_group();
    tp::ColumnParallelLinear<P> col(g, ShardedTensor::split("w1", {8, 6}, 0), {dsp::Init::Normal, 0.5f}, 3,
                                    gather_output);
    tp::RowParallelLinear<P> row(g, ShardedTensor::split("w2", {5, 8}, 1), {dsp::Init::Normal, 0.5f}, 3,
                                 /*input_is_parallel=*/!gather_output);
    const Tensor x = input(4, 6);
    const Tensor h = col.forward(x);
    const Tensor y = row.forward(h);
    const Tensor dh = row.backward(h, y);
    const Tensor dx = col.backward(x, dh);
    Tensor w1 = test::gather_global(g, col.weight().spec, col.weight().grad);
    Tensor w2 = test::gather_global(g, row.weight().spec, row.weight().grad);
    std::lock_guard lk(mu);
    if (g.rank() == 0) out = {y, dx, w1, w2};
  });
  return out;
}

}  // namespace

TEST_CASE("Column -> Row parallel pair equals TP1 in output, input gradient and weight gradients") {
  for (bool gather : {false, true}) {
    const PairResult ref = run_pair(1, gather);
    for (int tp : {2, 4}) {
      CAPTURE(tp);
      CAPTURE(gather);
      const PairResult r = run_pair(tp, gather);
      CHECK(test::relative_error(r.y, ref.y) < 1e-5);
      CHECK(test::relative_error(r.dx, ref.dx) < 1e-5);
      CHECK(test::relative_error(r.w1, ref.w1) < 1e-5);
      CHECK(test::relative_error(r.w2, ref.w2) < 1e-5);
    }
  }
}

TEST_CASE("vocab-parallel embedding and cross-entropy: padding never contributes, TP equals TP1") {
  // vocab 5 at TP 4 -> padded to 8: rank 3 holds only padding. The loss of uniform logits is
  // log(5), not log(8); the gathered gradient has no mass on padding columns.
  std::vector<double> losses;
  std::mutex mu;
  for (int tp : {1, 2, 4})
    comm::launch(tp, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
      auto& g = mesh.tensor_group();
      tp::VocabParallelEmbedding<P> embed(g, "embed", 5, 3, {dsp::Init::Normal, 1.0f}, 9);
      const Tensor e = embed.forward({0, 4, 2});
      tp::VocabParallelCrossEntropy<P> ce(g, 5);
      Tensor zeros({3, embed.rows_local()});  // uniform logits over this rank's columns
      tp::VocabParallelCrossEntropy<P>::Saved saved;
      const auto loss = ce.forward(zeros, {1, 4, -1}, saved);
      const Tensor dz = ce.backward(zeros, {1, 4, -1}, Tensor({3}, {1.0f, 1.0f, 1.0f}), saved);
      std::lock_guard lk(mu);
      CHECK(loss[0] == doctest::Approx(std::log(5.0)).epsilon(1e-6));
      CHECK(loss[2] == 0.0f);  // ignored target
      for (std::int64_t c = 0; c < embed.rows_local(); ++c) {
        const std::int64_t global = c + embed.row_offset();
        const float want = global >= 5 ? 0.0f : 0.2f - (global == 1 ? 1.0f : 0.0f);
        CHECK(dz[c] == doctest::Approx(want).epsilon(1e-6));      // row 0, target 1
        CHECK(dz[2 * embed.rows_local() + c] == 0.0f);             // ignored row
      }
      if (g.rank() == 0) losses.push_back(double(e[3 * 1 + 2]));  // embedding of token 4, column 2
    });
  REQUIRE(losses.size() == 3);
  CHECK(losses[1] == losses[0]);  // embedding lookups are exact copies on every layout
  CHECK(losses[2] == losses[0]);
}

}  // namespace tp_tp_layers_test
