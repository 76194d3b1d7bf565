// ParallelLayout validation, DeviceMesh rank order and groups (Megatron order), ShardedTensor
// index maps, sharding round trips and ownership.
#include <doctest/doctest.h>

#include <algorithm>
#include <mutex>
#include <set>

#include "dsp/comm/launch.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/parallel/sharded_tensor.hpp"

using namespace dsp;

namespace parallel_parallel_test {

TEST_CASE("ParallelLayout fills in the data-parallel size and names the numbers when it cannot") {
  CHECK(ParallelLayout{.tensor = 2}.resolved(8).data == 4);
  CHECK(ParallelLayout{.tensor = 2, .pipeline = 2}.resolved(8).data == 2);
  CHECK_THROWS_WITH_AS(ParallelLayout{.tensor = 4}.resolved(6),
                       "world size 6 is not divisible by tensor-model-parallel-size x pipeline-model-parallel-size = 4 x 1 = 4",
                       ConfigError);
  const ParallelLayout bad{.tensor = 2, .data = 3};
  CHECK_THROWS_WITH_AS(bad.resolved(8),
                       "tensor (2) x pipeline (1) x data (3) = 6 does not equal the world size 8", ConfigError);
}

TEST_CASE("DeviceMesh: tensor rank fastest, then data, then pipeline; groups hold the right ranks") {
  const ParallelLayout layout{.tensor = 2, .pipeline = 2, .data = 2};
  std::mutex mu;
  comm::launch(8, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, layout);
    const int g = world.rank();
    {
      std::lock_guard lk(mu);
      CHECK(mesh.tp_rank() == g % 2);
      CHECK(mesh.dp_rank() == (g / 2) % 2);
      CHECK(mesh.pp_rank() == g / 4);
      CHECK(mesh.coord().global(layout) == g);
    }
    // each group sums the global ranks of its members: closed forms from the rank order
    std::vector<float> t{float(g)}, d{float(g)}, p{float(g)}, m{float(g)};
    mesh.tensor_group().all_reduce(std::span(t));
    mesh.data_group().all_reduce(std::span(d));
    mesh.pipeline_group().all_reduce(std::span(p));
    mesh.model_group().all_reduce(std::span(m));
    const int tp = g % 2, dp = (g / 2) % 2, pp = g / 4;
    std::lock_guard lk(mu);
    CHECK(t[0] == float(2 * (2 * dp + 4 * pp) + 1));  // tp 0 and 1 of (dp, pp)
    CHECK(d[0] == float(2 * (tp + 4 * pp) + 2));      // dp 0 and 1 of (tp, pp)
    CHECK(p[0] == float(2 * (tp + 2 * dp) + 4));      // pp 0 and 1 of (tp, dp)
    CHECK(m[0] == float(4 * 2 * dp + 0 + 1 + 4 + 5));  // tp x pp of replica dp
    CHECK(mesh.model_group().size() == 4);
  });
}

TEST_CASE("QKV is split per KV group; K/V heads are replicated when kv heads < TP") {
  // 8 query heads, 2 KV heads, head dim 1: rows [q0..q7 | k0 k1 | v0 v1]
  const auto spec = ShardedTensor::qkv("qkv", 4, 8, 2, 1, {"q", "k", "v"});
  CHECK(spec.index_map(2, 1) == std::vector<std::int64_t>{4, 5, 6, 7, 9, 11});  // kv head 1
  CHECK(spec.index_map(4, 1) == std::vector<std::int64_t>{2, 3, 8, 10});        // kv head 0, shared with rank 0
  CHECK(spec.index_map(4, 2) == std::vector<std::int64_t>{4, 5, 9, 11});
  CHECK(spec.has_partial_replicas(4));
  CHECK(!spec.has_partial_replicas(2));
  // ownership counts every row once: K/V rows on the first rank that holds them
  CHECK(spec.owned(4, 1) == std::vector<char>{1, 1, 0, 0});
  CHECK(spec.owned(4, 2) == std::vector<char>{1, 1, 1, 1});
  CHECK_THROWS_WITH_AS(ShardedTensor::qkv("qkv", 4, 6, 3, 1, {"q", "k", "v"}).index_map(2, 0),
                       "number of query groups (3) and tensor-model-parallel-size (2) must divide one another",
                       ConfigError);
}

TEST_CASE("every kind shards and unshards exactly, and ownership covers each element once") {
  const std::vector<ShardedTensor> specs{
      ShardedTensor::replicated("norm", {6}),
      ShardedTensor::split("col", {8, 3}, 0),
      ShardedTensor::split("row", {3, 8}, 1),
      ShardedTensor::vocab("embed", {7, 3}),  // 7 rows: padded to 8 at TP 2 and 4
      ShardedTensor::gate_up("gate_up", 3, 4, {"gate", "up"}),
      ShardedTensor::qkv("qkv", 3, 4, 2, 2, {"q", "k", "v"}),
  };
  for (const auto& spec : specs)
    for (int tp : {1, 2, 4}) {
      CAPTURE(spec.name);
      CAPTURE(tp);
      Tensor global(spec.global_shape);
      for (std::int64_t i = 0; i < global.numel(); ++i) global[i] = float(i + 1);
      Tensor rebuilt;
      double owned_sum = 0;
      for (int r = 0; r < tp; ++r) {
        const Tensor local = shard_of(spec, global, tp, r);
        CHECK(local.shape() == spec.local_shape(tp));
        unshard_into(spec, local, tp, r, rebuilt);
        const auto w = ownership_weights(spec, tp, r);
        for (std::int64_t i = 0; i < local.numel(); ++i) owned_sum += w[i] * local[i];
      }
      CHECK(rebuilt.values() == global.values());
      CHECK(owned_sum == global.numel() * (global.numel() + 1) / 2.0);  // each element once; padding (0) ignored
    }
}

TEST_CASE("vocabulary padding rows are marked -1 and stay zero") {
  const auto spec = ShardedTensor::vocab("embed", {5, 2});
  CHECK(spec.index_map(4, 3) == std::vector<std::int64_t>{-1, -1});  // 5 -> 8 rows, 2 per rank
  CHECK(spec.index_map(4, 2) == std::vector<std::int64_t>{4, -1});
  Tensor global({5, 2});
  global.fill(3.0f);
  const Tensor last = shard_of(spec, global, 4, 2);
  CHECK(last.values() == Tensor::Storage{3.0f, 3.0f, 0.0f, 0.0f});
}

}  // namespace parallel_parallel_test
