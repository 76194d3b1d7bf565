// dsp-train: trains the decoder (dense, or DeepSeekMoE with --num-experts) on a byte-level
// text file or on Megatron indexed datasets (--data-path PREFIX or a blend "0.3 A 0.7 B",
// --split, --eod-mask-loss, --reset-position-ids, --reset-attention-mask) with tensor,
// pipeline, data and expert parallelism (threads as ranks, or processes under mpiexec),
// Megatron flag spelling. Writes JSON-lines metrics, a live progress
// line on a terminal, sharded checkpoints and, for MoE models, an end-of-run routing table.
//
//   dsp-train --world-size 4 --tensor-model-parallel-size 2 --data-path data/tinyshakespeare.txt
//             --train-iters 300 --save ckpt --metrics-file metrics.jsonl
//   mpiexec -n 4 dsp-train --tensor-model-parallel-size 2 ...   (the same training, MpiComm)
//   dsp-train --world-size 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 ...
//             [--pipeline-schedule gpipe|1f1b|interleaved] [--num-layers-per-virtual-pipeline-stage K]
//   dsp-train --world-size 4 --zero-stage 3 ...   (ZeRO: optimizer state, gradients and parameters
//             partitioned over the 4 data-parallel ranks; the same losses as --zero-stage 0)
//   dsp-train --world-size 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 2
//             --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128
//             --moe-shared-expert-intermediate-size 128 --first-k-dense-replace 1 ...
//
// --profile-file trace.json writes a Chrome trace of steps [--profile-step-start,
// --profile-step-end): per rank, compute, communication and idle spans (ui.perfetto.dev),
// every rank in the one file, under mpiexec too (rank 0 gathers and writes it).
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "cli.hpp"
#include "model_flags.hpp"
#include "ranks.hpp"
#include "dsp/checkpoint/hf_import.hpp"
#include "dsp/core/trace.hpp"
#include "dsp/data/blended_gpt_data.hpp"
#include "dsp/data/tokenizer.hpp"
#include "dsp/plan/validate.hpp"
#include "dsp/train/checkpointing.hpp"
#include "dsp/train/exit_signal.hpp"
#include "dsp/train/metrics.hpp"
#include "dsp/train/metrics_log.hpp"
#include "dsp/train/peak_flops.hpp"
#include "dsp/train/trainer.hpp"

