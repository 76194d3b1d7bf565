// Save and load: per-rank files + manifest, loading at any TP, verification before use,
// model mismatch messages, and atomicity of a failing save.
#include <doctest/doctest.h>

#include <string>
#include <thread>
#include <vector>

#include "dsp/checkpoint/load.hpp"
#include "dsp/checkpoint/save.hpp"
#include "fixture.hpp"

using namespace checkpoint_test;

namespace checkpoint_save_load_test {
using dsp::CheckpointError;
using dsp::ConfigError;
using namespace dsp::checkpoint;

namespace {

// Loads `dir` into fresh zero tensors at (tp, rank) and checks them against shard_of(global).
void check_loads_exactly(const fs::path& dir, const std::vector<ShardedTensor>& specs,
                         const std::map<std::string, Tensor>& globals, int tp) {
  for (int r = 0; r < tp; ++r) {
    RankState target = make_rank_state(specs, nullptr, tp, r);
    load_into(dir, target.state, tp, r);
    for (std::size_t k = 0; k < specs.size(); ++k)
      CHECK_MESSAGE(same(target.locals[k], dsp::shard_of(specs[k], globals.at(specs[k].name), tp, r)),
                    specs[k].name, " at TP ", tp, " rank ", r);
  }
}

bool all_zero(const RankState& s) {
  for (const Tensor& t : s.locals)
    for (float v : t.values())
      if (v != 0.0f) return false;
  return true;
}

}  // namespace

TEST_CASE("save at TP2, load_into at TP1, TP2 and TP4 gives exactly shard_of the global tensors") {
  TempDir tmp;
  const auto specs = fake_specs();
  const auto globals = fake_globals(specs);
  const auto ranks = make_tp_states(specs, globals, 2);
  const auto dir = tmp / "ckpt";
  save_all(dir, states_of(ranks), fake_meta(2, 3));

  for (int tp : {1, 2, 4}) check_loads_exactly(dir, specs, globals, tp);

  const Manifest m = load_manifest(dir);
  const auto meta = fake_meta(2, 3);
  CHECK(m.meta.layout == meta.layout);
  CHECK(m.meta.iteration == 1234);
  CHECK(m.meta.model_config == meta.model_config);
  CHECK(m.meta.extra == meta.extra);
  CHECK(m.tensors == specs);
  REQUIRE(m.files.size() == 2);
  const FileRecord& rec = m.files.at("model_tp01_pp000.safetensors");
  CHECK(rec.tp_rank == 1);
  CHECK(rec.size == fs::file_size(dir / "model_tp01_pp000.safetensors"));
  CHECK(rec.crc32 == digest_file(dir / "model_tp01_pp000.safetensors").crc32);
  // Each rank's file holds its local shards under the spec names.
  const auto f = read_safetensors(dir / "model_tp01_pp000.safetensors");
  CHECK(same(f.tensor(qkv_name), dsp::shard_of(specs[1], globals.at(qkv_name), 2, 1)));
  CHECK(f.metadata().at("tp_rank") == "1");
  CHECK(tmp.names() == std::vector<std::string>{"ckpt"});
  CHECK(fs::exists(dir / "manifest.json"));
  CHECK(!fs::exists(dir / "model_tp00_pp000.safetensors.info.json"));
}

TEST_CASE("a TP4 save (KV heads replicated) loads at TP2 and TP1; load_global gives the global tensors") {
  TempDir tmp;
  const auto specs = fake_specs();
  const auto globals = fake_globals(specs);
  const auto ranks = make_tp_states(specs, globals, 4);
  save_all(tmp / "tp4", states_of(ranks), fake_meta(4));
  for (int tp : {1, 2, 4}) check_loads_exactly(tmp / "tp4", specs, globals, tp);
  const GlobalCheckpoint all = load_global(tmp / "tp4");
  REQUIRE(all.tensors.size() == globals.size());
  for (const auto& [name, t] : globals) CHECK_MESSAGE(same(all.tensors.at(name), t), name);
}

TEST_CASE("two-phase save: TP2 x PP2 ranks as threads write their own files, one rank commits") {
  TempDir tmp;
  const auto specs = fake_specs();
  const auto globals = fake_globals(specs);
  // Stage 0 holds the first three tensors, stage 1 the rest.
  const std::vector<std::vector<ShardedTensor>> stage_specs = {{specs.begin(), specs.begin() + 3},
                                                               {specs.begin() + 3, specs.end()}};
  CheckpointMeta meta = fake_meta(2);
  meta.layout.pipeline = 2;
  AtomicDir staging(tmp / "ckpt");
  std::vector<std::thread> threads;
  for (int pp = 0; pp < 2; ++pp)
    for (int tp = 0; tp < 2; ++tp)
      threads.emplace_back([&, pp, tp] {
        const RankState s = make_rank_state(stage_specs[static_cast<std::size_t>(pp)], &globals, 2, tp);
        write_shard_file(staging.tmp_path(), s.state, 2, tp, pp);
      });
  for (auto& t : threads) t.join();
  write_manifest_and_commit(staging, meta);

  const GlobalCheckpoint all = load_global(tmp / "ckpt");
  CHECK(all.manifest.files.size() == 4);
  CHECK(all.manifest.files.at("model_tp01_pp001.safetensors").pp_rank == 1);
  CHECK(all.manifest.tensors == specs);
  for (const auto& [name, t] : globals) CHECK_MESSAGE(same(all.tensors.at(name), t), name);
  check_loads_exactly(tmp / "ckpt", specs, globals, 4);
}

TEST_CASE("truncated, corrupted and missing files are detected before any data is used") {
  TempDir tmp;
  const auto specs = fake_specs();
  const auto globals = fake_globals(specs);
  const auto ranks = make_tp_states(specs, globals, 2);
  const auto dir = tmp / "ckpt";
  const auto shard = dir / "model_tp01_pp000.safetensors";
  RankState target = make_rank_state(specs, nullptr, 2, 0);

  SUBCASE("truncated shard file") {
    save_all(dir, states_of(ranks), fake_meta(2));
    const auto size = fs::file_size(shard);
    fs::resize_file(shard, size - 5);
    const auto msg = message_of<CheckpointError>([&] { load_into(dir, target.state, 2, 0); });
    CHECK_MESSAGE(msg.find(shard.string()) != std::string::npos, msg);
    CHECK_MESSAGE(msg.find("size is " + std::to_string(size - 5)) != std::string::npos, msg);
    CHECK_MESSAGE(msg.find("expects " + std::to_string(size)) != std::string::npos, msg);
  }
  SUBCASE("one corrupted byte") {
    save_all(dir, states_of(ranks), fake_meta(2));
    const auto expected = crc32_hex(load_manifest(dir).files.at(shard.filename().string()).crc32);
    corrupt_byte(shard, 3);
    const auto msg = message_of<CheckpointError>([&] { load_into(dir, target.state, 2, 0); });
    CHECK_MESSAGE(msg.find(shard.string()) != std::string::npos, msg);
    CHECK_MESSAGE(msg.find("crc32 is " + crc32_hex(digest_file(shard).crc32)) != std::string::npos, msg);
    CHECK_MESSAGE(msg.find("expects " + expected) != std::string::npos, msg);
  }
  SUBCASE("missing shard file") {
    save_all(dir, states_of(ranks), fake_meta(2));
    fs::remove(shard);
    const auto msg = message_of<CheckpointError>([&] { load_global(dir); });
    CHECK_MESSAGE(msg.find(shard.string()) != std::string::npos, msg);
    CHECK_MESSAGE(msg.find("missing") != std::string::npos, msg);
  }
  SUBCASE("missing manifest") {
    save_all(dir, states_of(ranks), fake_meta(2));
    fs::remove(dir / "manifest.json");
    CHECK(message_of<CheckpointError>([&] { load_into(dir, target.state, 2, 0); }) ==
          "no manifest.json in " + dir.string());
  }
  SUBCASE("manifest of another format") {
    save_all(dir, states_of(ranks), fake_meta(2));
    write_text(dir / "manifest.json", R"({"format": "other", "version": 1})");
    const auto msg = message_of<CheckpointError>([&] { load_global(dir); });
    CHECK_MESSAGE(msg.find("not a dsp-checkpoint manifest") != std::string::npos, msg);
  }
  SUBCASE("truncated manifest") {
    save_all(dir, states_of(ranks), fake_meta(2));
    write_text(dir / "manifest.json", R"({"format": "dsp-checkpoint", "vers)");
    CHECK(message_of<CheckpointError>([&] { load_global(dir); }) ==
          (dir / "manifest.json").string() + ": not valid JSON (truncated?)");
  }
  CHECK(all_zero(target));
}

TEST_CASE("loading into a different model names the tensors and both shapes") {
  TempDir tmp;
  const auto specs = fake_specs();
  const auto globals = fake_globals(specs);
  const auto dir = tmp / "ckpt";
  save_all(dir, states_of(make_tp_states(specs, globals, 2)), fake_meta(2));

  auto other = specs;
  SUBCASE("another vocabulary size") {
    other[0] = ShardedTensor::vocab("model.embed_tokens.weight", {66, 6});
    RankState target = make_rank_state(other, nullptr, 2, 0);
    CHECK(message_of<CheckpointError>([&] { load_into(dir, target.state, 2, 0); }) ==
          "checkpoint " + dir.string() +
              " has a different model: tensor model.embed_tokens.weight has shape [65, 6], model expects [66, 6]");
    CHECK(all_zero(target));
  }
  SUBCASE("same shape, another split") {
    other[2] = ShardedTensor::split(other[2].name, other[2].global_shape, 0);
    RankState target = make_rank_state(other, nullptr, 2, 0);
    const auto msg = message_of<CheckpointError>([&] { load_into(dir, target.state, 2, 0); });
    CHECK_MESSAGE(msg.find("tensor model.layers.0.self_attn.o_proj.weight is split as") != std::string::npos, msg);
  }
  SUBCASE("tensors the checkpoint lacks are all named") {
    other.push_back(ShardedTensor::replicated("model.layers.1.input_layernorm.weight", {6}));
    other.push_back(ShardedTensor::replicated("model.layers.1.post_attention_layernorm.weight", {6}));
    RankState target = make_rank_state(other, nullptr, 2, 0);
    const auto msg = message_of<CheckpointError>([&] { load_into(dir, target.state, 2, 0); });
    CHECK_MESSAGE(msg.find("has no tensor(s) model.layers.1.input_layernorm.weight, "
                           "model.layers.1.post_attention_layernorm.weight") != std::string::npos,
                  msg);
  }
  SUBCASE("a TP size the model cannot be split into") {
    RankState target = make_rank_state(specs, nullptr, 2, 0);
    const auto msg = message_of<ConfigError>([&] { load_into(dir, target.state, 3, 0); });
    CHECK_MESSAGE(msg.find("(4) is not divisible by tensor-model-parallel-size (3)") != std::string::npos, msg);
  }
}

TEST_CASE("a failing save leaves the existing checkpoint intact and no temporary directory") {
  TempDir tmp;
  const auto specs = fake_specs();
  const auto globals = fake_globals(specs);
  const auto dir = tmp / "ckpt";
  save_all(dir, states_of(make_tp_states(specs, globals, 2)), fake_meta(2));

  SUBCASE("rank 1's state is bad after rank 0's file was written") {
    auto changed = fake_globals(specs);
    for (auto& [name, t] : changed) t.fill(-1.0f);
    auto ranks = make_tp_states(specs, changed, 2);
    ranks[1].locals[2] = Tensor({1});
    CheckpointMeta meta = fake_meta(2);
    meta.iteration = 9999;
    CHECK_THROWS_AS(save_all(dir, states_of(ranks), meta), dsp::Error);
  }
  SUBCASE("phase 2 finds a rank's file missing") {
    AtomicDir staging(dir);
    write_shard_file(staging.tmp_path(), make_rank_state(specs, &globals, 2, 0).state, 2, 0, 0);
    const auto msg = message_of<CheckpointError>([&] { write_manifest_and_commit(staging, fake_meta(2)); });
    CHECK_MESSAGE(msg.find("no model_tp01_pp000.safetensors") != std::string::npos, msg);
  }
  CHECK(tmp.names() == std::vector<std::string>{"ckpt"});
  CHECK(load_manifest(dir).meta.iteration == 1234);
  check_loads_exactly(dir, specs, globals, 2);
}

}  // namespace checkpoint_save_load_test
