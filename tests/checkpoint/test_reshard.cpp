// Reshard: TP2 -> TP4 -> TP1 is exact, the model files hold the model alone and the moments
// partition files (or nothing, with OptimizerState::Drop); the model then loads without the
// optimizer files; a target TP that does not divide writes nothing.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "dsp/checkpoint/load.hpp"
#include "dsp/checkpoint/reshard.hpp"
#include "dsp/checkpoint/save.hpp"
#include "fixture.hpp"

using namespace checkpoint_test;
using namespace dsp::checkpoint;

namespace checkpoint_reshard_test {

TEST_CASE("reshard TP2 -> TP4 -> TP1 is exact and keeps model_config, iteration and extra") {
  TempDir tmp;
  const auto specs = fake_specs();
  const auto globals = fake_globals(specs);
  save_all(tmp / "tp2", states_of(make_tp_states(specs, globals, 2)), fake_meta(2, 4));

  reshard(tmp / "tp2", tmp / "tp4", 4, 2);
  const Manifest m4 = load_manifest(tmp / "tp4");
  CHECK(m4.meta.layout == dsp::ParallelLayout{.tensor = 4, .pipeline = 1, .data = 2, .expert = 1});
  CHECK(m4.meta.iteration == 1234);
  CHECK(m4.meta.model_config == fake_meta(2).model_config);
  // extra is kept, plus the provenance of the first reshard (kept through later ones)
  auto extra = m4.meta.extra;
  REQUIRE(extra.contains("resharded_from"));
  CHECK(extra["resharded_from"]["checkpoint"] == fs::absolute(tmp / "tp2").lexically_normal().string());
  CHECK(extra["resharded_from"]["tensor"] == 2);
  extra.erase("resharded_from");
  CHECK(extra == fake_meta(2).extra);
  CHECK(m4.tensors == specs);
  CHECK(m4.files.size() == 8);
  for (int r = 0; r < 4; ++r) {  // model tensors in the model file, moments (whole shards) in the partition file
    const auto model = read_safetensors(tmp.path / "tp4" / shard_file_name(r, 0));
    const auto optim = read_safetensors(tmp.path / "tp4" / partition_file_name(r, 0, 0));
    CHECK(model.entries().size() + optim.entries().size() == specs.size());
    for (const ShardedTensor& s : specs) {
      const bool moment = is_optimizer_state(s.name);
      const auto& file = moment ? optim : model;
      REQUIRE_MESSAGE(file.contains(s.name), s.name, " rank ", r);
      Tensor shard = dsp::shard_of(s, globals.at(s.name), 4, r);
      if (moment) shard = Tensor(dsp::Shape{shard.numel()}, shard.values());  // a partition file's 1-D part
      CHECK_MESSAGE(same(file.tensor(s.name), shard), s.name, " rank ", r);
    }
  }

  reshard(tmp / "tp4", tmp / "tp1", 1, 1);
  const GlobalCheckpoint back = load_global(tmp / "tp1");
  CHECK(back.manifest.meta.layout.tensor == 1);
  CHECK(back.manifest.files.size() == 2);
  for (const auto& [name, t] : globals) CHECK_MESSAGE(same(back.tensors.at(name), t), name);
}

/// The specs and global tensors of fake_specs() without the optimizer's.
std::vector<ShardedTensor> model_specs() {
  auto specs = fake_specs();
  std::erase_if(specs, [](const ShardedTensor& s) { return is_optimizer_state(s.name); });
  return specs;
}

TEST_CASE("reshard without optimizer state writes the model alone; the model loads without the moments' files") {
  TempDir tmp;
  const auto specs = fake_specs();
  const auto globals = fake_globals(specs);
  save_all(tmp / "tp2", states_of(make_tp_states(specs, globals, 2)), fake_meta(2));
  reshard(tmp / "tp2", tmp / "full", 4, 1);
  // Break every moment: a serving load (ReadScope::Model) neither verifies nor reads their files.
  for (int r = 0; r < 4; ++r) fs::resize_file(tmp / "full" / partition_file_name(r, 0, 0), 10);
  reshard(tmp / "full", tmp / "serve", 2, 1, OptimizerState::Drop);

  const auto model = model_specs();
  const Manifest m = load_manifest(tmp / "serve");
  CHECK(m.tensors == model);
  CHECK(m.files.size() == 2);
  CHECK(m.meta.iteration == 1234);
  for (const auto& dir : {tmp / "full", tmp / "serve"})
    for (int tp : {1, 2, 4}) {
      RankState target = make_rank_state(model, nullptr, tp, tp - 1);
      load_into(dir, target.state, tp, tp - 1);
      for (std::size_t k = 0; k < model.size(); ++k)
        CHECK_MESSAGE(same(target.locals[k], dsp::shard_of(model[k], globals.at(model[k].name), tp, tp - 1)),
                      model[k].name, " TP ", tp, " from ", dir.filename().string());
    }
  // Reading the moments still verifies their files; a serving reader refuses to give them out.
  const std::string moment = "optimizer.exp_avg." + qkv_name;
  auto msg = message_of<dsp::CheckpointError>([&] { CheckpointReader reader(tmp / "full"); });
  CHECK_MESSAGE(msg.find(partition_file_name(0, 0, 0) + ": size is 10 bytes") != std::string::npos, msg);
  msg = message_of<dsp::CheckpointError>([&] { (void)CheckpointReader(tmp / "full", ReadScope::Model).global_tensor(moment); });
  CHECK_MESSAGE(msg.find(moment + " is optimizer state, and this reader was opened for the model only") !=
                    std::string::npos,
                msg);
  // A model-only reader fails a state with moments before writing any of its tensors.
  RankState with_moments = make_rank_state(specs, nullptr, 2, 0);
  msg = message_of<dsp::CheckpointError>(
      [&] { load_into(CheckpointReader(tmp / "full", ReadScope::Model), with_moments.state, 2, 0); });
  CHECK_MESSAGE(msg.find("is optimizer state") != std::string::npos, msg);
  for (const Tensor& t : with_moments.locals)
    CHECK(std::all_of(t.span().begin(), t.span().end(), [](float v) { return v == 0; }));
  msg = message_of<dsp::CheckpointError>([&] { (void)CheckpointReader(tmp / "serve").global_tensor(moment); });
  CHECK_MESSAGE(msg.find("no tensor " + moment) != std::string::npos, msg);
}

TEST_CASE("reshard to a TP the model cannot be split into fails before writing anything") {
  TempDir tmp;
  const auto specs = fake_specs();
  save_all(tmp / "tp2", states_of(make_tp_states(specs, fake_globals(specs), 2)), fake_meta(2));
  const auto msg = message_of<dsp::ConfigError>([&] { reshard(tmp / "tp2", tmp / "tp3", 3, 1); });
  CHECK_MESSAGE(msg.find("to TP 3: tensor " + qkv_name +
                         ": number of attention heads (4) is not divisible by tensor-model-parallel-size (3)") != std::string::npos,
                msg);
  CHECK_THROWS_AS(reshard(tmp / "tp2", tmp / "dp0", 2, 0), dsp::ConfigError);
  CHECK(tmp.names() == std::vector<std::string>{"tp2"});
}

}  // namespace checkpoint_reshard_test
