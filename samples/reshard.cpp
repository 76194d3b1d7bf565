// dsp-reshard: rewrites a checkpoint (saved at any TP and PP) for another tensor- and
// data-parallel layout on one pipeline stage (the serving layout; dsp-train --load reads a
// checkpoint at any PP directly), straight from its manifest, or merges it into one Hugging
// Face safetensors file + config.json (+ tokenizer.json, tokenizer_config.json for a byte-level
// model: vocab 256 or 257). Both write tensors in global layer order.
//
//   dsp-reshard --load ckpt --save ckpt_tp4 --tensor-model-parallel-size 4
//   dsp-reshard --load ckpt --save serve_tp4 --tensor-model-parallel-size 4 --no-save-optim
//   dsp-reshard --load ckpt --save hf_model --merge
//   dsp-reshard --load hf_model --save ckpt_tp2 --tensor-model-parallel-size 2
// The last imports a Hugging Face model folder (config.json without a dsp manifest.json: a
// LlamaForCausalLM, one model.safetensors or shards with model.safetensors.index.json, F32/BF16/
// F16/block-scaled F8_E4M3) as a dsp checkpoint without optimizer state, each TP rank (a thread,
// or a process under mpiexec) reading only its slices.
#include "cli.hpp"
#include "ranks.hpp"
#include "dsp/checkpoint/hf_convert.hpp"
#include "dsp/checkpoint/iterations.hpp"
#include "dsp/checkpoint/manifest.hpp"
#include "dsp/checkpoint/merge.hpp"
#include "dsp/checkpoint/reshard.hpp"

int main(int argc, char** argv) {
  CLI::App app{"dsp-reshard: reshard a dsp checkpoint to another TP/DP layout, or merge it for Hugging Face"};
  std::string load, save;
  int tp = 0, pp = 1, dp = 1;
  bool merge = false, no_save_optim = false;
  samples::path_option(app.add_option("--load", load, "source checkpoint directory, or a Hugging Face model folder to import"))->required();
  samples::path_option(app.add_option("--save", save, "destination directory (replaced atomically)"))->required();
  app.add_option("--tensor-model-parallel-size", tp, "target tensor-parallel size")->check(samples::at_least(1));
  app.add_option("--pipeline-model-parallel-size", pp, "target pipeline size: 1 (the default) only");
  app.add_option("--data-parallel-size", dp, "target data-parallel size (default 1: serving)")
      ->check(samples::at_least(1));
  auto* no_optim = app.add_flag("--no-save-optim", no_save_optim,
                                "leave the optimizer state out: a serving checkpoint of a third of the size, which "
                                "training cannot resume from");
  app.add_flag("--merge", merge, "write one model.safetensors + config.json with Hugging Face names instead")
      ->excludes(no_optim);
  return samples::run_main(app, argc, argv, [&] {
    load = dsp::checkpoint::resolve_checkpoint(load).string();  // a folder of iter_* checkpoints: its latest
    if (dsp::checkpoint::is_hugging_face_folder(load)) {
      DSP_CHECK_AS(dsp::InputError, !merge, load, " is a Hugging Face model folder already (no ",
                   dsp::checkpoint::manifest_file_name, "): --merge takes a dsp checkpoint");
      DSP_CHECK_AS(dsp::InputError, tp > 0, "--tensor-model-parallel-size is required to import ", load);
      DSP_CHECK_AS(dsp::ConfigError, pp == 1 && dp == 1, "an imported checkpoint is written at one pipeline stage and ",
                   "no optimizer state (--pipeline-model-parallel-size 1, --data-parallel-size 1), got PP ", pp,
                   " / DP ", dp, "; dsp-train --load reads it at any pipeline-model-parallel-size");
      samples::run_ranks(tp, [&]<class Comm>(Comm& world) { dsp::checkpoint::import_hugging_face(load, save, world); });
      std::printf("imported the Hugging Face model %s to %s (TP%d/PP1, no optimizer state)\n", load.c_str(),
                  save.c_str(), tp);
      const nlohmann::json extra = dsp::checkpoint::read_manifest(save).meta.extra;
      if (extra.contains("kept_aside"))
        std::printf("kept aside %s tensor(s) of the %s multi-token-prediction layer(s) in %s/%s (dsp does not train "
                    "them; --merge writes them back)\n",
                    extra["kept_aside"]["tensors"].dump().c_str(), extra["kept_aside"]["num_nextn_predict_layers"].dump().c_str(),
                    save.c_str(), extra["kept_aside"]["file"].get<std::string>().c_str());
      return;
    }
    if (merge) {
      dsp::checkpoint::merge(load, save);
      const bool tokenizer = std::filesystem::exists(std::filesystem::path(save) / dsp::checkpoint::merged_tokenizer_file);
      std::printf("merged %s into %s (model.safetensors, config.json%s)\n", load.c_str(), save.c_str(),
                  tokenizer ? ", the byte-level tokenizer.json and tokenizer_config.json" : "");
      return;
    }
    DSP_CHECK_AS(dsp::InputError, tp > 0, "--tensor-model-parallel-size is required (or --merge)");
    DSP_CHECK_AS(dsp::ConfigError, pp == 1, "dsp-reshard writes one pipeline stage (--pipeline-model-parallel-size 1), ",
                 "got ", pp, "; dsp-train --load reads a checkpoint at any pipeline-model-parallel-size directly");
    const auto source = dsp::checkpoint::read_manifest(load).meta.layout;
    dsp::checkpoint::reshard(load, save, tp, dp,
                             no_save_optim ? dsp::checkpoint::OptimizerState::Drop : dsp::checkpoint::OptimizerState::Keep);
    std::printf("resharded %s (%s) to %s (TP%d/PP1/DP%d%s)\n", load.c_str(), source.str().c_str(), save.c_str(), tp,
                dp, no_save_optim ? ", no optimizer state" : "");
  });
}