namespace {

struct Options {
  int world_size = 0;  // 0: not given (1 thread, or the MPI size under mpiexec)
  int tensor_parallel = 1;
  int pipeline_parallel = 1;
  int expert_parallel = 1;
  bool print_schedule = false;
  std::string token_drop_policy = "probs";
  samples::RecomputeFlags recompute_flags;
  samples::ModelFlags model_flags;
  dsp::model::ModelConfig model;  // from model_flags
  dsp::train::TrainConfig train;
  std::int64_t eval_interval = 0, save_interval = 0, exit_interval = 0, log_interval = 10;
  std::vector<std::string> data_path;  // --data-path: a text file, PREFIX, or WEIGHT PREFIX pairs
  bool megatron_data = false;          // --data-path names Megatron indexed datasets (megatron_data())
  std::string split = "969,30,1";      // --split (Megatron datasets)
  std::string tokenizer_type = "ByteTokenizer", tokenizer_model;
  std::string save, load, metrics_file, grad_reduce_dtype = "fp32";
  std::int64_t save_retain = 0;             // --save-retain: keep the newest N iterations (0: all)
  std::optional<std::int64_t> ckpt_step;    // --ckpt-step: load this iteration, not the tracker's
  bool overwrite_checkpoints = false;       // --overwrite-checkpoints: skip the later-iteration check
  bool exit_signal_handler = true;          // --exit-signal-handler / --no-exit-signal-handler
  dsp::precision::LossScalerConfig loss_scaler;  // used when --initial-loss-scale or --fp16 is given
  bool bf16 = false, fp16 = false;                // --bf16, --fp16: the precision policy
  double peak_flops = 0;
  std::string profile_file;
  std::int64_t profile_step_start = 2, profile_step_end = 4;  // steps 2 and 3: past step 1's warm-up
};

void add_flags(CLI::App& app, Options& o) {
  app.add_option("--world-size", o.world_size, "ranks (threads; under mpiexec the MPI size, which it must equal); data-parallel size = world / (TP x PP)")
      ->check(samples::at_least(1));
  app.add_option("--tensor-model-parallel-size", o.tensor_parallel, "tensor-parallel size");
  app.add_option("--pipeline-model-parallel-size", o.pipeline_parallel, "pipeline stages");
  app.add_option("--pipeline-schedule", o.train.pipeline.schedule,
                 "gpipe, 1f1b or interleaved (default: interleaved with virtual stages, else 1f1b)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved"}));
  app.add_option("--num-layers-per-virtual-pipeline-stage", o.train.pipeline.num_layers_per_virtual_stage,
                 "layers per model chunk of the interleaved schedule (layers / (PP x this) chunks per rank)");
  app.add_option("--pipeline-layer-split", o.train.pipeline.layer_split,
                 "explicit layers per (virtual) pipeline stage, e.g. 3,3,2,2 (default: as even as possible, earlier stages get the extra)")
      ->delimiter(',');
  app.add_flag("--print-pipeline-schedule", o.print_schedule, "print the schedule's forward/backward timeline per pipeline rank (simulated, backward = 2 forwards) and continue");
  o.model_flags.add_to(app);
  app.add_option("--expert-model-parallel-size", o.expert_parallel, "ranks the routed experts are split over (divides the data-parallel size)");
  app.add_option("--moe-router-bias-update-rate", o.train.moe_router_bias_update_rate, "gamma: the bias step per optimizer step");
  app.add_option("--moe-aux-loss-coeff", o.train.moe.aux_loss_coeff, "alpha of the sequence-wise balance loss (0: none)");
  app.add_option("--moe-expert-capacity-factor", o.train.moe.capacity_factor, "expert capacity factor (default: dropless)");
  app.add_option("--moe-token-drop-policy", o.token_drop_policy, "over capacity keep the highest gate weights (probs) or the earliest tokens (position)")
      ->check(CLI::IsMember({"probs", "position"}));
  o.recompute_flags.add_to(app);
  app.add_option("--micro-batch-size", o.train.micro_batch_size, "sequences per micro-batch per DP rank");
  app.add_option("--global-batch-size", o.train.global_batch_size, "sequences per optimizer step");
  app.add_option("--train-iters", o.train.train_iters, "optimizer steps");
  app.add_option("--lr", o.train.lr, "peak learning rate");
  app.add_option("--min-lr", o.train.min_lr, "final learning rate of the cosine decay");
  app.add_option("--lr-warmup-iters", o.train.lr_warmup_iters, "linear warmup steps");
  app.add_option("--lr-decay-iters", o.train.lr_decay_iters, "end of the cosine decay (default: train-iters)");
  app.add_option("--weight-decay", o.train.adam.weight_decay, "AdamW decoupled weight decay");
  app.add_option("--adam-beta1", o.train.adam.beta1, "AdamW beta1");
  app.add_option("--adam-beta2", o.train.adam.beta2, "AdamW beta2");
  app.add_option("--adam-eps", o.train.adam.eps, "AdamW epsilon");
  app.add_option("--clip-grad", o.train.clip_grad, "global gradient-norm clip (0: off)");
  app.add_flag("--check-for-nan-in-loss-and-grad,!--no-check-for-nan-in-loss-and-grad",
               o.train.check_for_nan_in_loss_and_grad,
               "stop with an error, before the update, at a step whose gradient norm is NaN or infinite (default on; "
               "a step skipped by loss scaling is not checked)");
  app.add_option("--seed", o.train.seed, "seed of parameters and data order");
  app.add_option("--ddp-bucket-size", o.train.ddp.bucket_size_bytes, "bytes of gradients per data-parallel all-reduce bucket");
  app.add_flag("--overlap-grad-reduce,!--no-overlap-grad-reduce", o.train.ddp.overlap_grad_reduce,
               "start each bucket's all-reduce during backward (identical results)");
  auto* bf16 = app.add_flag("--bf16", o.bf16,
                            "bf16 mixed precision: bf16 parameters and gradients (reduced in bf16), fp32 master weights and "
                            "Adam moments (2 + 2 + 12 bytes per parameter before ZeRO)");
  app.add_flag("--fp16", o.fp16, "fp16 mixed precision: as --bf16 with fp16, and dynamic loss scaling (the defaults of "
                                 "the loss-scale flags unless given)")
      ->excludes(bf16);
  app.add_option("--grad-reduce-dtype", o.grad_reduce_dtype,
                 "dtype of the data-parallel gradient all-reduce: fp32, bf16 or fp16 (fp16: use with --initial-loss-scale); "
                 "with --bf16 / --fp16 the gradients are kept and reduced in that type")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--initial-loss-scale", o.loss_scaler.initial_scale,
                 "turns on dynamic loss scaling from this scale: a step whose gradients overflow (e.g. fp16 transport) "
                 "is skipped on every rank and the scale backs off");
  app.add_option("--min-loss-scale", o.loss_scaler.min_scale, "dynamic loss scaling: smallest scale");
  app.add_option("--max-loss-scale", o.loss_scaler.max_scale, "dynamic loss scaling: largest scale");
  app.add_option("--loss-scale-window", o.loss_scaler.growth_interval, "dynamic loss scaling: clean steps before the scale grows");
  app.add_option("--hysteresis", o.loss_scaler.hysteresis, "dynamic loss scaling: overflows since the last growth before it backs off");
  app.add_option("--loss-scale-growth-factor", o.loss_scaler.growth_factor, "dynamic loss scaling: growth multiplier");
  app.add_option("--loss-scale-backoff-factor", o.loss_scaler.backoff_factor, "dynamic loss scaling: backoff multiplier");
  app.add_option("--zero-stage", o.train.zero_stage,
                 "ZeRO stage: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters partitioned over data parallelism "
                 "(routed experts over expert data parallelism); the same training at every stage");
  app.add_option("--eval-interval", o.eval_interval, "evaluate every N steps (0: only at the end)")
      ->check(samples::at_least(0));
  app.add_option("--eval-iters", o.train.eval_iters, "validation global batches per evaluation");
  app.add_option("--log-interval", o.log_interval, "log line every N steps when not on a terminal")
      ->check(samples::at_least(1));
  samples::path_option(app.add_option("--save", o.save, "checkpoint directory to write"));
  app.add_option("--save-interval", o.save_interval, "save every N steps (0: only at the end)")
      ->check(samples::at_least(0));
  app.add_option("--exit-interval", o.exit_interval, "stop (after saving) at the first step divisible by N")
      ->check(samples::at_least(0));
  app.add_option("--save-retain", o.save_retain, "keep only the newest N iter_* checkpoints in --save (0: all)")
      ->check(samples::at_least(0));
  app.add_flag("--overwrite-checkpoints", o.overwrite_checkpoints,
               "save even when --save holds an iteration at or after the first one this run writes");
  app.add_flag("--exit-signal-handler,!--no-exit-signal-handler", o.exit_signal_handler,
               "on SIGTERM or SIGINT finish the step, save to --save and exit 0 (a second signal exits at once)");
  samples::path_option(app.add_option("--load", o.load, "checkpoint to resume from: a folder of iter_* checkpoints (its latest_checkpointed_iteration.txt) or one checkpoint; or a Hugging Face model folder (config.json, safetensors) to start from its weights, its config the model (flags given override it)"));
  app.add_option("--ckpt-step", o.ckpt_step, "load this iteration of --load instead of the tracker's")->check(samples::at_least(0));
  // the last --data-path given wins (a config file's, then the command line's), as in Megatron
  samples::path_option(app.add_option_function<std::vector<std::string>>(
                           "--data-path", [&o](const std::vector<std::string>& words) { o.data_path = words; },
                                      "a text file (bytes are tokens, the last 10% is validation), or Megatron indexed "
                                      "datasets: PREFIX (PREFIX.bin + PREFIX.idx, from dsp-preprocess-data or Megatron's "
                                      "preprocess_data.py) or a blend WEIGHT PREFIX WEIGHT PREFIX ..."))
      ->required()
      ->expected(1, -1)
      ->trigger_on_parse();
  app.add_option("--split", o.split, "train,valid,test weights over each dataset's sequences (Megatron datasets)");
  app.add_option("--tokenizer-type", o.tokenizer_type,
                 "tokenizer of the Megatron datasets (its EOD id and vocabulary): ByteTokenizer (bytes, EOD 256) or "
                 "HuggingFaceTokenizer")
      ->check(CLI::IsMember({"ByteTokenizer", "HuggingFaceTokenizer"}));
  samples::path_option(app.add_option("--tokenizer-model", o.tokenizer_model, "tokenizer.json (HuggingFaceTokenizer)"));
  app.add_flag("--eod-mask-loss", o.train.eod_mask_loss, "no loss on the prediction made at an EOD token");
  app.add_flag("--reset-position-ids", o.train.reset_position_ids, "positions restart at 0 after each EOD token");
  app.add_flag("--reset-attention-mask", o.train.reset_attention_mask,
               "a token attends only its own document (attention stops at EOD tokens)");
  samples::path_option(app.add_option("--metrics-file", o.metrics_file, "JSON lines: step, loss, val_loss, lr, grad_norm, tokens_per_s, mfu, step_time_s, bubble_fraction, peak_activation_bytes, memory (rank 0's live bytes at the step's end by category: parameters, gradients, optimizer_state, activations, communication, workspace, total; and their peaks over the step: peak_<category>, peak_total), moe (per MoE layer: tokens_per_expert, max_over_mean_load, dropped, aux_loss), loss_scale and skipped (with --initial-loss-scale) (global rank 0)"));
  app.add_option("--peak-flops", o.peak_flops, "FLOP/s that MFU is measured against (default: this machine's sgemm peak, measured once and cached in ~/.cache/dsp/peak_flops.json or $DSP_PEAK_FLOPS_CACHE)");
  samples::path_option(app.add_option("--profile-file", o.profile_file, "write a Chrome trace (ui.perfetto.dev) of the profiled steps here"));
  app.add_option("--profile-step-start", o.profile_step_start, "first profiled optimizer step (1-based; default 2)");
  app.add_option("--profile-step-end", o.profile_step_end, "profiled steps end before this one (default 4)");
}

