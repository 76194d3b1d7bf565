// dsp-generate: loads a checkpoint (saved at any tensor- and pipeline-parallel size) at any
// tensor-parallel size on one pipeline stage (resharding from the manifest) and continues
// byte-level prompts with a KV cache, all prompts in one batch.
//
//   dsp-generate --load ckpt --tensor-model-parallel-size 4 --prompt "ROMEO:" --max-new-tokens 200
#include <cstdio>

#include "cli.hpp"
#include "dsp/checkpoint/model_io.hpp"
#include "dsp/serve/consistency.hpp"
#include "dsp/serve/generator.hpp"

int main(int argc, char** argv) {
  CLI::App app{"dsp-generate: generate text from a dsp checkpoint at any tensor-parallel size"};
  std::string load, prompts_file;
  std::vector<std::string> prompts;
  int tp = 0;
  std::int64_t max_new_tokens = 100;
  dsp::serve::SamplingParams sampling;
  app.add_option("--load", load, "checkpoint directory")->required();
  app.add_option("--tensor-model-parallel-size", tp,
                 "serving TP size (default: the checkpoint's); serving runs one pipeline stage")
      ->check(samples::at_least(1));
  auto* p = app.add_option("--prompt", prompts, "prompt text (repeatable; \\n is a newline)");
  app.add_option("--prompts-file", prompts_file, "one prompt per line")->excludes(p);
  app.add_option("--max-new-tokens", max_new_tokens, "tokens to generate per prompt");
  app.add_option("--temperature", sampling.temperature, "0 = greedy");
  app.add_option("--top-k", sampling.top_k, "keep the k most likely tokens (0: all)");
  app.add_option("--top-p", sampling.top_p, "nucleus: smallest set with this probability mass");
  app.add_option("--seed", sampling.seed, "sampling seed");
  return samples::run_main(app, argc, argv, [&] {
    if (!prompts_file.empty()) prompts = samples::read_prompts_file(prompts_file);
    DSP_CHECK_AS(dsp::InputError, !prompts.empty(), "give --prompt TEXT or --prompts-file FILE");
    for (auto& text : prompts) text = samples::unescape_newlines(text);
    const auto config = dsp::checkpoint::read_model_config(load);
    if (tp <= 0) tp = dsp::checkpoint::read_manifest(load).meta.layout.tensor;
    std::vector<std::vector<std::int32_t>> ids;
    for (const auto& text : prompts) ids.push_back(dsp::serve::encode_bytes(text));
    dsp::comm::launch(tp, [&](dsp::comm::ThreadComm& world) {
      dsp::DeviceMesh mesh(world, dsp::ParallelLayout{.tensor = tp});
      dsp::model::CausalLM<samples::HostPolicy> model(config, mesh, 0);
      dsp::checkpoint::load_model(load, model);
      dsp::serve::Generator<samples::HostPolicy> generator(model);
      const auto out = generator.generate(ids, max_new_tokens, sampling);
      if (world.rank() != 0) return;
      for (std::size_t i = 0; i < out.size(); ++i)
        std::printf("=== prompt %zu (TP%d) ===\n%s%s\n", i, tp, prompts[i].c_str(),
                    dsp::serve::decode_bytes(out[i]).c_str());
    });
  });
}
