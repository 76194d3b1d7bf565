// dsp-consistency-check: is the served model still the trained one? Runs fixed prompts
// through the reference model at its training layout and through --load at
// --tensor-model-parallel-size, and prints the largest |logit difference| as JSON: over every
// position of every prompt, by a full forward pass and as the serving engine computes them
// (all prompts served together as requests through its paged KV cache). The reference is
// --reference, else the checkpoint --load was resharded from (its manifest says), else
// --load itself at the layout it was saved with. Exits 1 when a difference exceeds --tolerance.
//
// Layouts: the served model runs on one pipeline stage (serving is PP1). The reference runs
// at the tensor- and pipeline-parallel sizes it was saved with (JSON "reference_layout"; its
// data-parallel replicas are identical), the layers split evenly over its stages, each stage
// running PipelineStage::infer and handing its hidden states to the next. How training grouped
// the layers into stages (interleaved chunks, an explicit --pipeline-layer-split) changes no
// layer's arithmetic, so any grouping at the same TP gives the same logits. A model with fewer
// layers than stages (an explicit split with empty stages) runs its reference at PP1.
//
//   dsp-consistency-check --load ckpt --tensor-model-parallel-size 4
#include <algorithm>
#include <cstdio>

#include "cli.hpp"
#include "dsp/backend/host/copy_columns.hpp"
#include "dsp/checkpoint/iterations.hpp"
#include "dsp/checkpoint/model_io.hpp"
#include "dsp/pp/engine.hpp"
#include "dsp/pp/layer_split.hpp"
#include "dsp/pp/pipeline_stage.hpp"
#include "dsp/serve/consistency.hpp"
#include "dsp/serve/engine.hpp"
#include "dsp/serve/full_logits.hpp"
#include "dsp/tp/mappings.hpp"