// A step's MoE routing per layer for the metrics file.
nlohmann::json moe_json(const std::vector<dsp::train::MoeStepStats>& layers) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& l : layers)
    out.push_back({{"layer", l.layer}, {"tokens_per_expert", l.tokens_per_expert},
                   {"max_over_mean_load", l.max_over_mean_load()}, {"dropped", l.dropped}, {"aux_loss", l.aux_loss}});
  return out;
}

// A step's memory counters for the metrics file: live bytes by category and total, and their
// peaks as "peak_<category>", "peak_total".
nlohmann::json memory_json(const dsp::memory::Snapshot& m) {
  nlohmann::json out;
  for (dsp::memory::Category c : dsp::memory::all_categories) {
    const std::string name(dsp::memory::name(c));
    out[name] = m[c].live;
    out["peak_" + name] = m[c].peak;
  }
  out["total"] = m.total.live;
  out["peak_total"] = m.total.peak;
  return out;
}

// The end-of-run routing table: per MoE layer, the tokens each expert got over the run,
// max/mean of those, the dropped assignments, the last step's max/mean and aux loss.
struct RoutingTable {
  std::vector<dsp::train::MoeStepStats> total, last;
  void add(const std::vector<dsp::train::MoeStepStats>& step) {
    if (total.empty()) total = step;
    else
      for (std::size_t i = 0; i < step.size(); ++i) {
        for (std::size_t e = 0; e < step[i].tokens_per_expert.size(); ++e)
          total[i].tokens_per_expert[e] += step[i].tokens_per_expert[e];
        total[i].dropped += step[i].dropped;
      }
    last = step;
  }
  void print() const {
    if (total.empty()) return;
    std::printf("MoE routing over this run (tokens per expert; max/mean load 1.00 = balanced):\n");
    std::printf("layer | max/mean (run) | max/mean (last step) | dropped | aux loss (last) | tokens per expert\n");
    for (std::size_t i = 0; i < total.size(); ++i) {
      std::string counts;
      for (auto v : total[i].tokens_per_expert) counts += (counts.empty() ? "" : " ") + std::to_string(v);
      std::printf("%5lld | %14.2f | %20.2f | %7lld | %15.4g | %s\n", static_cast<long long>(total[i].layer),
                  total[i].max_over_mean_load(), last[i].max_over_mean_load(), static_cast<long long>(total[i].dropped),
                  last[i].aux_loss, counts.c_str());
    }
  }
};

