// Reshard: TP2 -> TP4 -> TP1 is exact; a target TP that does not divide writes nothing.
#include <doctest/doctest.h>

#include <string>

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
  CHECK(m4.files.size() == 4);
  for (int r = 0; r < 4; ++r) {
    const auto f = read_safetensors(tmp.path / "tp4" / shard_file_name(r, 0));
    for (const ShardedTensor& s : specs)
      CHECK_MESSAGE(same(f.tensor(s.name), dsp::shard_of(s, globals.at(s.name), 4, r)), s.name, " rank ", r);
  }

  reshard(tmp / "tp4", tmp / "tp1", 1, 1);
  const GlobalCheckpoint back = load_global(tmp / "tp1");
  CHECK(back.manifest.meta.layout.tensor == 1);
  CHECK(back.manifest.files.size() == 1);
  for (const auto& [name, t] : globals) CHECK_MESSAGE(same(back.tensors.at(name), t), name);
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
