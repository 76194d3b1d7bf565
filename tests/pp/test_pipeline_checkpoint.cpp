// A checkpoint saved at PP=2 loads at PP=1 and at PP=4 and gives the logits of the model that
// saved it. Reference: the PP=2 trainer's own stages run forward on the same tokens before
// saving. Tolerance 1e-5 relative: the same parameters run the same ops, so only a different
// stage boundary could change rounding (in practice the logits are bit-identical).
#include <doctest/doctest.h>

#include <filesystem>
#include <mutex>
#include <set>

#include "dsp/backend/host.hpp"
#include "dsp/checkpoint/model_io.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/checkpointing.hpp"
#include "../relative_error.hpp"
#include "../train/small_model.hpp"

using namespace dsp;

namespace pp_pipeline_checkpoint_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

const std::vector<std::int32_t> kTokens = {70, 105, 114, 115, 116, 32, 67, 105, 116, 105, 122, 101, 110, 58};

// Logits [tokens, vocab] of the trainer's pipeline on kTokens (TP1): the stages run `infer`
// in order (pp::forward_stages); the last stage's rank returns them, the others an empty tensor.
Tensor pipeline_logits(train::Trainer<P>& t) {
  auto ctx = model::ForwardContext::for_training(1, static_cast<std::int64_t>(kTokens.size()));
  ctx.training = false;
  return pp::forward_stages(t.mesh().pipeline_group(), t.engine().schedule().num_stages(),
                            {ctx.tokens(), t.model_config().hidden_size}, [&](int s, Tensor x) {
                              const auto chunk = static_cast<std::size_t>(t.engine().schedule().chunk_of(s));
                              return t.stages()[chunk]->infer(ctx, kTokens, std::move(x));
                            });
}

train::TrainConfig train_config(const char* schedule) {
  train::TrainConfig tc;
  tc.micro_batch_size = 2;
  tc.global_batch_size = 4;
  tc.lr = 3e-3f;
  tc.pipeline.schedule = schedule;
  return tc;
}

}  // namespace

TEST_CASE("pipeline checkpoint: saved at PP=2, loaded at PP=1 and PP=4 (and PP=4 back to PP=1) with the same logits") {
  for (bool tied : {true, false}) {
    CAPTURE(tied);
    auto config = test::small_model(tied);
    config.num_layers = 4;
    const auto& data = test::shakespeare(config.seq_length);
    const auto dir = std::filesystem::temp_directory_path() / ("dsp_pp_ckpt_" + std::to_string(tied));
    std::filesystem::remove_all(dir);
    Tensor reference, at_pp1, at_pp4;
    std::mutex mu;
    comm::launch(2, [&](comm::ThreadComm& world) {  // train 3 steps at PP=2, save
      DeviceMesh mesh(world, ParallelLayout{.pipeline = 2});
      train::Trainer<P> trainer(config, train_config("1f1b"), mesh, data);
      for (int s = 0; s < 3; ++s) trainer.train_step();
      train::save_checkpoint(dir, trainer);
      Tensor l = pipeline_logits(trainer);
      std::lock_guard lk(mu);
      if (!l.empty()) reference = std::move(l);
    });
    // The files hold each stage's layers under global names; the tied table is saved once.
    const auto manifest = checkpoint::read_manifest(dir);
    std::set<std::string> names;
    for (const auto& t : manifest.tensors) CHECK(names.insert(t.name).second);
    CHECK(names.count("model.embed_tokens.weight") == 1);
    CHECK(names.count("model.layers.3.mlp.down_proj.weight") == 1);
    comm::launch(1, [&](comm::ThreadComm& world) {  // the whole model (serving layout)
      DeviceMesh mesh(world, ParallelLayout{});
      model::CausalLM<P> m(config, mesh, 99);  // another seed: everything must come from the file
      checkpoint::load_model(dir, m);
      auto ctx = model::ForwardContext::for_training(1, static_cast<std::int64_t>(kTokens.size()));
      ctx.training = false;
      at_pp1 = m.logits(ctx, kTokens);
    });
    const auto dir4 = dir.string() + "_pp4";
    comm::launch(4, [&](comm::ThreadComm& world) {  // resumed at PP=4, saved again at PP=4
      DeviceMesh mesh(world, ParallelLayout{.pipeline = 4});
      auto tc = train_config("1f1b");
      train::Trainer<P> trainer(config, tc, mesh, data);
      train::load_checkpoint(dir, trainer);
      CHECK(trainer.iteration() == 3);
      Tensor l = pipeline_logits(trainer);
      train::save_checkpoint(dir4, trainer);
      std::lock_guard lk(mu);
      if (!l.empty()) at_pp4 = std::move(l);
    });
    Tensor back_at_pp1;
    comm::launch(1, [&](comm::ThreadComm& world) {  // and back: the PP=4 checkpoint at PP=1
      DeviceMesh mesh(world, ParallelLayout{});
      model::CausalLM<P> m(config, mesh, 99);
      checkpoint::load_model(dir4, m);
      auto ctx = model::ForwardContext::for_training(1, static_cast<std::int64_t>(kTokens.size()));
      ctx.training = false;
      back_at_pp1 = m.logits(ctx, kTokens);
    });
    CHECK(test::relative_error(at_pp1, reference) <= 1e-5);
    CHECK(test::relative_error(at_pp4, reference) <= 1e-5);
    CHECK(test::relative_error(back_at_pp1, reference) <= 1e-5);
    std::filesystem::remove_all(dir);
    std::filesystem::remove_all(dir4);
  }
}

}  // namespace pp_pipeline_checkpoint_test
