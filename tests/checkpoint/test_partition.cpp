// Partition files (ZeRO's per-rank optimizer state): the moments of the fake model saved as
// contiguous element ranges of their TP shards over 3 data-parallel ranks (uneven: most
// shards do not divide by 3), the parameters as ordinary shard files. Checked against the
// global tensors the fake model was cut from: load_global, read_local at the saved and at
// other TP sizes (ranges crossing partition boundaries), reshard; the save refuses partitions
// that leave a gap or overlap, naming the tensor and the elements; loading names a missing
// partition file and a manifest whose ranges are not the file's own.
#include <doctest/doctest.h>

#include <functional>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dsp/checkpoint/load.hpp"
#include "dsp/checkpoint/reshard.hpp"
#include "dsp/checkpoint/save.hpp"
#include "dsp/dp/partition.hpp"
#include "fixture.hpp"

using namespace checkpoint_test;

namespace checkpoint_partition_test {
using dsp::CheckpointError;
using namespace dsp::checkpoint;

namespace {

constexpr int tp = 2, dp = 3;

bool is_moment(const ShardedTensor& s) { return is_optimizer_state(s.name); }

// [begin, end) of each moment's TP shard that DP rank d writes: dp::shard_range by default.
using RangeOf = std::function<ElementRange(std::int64_t numel, int d)>;
ElementRange zero_range(std::int64_t numel, int d) {
  const auto r = dsp::dp::shard_range(numel, dp, d);
  return {r.begin, r.end()};
}

// Saves the fake model at TP 2 x DP 3: parameters in shard files, moments in partition files.
void save_partitioned(const fs::path& dir, const std::vector<ShardedTensor>& specs,
                      const std::map<std::string, Tensor>& globals, const RangeOf& range_of = zero_range) {
  std::vector<ShardedTensor> params, moments;
  for (const auto& s : specs) (is_moment(s) ? moments : params).push_back(s);
  AtomicDir staging(dir);
  for (int t = 0; t < tp; ++t) {
    write_shard_file(staging.tmp_path(), make_rank_state(params, &globals, tp, t).state, tp, t, 0);
    const RankState local = make_rank_state(moments, &globals, tp, t);
    for (int d = 0; d < dp; ++d) {
      Partition part;
      for (std::size_t k = 0; k < moments.size(); ++k) {
        const Tensor& shard = local.locals[k];
        const auto [begin, end] = range_of(shard.numel(), d);
        if (end > begin)
          part.push_back({moments[k], begin, std::span<const float>(shard.data() + begin, static_cast<std::size_t>(end - begin))});
      }
      write_partition_file(staging.tmp_path(), part, tp, t, 0, d);
    }
  }
  write_manifest_and_commit(staging, fake_meta(tp, dp));
}

}  // namespace

TEST_CASE("partition files: load_global, read_local at TP 1, 2 and 4, and reshard give exactly the global tensors") {
  TempDir tmp;
  const auto specs = fake_specs();
  const auto globals = fake_globals(specs);
  const auto dir = tmp / "ckpt";
  save_partitioned(dir, specs, globals);

  const Manifest m = load_manifest(dir);
  CHECK(m.files.size() == tp + tp * dp);
  const FileRecord& r = m.files.at(partition_file_name(1, 0, 2));
  CHECK(r.dp_rank == 2);
  CHECK(r.ranges.at("optimizer.exp_avg." + qkv_name) ==
        zero_range(dsp::numel(specs[1].local_shape(tp)), 2));

  const GlobalCheckpoint all = load_global(dir);
  for (const auto& [name, t] : globals) CHECK_MESSAGE(same(all.tensors.at(name), t), name);

  const CheckpointReader reader(dir);
  for (int target : {1, 2, 4})
    for (const ShardedTensor& s : specs)
      for (int rank = 0; rank < target; ++rank) {
        const Tensor shard = dsp::shard_of(s, globals.at(s.name), target, rank);
        const std::int64_t begin = shard.numel() / 3, count = shard.numel() / 2;  // crosses a boundary
        std::vector<float> got(static_cast<std::size_t>(count));
        reader.read_local(s.name, target, rank, begin, got);
        CHECK_MESSAGE(std::equal(got.begin(), got.end(), shard.data() + begin), s.name, " TP ", target, " rank ", rank);
      }
  std::vector<float> past(2);
  CHECK_THROWS_AS(reader.read_local(specs.back().name, tp, 0, dsp::numel(specs.back().local_shape(tp)) - 1, past),
                  CheckpointError);

  reshard(dir, tmp / "tp4", 4, 1);
  const GlobalCheckpoint resharded = load_global(tmp / "tp4");
  for (const auto& [name, t] : globals) CHECK_MESSAGE(same(resharded.tensors.at(name), t), name);
}

TEST_CASE("partitions that leave a gap or overlap are refused at save; a missing partition file is named at load") {
  TempDir tmp;
  const auto specs = fake_specs();
  const auto globals = fake_globals(specs);
  SUBCASE("gap") {
    const auto msg = message_of<CheckpointError>([&] {
      save_partitioned(tmp / "gap", specs, globals, [](std::int64_t n, int d) {
        auto r = zero_range(n, d);
        if (d == 1) r.first += 1;  // element ceil(n / 3) is nobody's
        return r;
      });
    });
    CHECK_MESSAGE(msg.find("no partition file holds elements [") != std::string::npos, msg);
    CHECK_MESSAGE(msg.find("tensor optimizer.") != std::string::npos, msg);
  }
  SUBCASE("overlap") {
    const auto msg = message_of<CheckpointError>([&] {
      save_partitioned(tmp / "overlap", specs, globals, [](std::int64_t n, int d) {
        auto r = zero_range(n, d);
        if (d == 1) r.first -= 1;
        return r;
      });
    });
    CHECK_MESSAGE(msg.find("partition files overlap at element ") != std::string::npos, msg);
  }
  SUBCASE("missing file") {
    save_partitioned(tmp / "ckpt", specs, globals);
    const auto file = tmp / "ckpt" / partition_file_name(0, 0, 1);
    fs::remove(file);
    const auto msg = message_of<CheckpointError>([&] { load_global(tmp / "ckpt"); });
    CHECK_MESSAGE(msg.find(file.string()) != std::string::npos, msg);
    CHECK_MESSAGE(msg.find("missing") != std::string::npos, msg);
  }
  SUBCASE("manifest ranges that are not the file's") {
    save_partitioned(tmp / "ckpt", specs, globals);
    Manifest m = read_manifest(tmp / "ckpt");
    auto& a = m.files.at(partition_file_name(0, 0, 0)).ranges;
    auto& b = m.files.at(partition_file_name(0, 0, 1)).ranges;
    const std::string name = "optimizer.exp_avg." + qkv_name;
    std::swap(a.at(name), b.at(name));  // both still tile the shard
    write_manifest(tmp / "ckpt", m);
    const auto msg = message_of<CheckpointError>([&] { load_global(tmp / "ckpt"); });
    CHECK_MESSAGE(msg.find(partition_file_name(0, 0, 0)) != std::string::npos, msg);
    CHECK_MESSAGE(msg.find("metadata's ranges") != std::string::npos, msg);
  }
  for (const auto& name : tmp.names()) CHECK_MESSAGE(name == "ckpt", name);  // nothing half-written stays
}

}  // namespace checkpoint_partition_test