namespace {

// Logits of every prompt from `dir` loaded at TP `tp`: the full forward [len, vocab] of each
// prompt alone, and the serving engine's logits of every prompt position [len, vocab], all
// prompts served together as concurrent requests through the paged KV cache.
struct Logits {
  std::vector<dsp::Tensor> full, served;
};

Logits logits_at(const std::string& dir, int tp, const std::vector<std::vector<std::int32_t>>& ids) {
  const auto config = dsp::checkpoint::read_model_config(dir);
  Logits out;
  dsp::comm::launch(tp, [&](dsp::comm::ThreadComm& world) {
    dsp::DeviceMesh mesh(world, dsp::ParallelLayout{.tensor = tp});
    const dsp::InferenceMode inference;  // weights only: no gradient buffers
    dsp::model::CausalLM<samples::HostPolicy> model(config, mesh, 0);
    dsp::checkpoint::load_model(dir, model);
    Logits mine;
    for (const auto& p : ids) mine.full.push_back(dsp::serve::full_logits(model, p));
    dsp::serve::Engine<samples::HostPolicy> engine(model, world, {});
    mine.served.resize(ids.size());
    if (world.rank() == 0)
      for (std::size_t i = 0; i < ids.size(); ++i)
        engine.add_request(ids[i], {.max_tokens = 1, .prompt_logits = true}, std::to_string(i));
    while (!engine.stopped()) {
      for (auto& o : engine.step())
        if (o.prompt_logits.numel() > 0) mine.served[std::stoul(o.id)] = std::move(o.prompt_logits);
      if (world.rank() == 0 && !engine.has_unfinished_requests()) engine.shutdown();
    }
    if (world.rank() == 0) out = std::move(mine);
  });
  return out;
}

// Full-forward logits [len, vocab] of every prompt from `dir` at TP `tp` x PP `pp`, the
// layers split evenly over the stages (pp::even_layer_split; needs num_layers >= pp): stage r
// runs PipelineStage::infer on the hidden states of stage r - 1 (pp::forward_stages), the
// last stage gathers its logits over its TP group and drops the vocabulary padding.
std::vector<dsp::Tensor> pipeline_logits(const std::string& dir, int tp, int pp,
                                         const std::vector<std::vector<std::int32_t>>& ids) {
  using Backend = samples::HostPolicy::Backend;
  const auto config = dsp::checkpoint::read_model_config(dir);
  const auto stages = dsp::pp::stage_layers(dsp::pp::even_layer_split(config.num_layers, pp), config.num_layers);
  std::vector<dsp::Tensor> out;
  dsp::comm::launch(tp * pp, [&](dsp::comm::ThreadComm& world) {
    dsp::DeviceMesh mesh(world, dsp::ParallelLayout{.tensor = tp, .pipeline = pp});
    auto& tensor = mesh.tensor_group();
    const int r = mesh.pp_rank();
    const dsp::InferenceMode inference;  // weights only: no gradient buffers
    dsp::pp::PipelineStage<samples::HostPolicy> stage(config, tensor, stages[static_cast<std::size_t>(r)], 0);
    dsp::checkpoint::load_into(dir, dsp::checkpoint::stage_state(stage, dsp::checkpoint::StateUse::Load),
                               tp, mesh.tp_rank());  // a last stage's tied copy too
    std::vector<dsp::Tensor> mine;
    for (const auto& prompt : ids) {
      const auto len = static_cast<std::int64_t>(prompt.size());
      auto ctx = dsp::model::ForwardContext::for_training(1, len);
      ctx.training = false;
      const dsp::Tensor x = dsp::pp::forward_stages(mesh.pipeline_group(), pp, {len, config.hidden_size},
                                                    [&](int, dsp::Tensor in) { return stage.infer(ctx, prompt, std::move(in)); });
      if (r + 1 < pp) continue;
      const dsp::Tensor all = dsp::tp::GatherFromTpRegion<Backend>::forward(tensor, x);  // [len, padded vocab]
      dsp::Tensor logits({len, config.vocab_size});
      dsp::backend::copy_columns(Backend{}, all.data(), all.dim(1), 0, logits.data(), config.vocab_size, 0, len,
                                 config.vocab_size);
      mine.push_back(std::move(logits));
    }
    if (r == pp - 1 && mesh.tp_rank() == 0) out = std::move(mine);
  });
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "dsp-consistency-check: compare a checkpoint's logits at its training layout (TP x PP) and a served one (TP, PP1)"};
  std::string load, reference, prompts_file;
  int tp = 1;
  double tolerance = 1e-4;
  samples::path_option(app.add_option("--load", load, "checkpoint directory to serve"))->required();
  app.add_option("--tensor-model-parallel-size", tp, "serving TP size")->required()->check(samples::at_least(1));
  samples::path_option(app.add_option("--reference", reference, "reference checkpoint (default: the one --load was resharded from, else --load at its saved layout)"));
  samples::path_option(app.add_option("--prompts-file", prompts_file, "one prompt per line (default: 9 built-in prompts)"));
  app.add_option("--tolerance", tolerance, "exit 1 when max |logit diff| exceeds this");
  return samples::run_main(app, argc, argv, [&] {
    load = dsp::checkpoint::resolve_checkpoint(load).string();  // a folder of iter_* checkpoints: its latest
    const auto prompts = prompts_file.empty() ? dsp::serve::default_prompts() : samples::read_prompts_file(prompts_file);
    std::vector<std::vector<std::int32_t>> ids;
    for (const auto& text : prompts) ids.push_back(dsp::serve::encode_bytes(text));
    if (reference.empty()) {  // the checkpoint training wrote, when --load was resharded from it
      const auto extra = dsp::checkpoint::read_manifest(load).meta.extra;
      reference = extra.contains("resharded_from") ? extra["resharded_from"]["checkpoint"].get<std::string>() : load;
    }
    reference = dsp::checkpoint::resolve_checkpoint(reference).string();
    const dsp::ParallelLayout trained = dsp::checkpoint::read_manifest(reference).meta.layout;
    const int reference_tp = trained.tensor;
    const int reference_pp =  // PP1 when an explicit split left stages without layers
        dsp::checkpoint::read_model_config(reference).num_layers >= trained.pipeline ? trained.pipeline : 1;
    const Logits served = logits_at(load, tp, ids);  // first: it checks the prompts (length, vocabulary)
    const std::vector<dsp::Tensor> ref = pipeline_logits(reference, reference_tp, reference_pp, ids);
    const double diff = dsp::serve::max_abs_logit_diff(ref, served.full);
    const double diff_served = dsp::serve::max_abs_logit_diff(ref, served.served);
    const bool ok = diff <= tolerance && diff_served <= tolerance;
    const nlohmann::json result = {{"max_abs_logit_diff", std::max(diff, diff_served)},
                                   {"full_forward_max_abs_logit_diff", diff},
                                   {"batched_kv_cache_max_abs_logit_diff", diff_served},
                                   {"prompts", prompts.size()},
                                   {"reference", reference},
                                   {"reference_tensor_model_parallel_size", reference_tp},
                                   {"reference_layout", dsp::ParallelLayout{.tensor = reference_tp, .pipeline = reference_pp,
                                                                            .data = 1}.str()},
                                   {"reference_trained_layout", trained.str()},
                                   {"checkpoint", load},
                                   {"tensor_model_parallel_size", tp},
                                   {"layout", dsp::ParallelLayout{.tensor = tp, .pipeline = 1, .data = 1}.str()},
                                   {"tolerance", tolerance},
                                   {"consistent", ok}};
    std::printf("%s\n", result.dump().c_str());
    DSP_CHECK(ok, "max |logit diff| ", std::max(diff, diff_served), " exceeds the tolerance ", tolerance);
  });
}
