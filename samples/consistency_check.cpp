// dsp-consistency-check: is the served model still the trained one? Runs fixed prompts
// through the model at the checkpoint's training layout (or the --reference checkpoint at
// its own layout) and through the model loaded at --tensor-model-parallel-size, and prints
// the largest |logit difference| over every position of every prompt as JSON.
// Exits 1 when it exceeds --tolerance.
//
//   dsp-consistency-check --load ckpt --tensor-model-parallel-size 4
#include <cstdio>

#include "cli.hpp"
#include "dsp/checkpoint/model_io.hpp"
#include "dsp/serve/consistency.hpp"
#include "dsp/serve/generator.hpp"

namespace {

// Full logits [len, vocab] of every prompt, from `dir` loaded at TP `tp`.
std::vector<dsp::Tensor> logits_at(const std::string& dir, int tp, const std::vector<std::vector<std::int32_t>>& ids) {
  const auto config = dsp::checkpoint::read_model_config(dir);
  std::vector<dsp::Tensor> out;
  dsp::comm::launch(tp, [&](dsp::comm::ThreadComm& world) {
    dsp::DeviceMesh mesh(world, dsp::ParallelLayout{.tensor = tp});
    dsp::model::CausalLM<samples::HostPolicy> model(config, mesh, 0);
    dsp::checkpoint::load_model(dir, model);
    dsp::serve::Generator<samples::HostPolicy> generator(model);
    std::vector<dsp::Tensor> mine;
    for (const auto& p : ids) mine.push_back(generator.full_logits(p));
    if (world.rank() == 0) out = std::move(mine);
  });
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dsp-consistency-check: compare a checkpoint's logits at two tensor-parallel layouts"};
  std::string load, reference, prompts_file;
  int tp = 1;
  double tolerance = 1e-4;
  app.add_option("--load", load, "checkpoint directory to serve")->required();
  app.add_option("--tensor-model-parallel-size", tp, "serving TP size")->required();
  app.add_option("--reference", reference, "reference checkpoint (default: --load at its training layout)");
  app.add_option("--prompts-file", prompts_file, "one prompt per line (default: 9 built-in prompts)");
  app.add_option("--tolerance", tolerance, "exit 1 when max |logit diff| exceeds this");
  return samples::run_main(app, argc, argv, [&] {
    const auto prompts = prompts_file.empty() ? dsp::serve::default_prompts() : samples::read_prompts_file(prompts_file);
    std::vector<std::vector<std::int32_t>> ids;
    for (const auto& text : prompts) ids.push_back(dsp::serve::encode_bytes(text));
    if (reference.empty()) reference = load;
    const int reference_tp = dsp::checkpoint::load_manifest(reference).meta.layout.tensor;
    const double diff = dsp::serve::max_abs_logit_diff(logits_at(reference, reference_tp, ids), logits_at(load, tp, ids));
    const nlohmann::json result = {{"max_abs_logit_diff", diff},        {"prompts", prompts.size()},
                                   {"reference", reference},            {"reference_tensor_model_parallel_size", reference_tp},
                                   {"checkpoint", load},                {"tensor_model_parallel_size", tp},
                                   {"tolerance", tolerance},            {"consistent", diff <= tolerance}};
    std::printf("%s\n", result.dump().c_str());
    DSP_CHECK(diff <= tolerance, "max |logit diff| ", diff, " exceeds the tolerance ", tolerance);
  });
}
