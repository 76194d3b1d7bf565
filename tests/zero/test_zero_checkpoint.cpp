// ZeRO checkpoints are saved per partition: every rank writes the moment slices it owns to its
// own file, and no rank gathers a moment to save it. The files are checked against the
// partition formula (dp::shard_range), the memory counters and, for loading at another TP,
// PP, DP and expert-parallel size and ZeRO stage, against the saving run's state made whole
// by plain all-gathers (test::collect_state). Loading moves data only, so the loaded state
// must equal the saved one bitwise (tolerance 0).
#include <doctest/doctest.h>

#include <filesystem>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <unistd.h>

#include "dsp/backend/host.hpp"
#include "dsp/checkpoint/manifest.hpp"
#include "dsp/checkpoint/save.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/checkpointing.hpp"
#include "dsp/train/trainer.hpp"
#include "dsp/dp/partition.hpp"
#include "../train/small_model.hpp"
#include "../train/small_train_config.hpp"
#include "run_result.hpp"

using namespace dsp;

namespace zero_zero_checkpoint_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

struct Layout {
  int tp = 1, pp = 1, dp = 1, ep = 1;
  int zero = 0;
  std::int64_t global_batch = 8;
  ParallelLayout parallel() const { return {.tensor = tp, .pipeline = pp, .data = dp, .expert = ep}; }
};

std::filesystem::path temp_dir(const std::string& what) {
  auto dir = std::filesystem::temp_directory_path() / ("dsp_zero_" + what + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

train::TrainConfig train_config(const Layout& l) {
  train::TrainConfig tc = test::small_train_config(l.global_batch, 6);
  tc.zero_stage = l.zero;
  return tc;
}

// Trains `steps` steps at `l`, saves to `dir` (when not empty), and returns every global
// parameter and moment.
test::Params train_and_save(const model::ModelConfig& config, const Layout& l, int steps,
                            const std::filesystem::path& dir) {
  test::Params out;
  std::mutex mu;
  comm::launch(l.tp * l.pp * l.dp, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, l.parallel());
    train::Trainer<P> trainer(config, train_config(l), mesh, test::shakespeare(config.seq_length));
    for (int s = 0; s < steps; ++s) trainer.train_step();
    if (!dir.empty()) train::save_checkpoint(dir, trainer);
    test::collect_state(trainer, mesh, l.ep, mu, out);
  });
  return out;
}

// Every global parameter and moment after loading `dir` at `l`.
test::Params load(const model::ModelConfig& config, const Layout& l, const std::filesystem::path& dir) {
  test::Params out;
  std::mutex mu;
  comm::launch(l.tp * l.pp * l.dp, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, l.parallel());
    train::Trainer<P> trainer(config, train_config(l), mesh, test::shakespeare(config.seq_length));
    train::load_checkpoint(dir, trainer);
    test::collect_state(trainer, mesh, l.ep, mu, out);
  });
  return out;
}

// Loads `dir` at each layout and checks the state equals `saved` bitwise.
void check_loads_exactly(const model::ModelConfig& config, const std::filesystem::path& dir,
                         const test::Params& saved, std::initializer_list<Layout> layouts) {
  for (const Layout& l : layouts) {
    CAPTURE(l.tp);
    CAPTURE(l.pp);
    CAPTURE(l.dp);
    CAPTURE(l.ep);
    CAPTURE(l.zero);
    CHECK(test::relative_error(load(config, l, dir), saved) == 0.0);
  }
}

}  // namespace