std::string eta(double seconds) {
  const auto s = static_cast<long>(seconds);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  return buf;
}

// The peak MFU divides by: the machine's cached sgemm peak (train/peak_flops.hpp). Under
// mpiexec the first process of each host measures it while the others sleep, then they read it.
double machine_peak_flops() {
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  if (!samples::started_by_mpiexec() || !local || std::string(local) == "0")
    return dsp::train::cached_sgemm_peak<dsp::backend::Host>("host");
  const auto cache = dsp::train::peak_flops_cache_path();
  const std::string key = dsp::train::machine_key("host");
  for (int i = 0; i < 1200; ++i) {  // at most 2 minutes
    if (const double peak = dsp::train::read_cached_peak(cache, key); peak > 0) return peak;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return dsp::train::cached_sgemm_peak<dsp::backend::Host>("host");  // the cache cannot be written: measure
}

/// dsp-plan's validation of this run (plan/validate.hpp): every rule the layout, batch and
/// schedule break, listed at once before anything is built (the parts check again as they are
/// built, with the same sentences). Throws ConfigError.
void validate_plan(const Options& o, int world_size) {
  dsp::plan::TrainingPlan plan;
  plan.model = o.model;
  plan.layout = {.tensor = o.tensor_parallel, .pipeline = o.pipeline_parallel,
                 .data = std::max(1, world_size / std::max(1, o.tensor_parallel * o.pipeline_parallel)),
                 .expert = o.expert_parallel};
  plan.pipeline = o.train.pipeline;
  plan.precision = o.bf16 ? dsp::plan::Precision::Bf16Mixed
                   : o.fp16 ? dsp::plan::Precision::Fp16Mixed
                            : dsp::plan::Precision::Fp32;
  plan.zero_stage = o.train.zero_stage;
  plan.micro_batch_size = o.train.micro_batch_size;
  plan.global_batch_size = o.train.global_batch_size;
  plan.recompute = o.train.recompute;
  dsp::plan::validate(plan, world_size);
}

/// Whether --data-path names Megatron indexed datasets (a blend, or PREFIX with PREFIX.idx or
/// PREFIX.bin beside it) rather than one text file.
bool megatron_data(const std::vector<std::string>& words) {
  return words.size() > 1 || std::filesystem::exists(words.at(0) + ".idx") || std::filesystem::exists(words[0] + ".bin");
}

/// The --data-path rules that no part checks: a dataset's .bin or .idx is named by its prefix;
/// the tokenizer and document-mask flags need Megatron datasets (a text file is read as bytes,
/// without EOD tokens). Throws ConfigError.
void check_data_flags(const Options& o) {
  for (const auto& w : o.data_path)
    for (const std::string ext : {".bin", ".idx"})
      if (w.ends_with(ext) && std::filesystem::exists(w.substr(0, w.size() - 4) + (ext == ".bin" ? ".idx" : ".bin")))
        DSP_CHECK_AS(dsp::ConfigError, false, "--data-path '", w, "' names a file of an indexed dataset: give its prefix '",
                     w.substr(0, w.size() - 4), "'");
  if (o.megatron_data) return;
  DSP_CHECK_AS(dsp::ConfigError, o.tokenizer_type == "ByteTokenizer" && o.tokenizer_model.empty(),
               "--tokenizer-type / --tokenizer-model apply to Megatron datasets; the text file '", o.data_path[0],
               "' is read as bytes (tokenize it with dsp-preprocess-data first)");
  DSP_CHECK_AS(dsp::ConfigError, !o.train.documents().any(),
               "--eod-mask-loss, --reset-position-ids and --reset-attention-mask need documents ended by an EOD "
               "token: the text file '", o.data_path[0], "' has none (write a dataset with dsp-preprocess-data --append-eod)");
}

/// The data of --data-path: a text file as bytes (as before Megatron datasets), else Megatron
/// indexed datasets split by --split and blended, asked for --train-iters x --global-batch-size
/// training and --eval-iters x --global-batch-size validation samples (what Megatron asks).
std::unique_ptr<const dsp::data::SampleSource> open_data(const Options& o) {
  const auto& words = o.data_path;
  if (!o.megatron_data)
    return std::make_unique<dsp::train::TokenDataset>(dsp::train::TokenDataset::from_file(words[0], o.model.seq_length));
  dsp::data::GptDataConfig c;
  c.blend = dsp::data::parse_data_path(words);
  c.split = o.split;
  c.seq_length = o.model.seq_length;
  // numpy's RandomState (Megatron's shuffles) takes seeds below 2^32 only
  DSP_CHECK_AS(dsp::ConfigError, o.train.seed <= 0xFFFFFFFFull, "--seed ", o.train.seed,
               " is over 2^32 - 1, the largest seed Megatron's dataset shuffles take");
  c.seed = static_cast<std::uint32_t>(o.train.seed);
  c.train_samples = o.train.train_iters * o.train.global_batch_size;
  c.valid_samples = o.train.eval_iters * o.train.global_batch_size;
  c.vocab_size = o.model.vocab_size;
  return std::make_unique<dsp::data::BlendedGptData>(c);
}

void train(Options& o) {
  o.train.validate();  // the Trainer checks again; here before the sgemm peak and the data are read
  if (o.peak_flops <= 0) o.peak_flops = machine_peak_flops();
  const std::unique_ptr<const dsp::data::SampleSource> data = open_data(o);
  std::int64_t start = 0;  // the iteration this run resumes from
  const bool hugging_face = !o.load.empty() && dsp::checkpoint::is_hugging_face_folder(o.load);
  if (hugging_face) {  // what the model does not hold (DeepSeek-V3's MTP layers) is said, not dropped silently
    const auto kept = dsp::checkpoint::HfFolder(o.load).tensors_from_layer(o.model.num_layers);
    if (!kept.empty())
      std::fprintf(stderr,
                   "dsp-train: warning: %s holds %zu tensor(s) of layers past num_hidden_layers (multi-token "
                   "prediction), which dsp does not train and its checkpoints do not carry; dsp-reshard --load %s "
                   "--save CKPT keeps them aside for --merge\n",
                   o.load.c_str(), kept.size(), o.load.c_str());
  }
  if (!o.load.empty() && !hugging_face) {
    o.load = dsp::checkpoint::resolve_checkpoint(o.load, o.ckpt_step).string();  // the iter_* folder
    start = dsp::checkpoint::read_manifest(o.load).meta.iteration;
  }
  if (!o.save.empty() && !o.overwrite_checkpoints && start < o.train.train_iters) {  // fail now, not after training
    std::int64_t first_save = o.train.train_iters;
    for (std::int64_t every : {o.save_interval, o.exit_interval})
      if (every > 0) first_save = std::min(first_save, (start / every + 1) * every);
    dsp::checkpoint::check_save_root(o.save, first_save);
  }
  std::optional<dsp::train::ExitSignalHandler> signals;  // this process's SIGTERM / SIGINT
  if (o.exit_signal_handler) signals.emplace();
  if (!o.profile_file.empty()) {
    DSP_CHECK_AS(dsp::ConfigError, o.profile_step_start >= 1 && o.profile_step_end > o.profile_step_start,
                 "--profile-step-start (", o.profile_step_start, ") must be >= 1 and below --profile-step-end (",
                 o.profile_step_end, ")");
    const auto dir = std::filesystem::path(o.profile_file).parent_path();
    DSP_CHECK_AS(dsp::InputError, access(dir.empty() ? "." : dir.c_str(), W_OK) == 0, "cannot write trace file '",
                 o.profile_file, "': its directory is not writable");
  }
  const double flops_per_token = dsp::train::training_flops_per_token(o.model);
  const bool tty = isatty(fileno(stdout)) && !samples::started_by_mpiexec();  // mpiexec forwards a pty: keep log lines

  samples::run_ranks(o.world_size, [&]<class Comm>(Comm& world) {  // ThreadComm, or MpiComm under mpiexec
    validate_plan(o, world.size());
    // The precision policy is a compile-time choice (dsp::Policy): one trainer type per --bf16 / --fp16.
    const auto run = [&]<class Precision>() {
      using P = dsp::Policy<dsp::backend::Host, Comm, Precision>;
      dsp::DeviceMesh mesh(world, dsp::ParallelLayout{.tensor = o.tensor_parallel, .pipeline = o.pipeline_parallel,
                                                      .expert = o.expert_parallel});
      dsp::train::Trainer<P> trainer(o.model, o.train, mesh, *data);
      if (hugging_face) dsp::train::load_hugging_face(o.load, trainer);  // weights only: iteration 0
      else if (!o.load.empty()) dsp::train::load_checkpoint(o.load, trainer);
      const bool lead = world.rank() == 0;
      std::optional<std::ofstream> metrics;
      if (lead) {
        std::printf("dsp-train: %s, %lld parameters, %s precision, ZeRO stage %d, gradient accumulation %lld x micro-batch %lld per DP rank, peak %.1f GFLOP/s\n",
                    mesh.layout().str().c_str(), static_cast<long long>(o.model.num_parameters()),
                    P::Precision::name,
                    o.train.zero_stage,
                    static_cast<long long>(trainer.sampler().accumulation_steps()),
                    static_cast<long long>(o.train.micro_batch_size), o.peak_flops / 1e9);
        std::printf("data: %s, %lld training and %lld validation samples of %lld tokens, vocabulary %lld\n",
                    o.megatron_data ? "Megatron indexed datasets" : "text file (bytes)",
                    static_cast<long long>(data->train_samples()), static_cast<long long>(data->val_samples()),
                    static_cast<long long>(data->seq_length()), static_cast<long long>(o.model.vocab_size));
        if (o.print_schedule) std::printf("%s", dsp::pp::to_table(trainer.engine().schedule()).c_str());
        if (trainer.iteration() > 0)
          std::printf("dsp-train: resuming from iteration %lld of %s\n", static_cast<long long>(trainer.iteration()),
                      o.load.c_str());
        if (trainer.iteration() >= o.train.train_iters)
          std::printf("dsp-train: the checkpoint in %s is at iteration %lld, not below --train-iters %lld: nothing to "
                      "train\n",
                      o.load.c_str(), static_cast<long long>(trainer.iteration()),
                      static_cast<long long>(o.train.train_iters));
        if (!o.metrics_file.empty()) metrics = dsp::train::open_metrics_log(o.metrics_file, trainer.iteration());
      }
      const auto t_start = std::chrono::steady_clock::now();
      const std::int64_t first = trainer.iteration();
      RoutingTable routing;
      bool tracing = false;  // this rank records the trace: step in [profile_step_start, profile_step_end)
      const auto trace_before = [&](std::int64_t step) {
        const bool on = !o.profile_file.empty() && step >= o.profile_step_start && step < o.profile_step_end;
        if (on != tracing) on ? dsp::trace::start() : dsp::trace::stop();
        tracing = on;
      };
      while (trainer.iteration() < o.train.train_iters) {
        trace_before(trainer.iteration() + 1);
        const auto r = trainer.train_step();  // a profiled step's evaluation and save are in its trace too
        const bool stepped = !r.skipped;       // a skipped step (loss-scale overflow) did not advance the iteration
        const bool last = stepped && r.iteration == o.train.train_iters;
        const bool signalled = signals && dsp::train::exit_signal_agreed(world);  // all ranks: the same step
        const bool stop = last || signalled || (stepped && o.exit_interval > 0 && r.iteration % o.exit_interval == 0);
        const bool eval = last || (stepped && o.eval_interval > 0 && r.iteration % o.eval_interval == 0);
        const double val = eval ? trainer.evaluate() : 0.0;
        std::filesystem::path saved;
        if (!o.save.empty() && (stop || (stepped && o.save_interval > 0 && r.iteration % o.save_interval == 0)))
          saved = dsp::train::save_iteration(o.save, trainer, o.save_retain);
        if (lead) {
          const double tps = static_cast<double>(r.tokens) / r.seconds;
          const double mfu = dsp::train::mfu(flops_per_token, tps, o.peak_flops);
          const bool mfu_ok = dsp::train::plausible_mfu(mfu);  // over 100%: the peak is wrong, no figure
          if (metrics) {
            nlohmann::json j = {{"step", r.iteration}, {"loss", r.loss},         {"lr", r.lr},
                                {"grad_norm", r.grad_norm}, {"tokens_per_s", tps},
                                {"mfu", mfu_ok ? nlohmann::json(mfu) : nlohmann::json(nullptr)},
                                {"step_time_s", r.seconds}, {"bubble_fraction", r.bubble_fraction},
                                {"peak_activation_bytes", r.peak_activation_bytes}};
            if (eval) j["val_loss"] = val;
            if (!mfu_ok) j["mfu_error"] = "over 100%: the peak FLOP/s is wrong (pass --peak-flops)";
            if (trainer.loss_scaler()) {
              j["loss_scale"] = r.loss_scale;
              j["skipped"] = r.skipped;
            }
            j["memory"] = memory_json(r.memory);
            if (!r.moe.empty()) j["moe"] = moe_json(r.moe);
            *metrics << j.dump() << '\n' << std::flush;
          }
          const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
          const std::int64_t done = trainer.iteration();  // optimizer steps (a skipped step is not one)
          const double remaining = elapsed / static_cast<double>(done - first) * static_cast<double>(o.train.train_iters - done);
          const std::string eta_text = done > first ? eta(remaining) : "-";  // nothing stepped yet: no rate
          char mfu_text[48];
          if (mfu_ok) std::snprintf(mfu_text, sizeof mfu_text, "%.1f%%", 100 * mfu);
          else std::snprintf(mfu_text, sizeof mfu_text, "n/a (over 100%%: wrong peak)");
          char line[320];
          std::snprintf(line, sizeof line, "iter %5lld/%lld | loss %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | MFU %s | eta %s",
                        static_cast<long long>(r.iteration), static_cast<long long>(o.train.train_iters), r.loss, r.lr,
                        r.grad_norm, tps, mfu_text, eta_text.c_str());
          if (r.skipped)
            std::snprintf(line + std::strlen(line), sizeof line - std::strlen(line), " | skipped: overflow at loss scale %g",
                          double(r.loss_scale));
          if (tty) std::printf("\r%s\033[K", line);
          if (eval || r.skipped || (!tty && (r.iteration % o.log_interval == 0 || stop))) {
            if (tty) std::printf("\n");
            std::printf(eval ? "%s | val loss %.4f\n" : "%s\n", line, val);
          }
          std::fflush(stdout);
          routing.add(r.moe);
          if (signalled)
            std::printf("dsp-train: %s received: stopped after iteration %lld%s%s\n",
                        dsp::train::exit_signal_received() == SIGINT ? "SIGINT" : "SIGTERM",
                        static_cast<long long>(trainer.iteration()), saved.empty() ? ", not saved (no --save)" : ", saved to ",
                        saved.c_str());
          std::fflush(stdout);
        }
        if (stop) break;
      }
      if (!o.profile_file.empty()) {
        trace_before(0);
        dsp::trace::write_chrome_trace(world, o.profile_file);  // every rank's events, written by rank 0
        if (lead) {
          const bool any = std::max(first + 1, o.profile_step_start) < std::min(trainer.iteration() + 1, o.profile_step_end);
          std::printf("trace of steps [%lld, %lld) in %s%s\n", static_cast<long long>(o.profile_step_start),
                      static_cast<long long>(o.profile_step_end), o.profile_file.c_str(),
                      any ? "" : " (empty: this run trained none of those steps)");
        }
      }
      if (lead) {
        routing.print();
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
        const std::string saved =
            o.save.empty() ? "" : (std::filesystem::path(o.save) / dsp::checkpoint::iteration_folder_name(trainer.iteration())).string();
        std::printf("trained %lld steps in %.1f s%s%s\n", static_cast<long long>(trainer.iteration() - first), elapsed,
                    o.save.empty() ? "" : ", checkpoint in ", saved.c_str());
      }
    };
    if (o.bf16) run.template operator()<dsp::precision::Bf16Mixed>();
    else if (o.fp16) run.template operator()<dsp::precision::Fp16Mixed>();
    else run.template operator()<dsp::precision::Fp32>();
  });
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dsp-train: tensor-, pipeline-, data- and expert-parallel training of a dense or MoE decoder on a text file or Megatron indexed datasets"};
  Options o;
  add_flags(app, o);
  return samples::run_main(app, argc, argv, [&] {
    // --load of a Hugging Face model folder: its config.json is the model, the flags given override it
    // (--seq-length: the training sequence length)
    std::optional<dsp::model::ModelConfig> hf_model;
    if (!o.load.empty() && dsp::checkpoint::is_hugging_face_folder(o.load)) {
      DSP_CHECK_AS(dsp::InputError, !o.ckpt_step, "--ckpt-step needs a dsp checkpoint; ", o.load,
                   " is a Hugging Face model folder");
      hf_model = dsp::checkpoint::read_hf_config(o.load);
    }
    o.model = o.model_flags.config(app, hf_model ? &*hf_model : nullptr,
                                   {"--moe-router-bias-update-rate", "--moe-aux-loss-coeff",
                                    "--moe-expert-capacity-factor", "--moe-token-drop-policy"});
    o.train.ddp.grad_reduce_dtype = dsp::dp::grad_reduce_dtype_from_name(o.grad_reduce_dtype);
    if (o.bf16 || o.fp16) {  // the gradients are kept and reduced in the 16-bit type
      const std::string type = o.bf16 ? "bf16" : "fp16";
      DSP_CHECK_AS(dsp::ConfigError, app.count("--grad-reduce-dtype") == 0 || o.grad_reduce_dtype == type, "--", type,
                   " keeps gradients in ", type, ": --grad-reduce-dtype must be ", type, ", got ", o.grad_reduce_dtype);
      o.train.ddp.grad_reduce_dtype = dsp::dp::grad_reduce_dtype_from_name(type);
    }
    if (app.count("--initial-loss-scale") > 0 || o.fp16) {  // --fp16: dynamic loss scaling always
      o.train.loss_scaler = o.loss_scaler;
    } else {
      if (o.train.ddp.grad_reduce_dtype == dsp::dp::GradReduceDType::Fp16)
        std::fprintf(stderr, "dsp-train: warning: --grad-reduce-dtype fp16 without --initial-loss-scale: gradients "
                             "outside fp16's range (6e-8 .. 65504) are lost unnoticed\n");
      for (const char* flag : {"--min-loss-scale", "--max-loss-scale", "--loss-scale-window", "--hysteresis",
                               "--loss-scale-growth-factor", "--loss-scale-backoff-factor"})
        DSP_CHECK_AS(dsp::ConfigError, app.count(flag) == 0, flag,
                     " needs --initial-loss-scale or --fp16 (dynamic loss scaling is on only with them)");
    }
    // the tokenizer of the data: its EOD for the document masks, its vocabulary the model's
    // default with Megatron datasets (bytes: 257 with the EOD)
    o.megatron_data = megatron_data(o.data_path);
    check_data_flags(o);
    const dsp::data::Tokenizer tokenizer(o.tokenizer_type, o.tokenizer_model);
    if (o.train.documents().any()) o.train.eod_token = tokenizer.eod();
    if (o.megatron_data) {
      if (app.count("--vocab-size") == 0 && !hf_model) o.model.vocab_size = tokenizer.vocab_size();
      DSP_CHECK_AS(dsp::ConfigError, o.model.vocab_size >= tokenizer.vocab_size(), "--vocab-size ", o.model.vocab_size,
                   " is below the tokenizer's ", tokenizer.vocab_size(), " ids");
    }
    o.train.recompute = o.recompute_flags.config();
    o.train.moe.drop_policy = o.token_drop_policy == "position" ? dsp::ep::DropPolicy::Position : dsp::ep::DropPolicy::Probability;
    train(o);
  });
}
