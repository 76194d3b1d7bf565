// dsp-consistency-check: is the served model still the trained one? Runs fixed prompts
// through the reference model at its training layout and through --load at
// --tensor-model-parallel-size, and prints the largest |logit difference| as JSON: over every
// position of every prompt (full forward), and over the last position of every prompt as the
// server computes it (all prompts in one batch through the KV cache). The reference is
// --reference, else the checkpoint --load was resharded from (its manifest says), else
// --load itself at the layout it was saved with. Exits 1 when a difference exceeds --tolerance.
//
//   dsp-consistency-check --load ckpt --tensor-model-parallel-size 4
#include <algorithm>
#include <cstdio>

#include "cli.hpp"
#include "dsp/checkpoint/model_io.hpp"
#include "dsp/serve/consistency.hpp"
#include "dsp/serve/generator.hpp"

namespace {

// Logits of every prompt from `dir` loaded at TP `tp`: the full forward [len, vocab] of each
// prompt alone, and the serving path's last-position logits [prompts, vocab] from one
// batched prefill through the KV cache.
struct Logits {
  std::vector<dsp::Tensor> full;
  dsp::Tensor served_last;
};

Logits logits_at(const std::string& dir, int tp, const std::vector<std::vector<std::int32_t>>& ids) {
  const auto config = dsp::checkpoint::read_model_config(dir);
  Logits out;
  dsp::comm::launch(tp, [&](dsp::comm::ThreadComm& world) {
    dsp::DeviceMesh mesh(world, dsp::ParallelLayout{.tensor = tp});
    dsp::model::CausalLM<samples::HostPolicy> model(config, mesh, 0);
    dsp::checkpoint::load_model(dir, model);
    dsp::serve::Generator<samples::HostPolicy> generator(model);
    Logits mine;
    for (const auto& p : ids) mine.full.push_back(generator.full_logits(p));
    auto cache = generator.make_cache(static_cast<std::int64_t>(ids.size()));
    mine.served_last = generator.prefill(cache, ids);
    if (world.rank() == 0) out = std::move(mine);
  });
  return out;
}

// Last row of each [len, vocab] tensor, as one [prompts, vocab] tensor.
std::vector<dsp::Tensor> last_rows(const std::vector<dsp::Tensor>& full) {
  const std::int64_t vocab = full.front().dim(1);
  dsp::Tensor out({static_cast<std::int64_t>(full.size()), vocab});
  for (std::size_t i = 0; i < full.size(); ++i)
    std::copy_n(full[i].data() + (full[i].dim(0) - 1) * vocab, vocab, out.data() + static_cast<std::int64_t>(i) * vocab);
  return {out};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dsp-consistency-check: compare a checkpoint's logits at two tensor-parallel layouts"};
  std::string load, reference, prompts_file;
  int tp = 1;
  double tolerance = 1e-4;
  app.add_option("--load", load, "checkpoint directory to serve")->required();
  app.add_option("--tensor-model-parallel-size", tp, "serving TP size")->required();
  app.add_option("--reference", reference, "reference checkpoint (default: the one --load was resharded from, else --load at its saved layout)");
  app.add_option("--prompts-file", prompts_file, "one prompt per line (default: 9 built-in prompts)");
  app.add_option("--tolerance", tolerance, "exit 1 when max |logit diff| exceeds this");
  return samples::run_main(app, argc, argv, [&] {
    const auto prompts = prompts_file.empty() ? dsp::serve::default_prompts() : samples::read_prompts_file(prompts_file);
    std::vector<std::vector<std::int32_t>> ids;
    for (const auto& text : prompts) ids.push_back(dsp::serve::encode_bytes(text));
    if (reference.empty()) {  // the checkpoint training wrote, when --load was resharded from it
      const auto extra = dsp::checkpoint::read_manifest(load).meta.extra;
      reference = extra.contains("resharded_from") ? extra["resharded_from"]["checkpoint"].get<std::string>() : load;
    }
    const int reference_tp = dsp::checkpoint::read_manifest(reference).meta.layout.tensor;
    const Logits ref = logits_at(reference, reference_tp, ids);
    const Logits served = logits_at(load, tp, ids);
    const double diff = dsp::serve::max_abs_logit_diff(ref.full, served.full);
    const double diff_served = dsp::serve::max_abs_logit_diff(last_rows(ref.full), {served.served_last});
    const bool ok = diff <= tolerance && diff_served <= tolerance;
    const nlohmann::json result = {{"max_abs_logit_diff", std::max(diff, diff_served)},
                                   {"full_forward_max_abs_logit_diff", diff},
                                   {"batched_kv_cache_max_abs_logit_diff", diff_served},
                                   {"prompts", prompts.size()},
                                   {"reference", reference},
                                   {"reference_tensor_model_parallel_size", reference_tp},
                                   {"checkpoint", load},
                                   {"tensor_model_parallel_size", tp},
                                   {"tolerance", tolerance},
                                   {"consistent", ok}};
    std::printf("%s\n", result.dump().c_str());
    DSP_CHECK(ok, "max |logit diff| ", std::max(diff, diff_served), " exceeds the tolerance ", tolerance);
  });
}