TEST_CASE("ZeRO 2 at TP 2 x DP 4: each rank saves its own moment slices, unpadded, without gathering them") {
  const auto config = test::small_model();
  const Layout l{.tp = 2, .dp = 4, .zero = 2};
  const auto dir = temp_dir("slices");
  std::map<std::string, std::int64_t> local_numel;  // parameter -> elements of its TP shard
  std::mutex mu;
  comm::launch(8, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, l.parallel());
    train::Trainer<P> trainer(config, train_config(l), mesh, test::shakespeare(config.seq_length));
    for (int s = 0; s < 3; ++s) trainer.train_step();
    memory::reset_peak();
    const memory::Snapshot before = memory::snapshot();
    train::save_checkpoint(dir, trainer);
    const memory::Snapshot after = memory::snapshot();
    for (auto c : {memory::Category::OptimizerState, memory::Category::Communication, memory::Category::Parameters})
      CHECK(after[c].peak == before[c].live);  // nothing gathered, nothing copied
    std::lock_guard lk(mu);
    for (auto* p : trainer.optimizer().parameters()) local_numel[p->spec.name] = p->value.numel();
  });
  const checkpoint::Manifest m = checkpoint::load_manifest(dir);
  CHECK(m.meta.extra.at("zero_stage") == 2);
  CHECK(m.files.size() == 2 + 8);  // 2 model files, one partition file per rank
  for (int t = 0; t < 2; ++t)
    for (int d = 0; d < 4; ++d) {
      CAPTURE(t);
      CAPTURE(d);
      const checkpoint::FileRecord& r = m.files.at(checkpoint::partition_file_name(t, 0, d));
      CHECK(r.dp_rank == d);
      CHECK(r.tp_rank == t);
      REQUIRE(r.ranges.size() == 2 * local_numel.size());  // both moments of every parameter
      for (const auto& [name, n] : local_numel) {
        const dp::ShardRange owned = dp::shard_range(n, 4, d);
        for (const std::string moment : {"exp_avg.", "exp_avg_sq."})
          CHECK(r.ranges.at("optimizer." + moment + name) == checkpoint::ElementRange{owned.begin, owned.end()});
      }
    }
  for (int t = 0; t < 2; ++t) {  // the model files hold parameters only
    const auto& model = m.files.at(checkpoint::shard_file_name(t, 0));
    CHECK_FALSE(model.partition());
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("a ZeRO 2 checkpoint of TP 2 x DP 2 loads exactly at other DP, TP and PP sizes and ZeRO stages") {
  const auto config = test::small_model();
  const auto dir = temp_dir("relayout");
  const test::Params saved = train_and_save(config, Layout{.tp = 2, .dp = 2, .zero = 2}, 3, dir);
  check_loads_exactly(config, dir, saved,
                      {Layout{.tp = 2, .dp = 4, .zero = 1},  // same TP: each rank reads its own range
                       Layout{.tp = 2, .dp = 1, .zero = 0},  // the whole moments
                       Layout{.tp = 1, .dp = 4, .zero = 3},  // another TP: assembled, then cut
                       Layout{.tp = 1, .pp = 2, .dp = 2, .zero = 2}});
  std::filesystem::remove_all(dir);
}

TEST_CASE("MoE: expert moments are saved per expert-data-parallel slice and load at other EP and DP sizes") {
  const auto config = test::small_moe_model();
  const auto dir = temp_dir("moe");
  const test::Params saved = train_and_save(config, Layout{.dp = 4, .ep = 2, .zero = 2}, 3, dir);
  const checkpoint::Manifest m = checkpoint::read_manifest(dir);
  // Expert e lives on expert rank e / (experts / 2); its moments are split over the 2 DP ranks
  // holding it (DP ranks r with r % 2 equal): each partition file holds half of each of its experts.
  const std::int64_t per_rank = config.num_experts / 2;
  for (int d = 0; d < 4; ++d) {
    const auto& ranges = m.files.at(checkpoint::partition_file_name(0, 0, d)).ranges;
    for (const auto& [name, range] : ranges) {
      const auto e = model::expert_index(name);
      if (!e) continue;
      CAPTURE(name);
      CHECK(*e / per_rank == d % 2);
      const dp::ShardRange owned = dp::shard_range(numel(m.find(name)->local_shape(1)), 2, d / 2);
      CHECK(range == checkpoint::ElementRange{owned.begin, owned.end()});
    }
  }
  check_loads_exactly(config, dir, saved,
                      {Layout{.dp = 2, .ep = 1, .zero = 1}, Layout{.dp = 4, .ep = 4, .zero = 3},
                       Layout{.dp = 2, .ep = 2, .zero = 0}});
  std::filesystem::remove_all(dir);
}

TEST_CASE("at ZeRO 0 one replica saves the moments whole; they load at ZeRO 3 on DP 4") {
  const auto config = test::small_model();
  const auto dir = temp_dir("stage0");
  const test::Params saved = train_and_save(config, Layout{.dp = 2, .zero = 0}, 3, dir);
  const checkpoint::Manifest m = checkpoint::read_manifest(dir);
  CHECK(m.files.size() == 2);  // the model file and replica 0's partition file
  CHECK(m.files.contains(checkpoint::partition_file_name(0, 0, 0)));
  check_loads_exactly(config, dir, saved, {Layout{.dp = 4, .zero = 3}});
  std::filesystem::remove_all(dir);
}

TEST_CASE("ranks that own only padding of a small parameter save nothing of it and still load (hidden 8 at DP 6)") {
  // The norms' 8 elements over 6 ranks: slices of ceil(8 / 6) = 2, so DP ranks 4 and 5 own none.
  auto config = test::small_model();
  config.hidden_size = 8;
  config.num_attention_heads = 2;
  config.num_query_groups = 2;
  config.ffn_hidden_size = 16;
  const auto dir = temp_dir("padding");
  const Layout saver{.dp = 6, .zero = 1, .global_batch = 12};
  const test::Params saved = train_and_save(config, saver, 2, dir);
  const checkpoint::Manifest m = checkpoint::read_manifest(dir);
  const auto& ranges = m.files.at(checkpoint::partition_file_name(0, 0, 5)).ranges;
  CHECK_FALSE(ranges.contains("optimizer.exp_avg.model.norm.weight"));
  check_loads_exactly(config, dir, saved, {saver, Layout{.dp = 4, .zero = 2}, Layout{.dp = 1, .zero = 3}});
  std::filesystem::remove_all(dir);
}

}  // namespace zero_zero_checkpoint_test
