// dsp-plan: the memory ledger on the command line. From a model (Megatron flags, or a Hugging
// Face config.json with --model-config), a layout, batch sizes, a precision, a ZeRO stage and
// recomputation, it validates the plan (every broken rule with its numbers, exit code 1),
// prints each rank's predicted training memory by category next to serving's, and with a
// cluster (--gpus-per-node, --num-nodes, --gpu-memory) ranks layouts the way experienced
// users choose them, each with its predicted memory and pipeline bubble.
//
//   dsp-plan --model-config samples/configs/plan_60layer.json --num-nodes 2 --gpus-per-node 8 --gpu-memory 80
//   dsp-plan --model-config samples/configs/plan_64layer_7168.json --num-nodes 8 --global-batch-size 512
//            --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --recompute-granularity selective
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#include "cli.hpp"
#include "model_flags.hpp"
#include "dsp/plan/ledger.hpp"
#include "dsp/plan/recommend.hpp"
#include "dsp/plan/validate.hpp"

namespace {

struct Options {
  std::string model_config;
  samples::ModelFlags model_flags;
  int tensor = 1, pipeline = 1, expert = 1, world_size = 0;
  std::string precision = "bf16";
  samples::RecomputeFlags recompute_flags;
  dsp::plan::TrainingPlan plan;
  int serving_tensor = 0;
  std::int64_t serving_batch = 1, serving_tokens = 0;
  std::string serving_dtype;
  std::int64_t serving_block_size = 16, serving_kv_cache_memory = -1;  // -1: not given
  double serving_gpu_memory_utilization = 0.9;
  dsp::plan::Cluster cluster;
  double gpu_memory_gb = 80;
  int num_recommendations = 5;
};

double gb(std::int64_t bytes) { return double(bytes) / 1e9; }

/// A decimal unit of bytes for a table whose largest entry is `largest` bytes: GB unless that
/// is below 1 GB, then MB or kB, so that a small model's figures do not print as zeros.
struct ByteUnit {
  const char* name;
  double bytes;
  const char* bytes_text;
};
ByteUnit unit_for(double largest) {
  if (largest >= 1e9) return {"GB", 1e9, "1e9"};
  if (largest >= 1e6) return {"MB", 1e6, "1e6"};
  return {"kB", 1e3, "1e3"};
}

/// "127.9 GB", "3.3 MB": bytes in the unit unit_for picks for them.
std::string bytes_str(double bytes) {
  const ByteUnit u = unit_for(bytes);
  char s[32];
  std::snprintf(s, sizeof s, "%.1f %s", bytes / u.bytes, u.name);
  return s;
}

/// "63.94 B", "0.82 M", "5000": a parameter count in billions or millions, whole below a million.
std::string count_str(std::int64_t n) {
  char s[32];
  if (n >= 1'000'000'000) std::snprintf(s, sizeof s, "%.2f B", double(n) / 1e9);
  else if (n >= 1'000'000) std::snprintf(s, sizeof s, "%.2f M", double(n) / 1e6);
  else std::snprintf(s, sizeof s, "%lld", (long long)n);
  return s;
}

std::string layout_str(const dsp::ParallelLayout& l) {
  return "TP" + std::to_string(l.tensor) + " x PP" + std::to_string(l.pipeline) + " x DP" + std::to_string(l.data) +
         (l.expert > 1 ? " (EP" + std::to_string(l.expert) + ")" : "");
}

std::string chunks_str(const std::vector<dsp::pp::StageLayers>& chunks) {
  std::string s;
  for (const auto& c : chunks) {
    if (!s.empty()) s += ", ";
    s += c.num_layers == 0 ? "no layers" : "layers " + std::to_string(c.first_layer) + "-" + std::to_string(c.first_layer + c.num_layers - 1);
    if (c.pre_process) s += " + embedding";
    if (c.post_process) s += " + output layer";
  }
  return s;
}

void print_model(const dsp::model::ModelConfig& c) {
  std::printf("model: %lld layers, hidden %lld, %lld heads (%lld KV groups, head dim %lld), ffn %lld, vocab %lld, seq %lld",
              (long long)c.num_layers, (long long)c.hidden_size, (long long)c.num_attention_heads,
              (long long)c.num_query_groups, (long long)c.head_dim(), (long long)c.ffn_hidden_size,
              (long long)c.vocab_size, (long long)c.seq_length);
  if (c.is_moe())
    std::printf(", %lld experts (top-%lld, ffn %lld, %lld shared, first %lld dense)", (long long)c.num_experts,
                (long long)c.moe_router_topk, (long long)c.moe_ffn_hidden_size, (long long)c.num_shared_experts,
                (long long)c.first_k_dense_replace);
  if (c.is_mla())
    std::printf(", MLA (q_lora %lld, kv_lora %lld, qk %lld + %lld rope, v %lld)", (long long)c.q_lora_rank,
                (long long)c.kv_lora_rank, (long long)c.qk_nope_head_dim, (long long)c.qk_rope_head_dim,
                (long long)c.v_head_dim);
  const auto n = c.num_parameters();
  std::printf("\n       %s parameters = %s in bf16, %s in fp32; %s activated per token (no embedding lookup, top-k "
              "experts)\n",
              count_str(n).c_str(), bytes_str(2.0 * double(n)).c_str(), bytes_str(4.0 * double(n)).c_str(),
              count_str(c.num_activated_parameters()).c_str());
  std::printf("       KV cache per token: %lld bytes in bf16 (%s)\n", (long long)c.kv_cache_bytes_per_token(2),
              c.is_mla() ? "MLA: layers x (kv_lora + rope)" : "GQA: layers x 2 x KV heads x head dim");
}

void print_ledgers(const dsp::plan::TrainingPlan& plan, const dsp::plan::TrainingPrediction& t,
                   const dsp::plan::ServingPlan& sp, const dsp::plan::MemoryLedger& s, std::int64_t gpu_memory) {
  const auto& L = plan.layout;
  std::printf("layout: %s = %d ranks; %s schedule", layout_str(L).c_str(), L.world_size(), t.schedule.c_str());
  if (t.virtual_size > 1) std::printf(" (%d model chunks per rank)", t.virtual_size);
  std::printf(", %d micro-batches of %lld x %lld tokens per step (global batch %lld = %lld x DP%d x %d accumulation)\n",
              t.micro_batches, (long long)plan.micro_batch_size, (long long)plan.model.seq_length,
              (long long)plan.global_batch_size, (long long)plan.micro_batch_size, L.data,
              t.micro_batches);
  std::printf("training: %s, ZeRO stage %d, recompute %s%s; bubble (p-1)/(v m+p-1) = %.1f %%\n",
              dsp::plan::to_string(plan.precision).c_str(), plan.zero_stage,
              dsp::plan::to_string(plan.recompute.granularity).c_str(),
              plan.model.use_flash_attn ? ", flash attention" : "", 100.0 * t.bubble);
  for (const auto& r : t.ranks)
    if (L.pipeline > 1 && (r.pipeline_rank == 0 || r.pipeline_rank == L.pipeline - 1))
      std::printf("  PP rank %d: %s; %s parameters per rank; in flight: %d micro-batch(es)\n", r.pipeline_rank,
                  chunks_str(r.chunks).c_str(), count_str(r.elements.total()).c_str(), r.in_flight);
  std::printf("serving: TP%d on one stage, batch %lld x %lld tokens, %s weights and KV cache\n\n", sp.tensor,
              (long long)sp.batch, (long long)sp.tokens(), sp.dtype_bytes == 2 ? "16-bit" : "fp32");

  // Columns: the worst training rank, the other pipeline end when it differs, serving.
  std::vector<std::pair<std::string, dsp::plan::MemoryLedger>> cols;
  const int worst = t.worst;
  cols.emplace_back("train PP rank " + std::to_string(worst) + (L.pipeline > 1 ? " (worst)" : ""), t.worst_rank().bytes);
  const int other = worst == 0 ? L.pipeline - 1 : 0;
  if (other != worst) cols.emplace_back("train PP rank " + std::to_string(other), t.ranks[std::size_t(other)].bytes);
  cols.emplace_back("serve TP" + std::to_string(sp.tensor), s);
  double largest = 0;
  for (const auto& [_, m] : cols) largest = std::max(largest, double(m.total()));
  const ByteUnit unit = unit_for(largest);
  std::printf("per-rank memory, %s (%s B)  ", unit.name, unit.bytes_text);
  for (const auto& [name, _] : cols) std::printf("%24s", name.c_str());
  std::printf("\n");
  auto row = [&](const char* label, auto field, bool serving_too) {
    std::printf("  %-27s", label);
    for (std::size_t i = 0; i < cols.size(); ++i) {
      const bool is_serving = i + 1 == cols.size();
      if (is_serving && !serving_too) std::printf("%24s", "-");
      else std::printf("%24.2f", double(field(cols[i].second)) / unit.bytes);
    }
    std::printf("\n");
  };
  using M = dsp::plan::MemoryLedger;
  row("parameters", [](const M& m) { return m.parameters; }, true);
  row("gradients", [](const M& m) { return m.gradients; }, false);
  row("optimizer state", [](const M& m) { return m.optimizer_state; }, false);
  row("activations | KV cache", [](const M& m) { return m.activations; }, true);
  row("communication", [](const M& m) { return m.communication; }, false);
  row("workspace", [](const M& m) { return m.workspace; }, true);
  row("total", [](const M& m) { return m.total(); }, true);
  if (gpu_memory > 0) {
    std::printf("  %-27s", "fits in the GPU memory");
    for (const auto& [_, m] : cols) std::printf("%24s", m.total() <= gpu_memory ? "yes" : "NO");
    std::printf("\n");
  }

  const auto& c = plan.model;
  const dsp::plan::MicroBatch mb = plan.micro_batch();
  const std::int64_t first_layer = t.worst_rank().chunks.front().first_layer;
  auto dsp_layer = [&](dsp::plan::RecomputeGranularity g) {
    return double(dsp::plan::dsp_layer_activation_bytes(c, L.tensor, L.expert, first_layer, mb,
                                                        dsp::plan::activation_bytes(plan.precision), g));
  };
  auto field = [&](dsp::plan::RecomputeGranularity g) {
    return double(dsp::plan::korthikanti_layer_bytes(mb.seq, mb.batch, c.hidden_size, c.num_attention_heads, L.tensor, g));
  };
  using G = dsp::plan::RecomputeGranularity;
  const ByteUnit a = unit_for(std::max(dsp_layer(G::None), field(G::None)));
  std::printf("\nactivations of one layer and micro-batch, %s, none / selective / full recomputation:\n"
              "  dsp (its layers' saved state)                          %.3f / %.3f / %.3f\n"
              "  Korthikanti et al. 2022 eq. 2 (16-bit, TP%d, no SP)     %.3f / %.3f / %.3f\n",
              a.name, dsp_layer(G::None) / a.bytes, dsp_layer(G::Selective) / a.bytes, dsp_layer(G::Full) / a.bytes,
              L.tensor, field(G::None) / a.bytes, field(G::Selective) / a.bytes, field(G::Full) / a.bytes);
}

/// Every layout the recommender dropped, with the rules it breaks, one line each.
std::string rejections_text(const std::vector<dsp::plan::Rejection>& rejected) {
  std::string text;
  for (const auto& r : rejected) {
    text += "\n  " + layout_str(r.layout) + ": ";
    for (std::size_t i = 0; i < r.problems.size(); ++i) text += (i ? "; " : "") + r.problems[i];
  }
  return text;
}

void print_recommendations(const std::vector<dsp::plan::Recommendation>& recs,
                           const std::vector<dsp::plan::Rejection>& rejected, const dsp::plan::Cluster& cl, int limit) {
  std::printf("\nrecommended layouts for %d node(s) x %d GPUs x %.0f GB (TP inside a node dividing the heads, then the "
              "smallest PP that fits, then DP):\n", cl.num_nodes, cl.gpus_per_node, gb(cl.gpu_memory_bytes));
  if (recs.empty()) {
    std::printf("  none: no layout of this cluster validates for this model and batch; each breaks a rule:%s\n",
                rejections_text(rejected).c_str());
    return;
  }
  double largest = 0;
  for (std::size_t i = 0; i < recs.size() && i < std::size_t(limit); ++i) largest = std::max(largest, double(recs[i].peak_bytes()));
  const ByteUnit unit = unit_for(largest);
  std::printf("  %-3s %-22s %10s %14s %12s %10s %6s\n", "#", "layout", "recompute", "micro-batches",
              (std::string("worst ") + unit.name).c_str(), "bubble", "fits");
  int shown = 0;
  for (const auto& r : recs) {
    if (shown++ == limit) break;
    std::printf("  %-3d %-22s %10s %14d %12.2f %9.1f%% %6s\n", shown, layout_str(r.plan.layout).c_str(),
                dsp::plan::to_string(r.plan.recompute.granularity).c_str(), r.prediction.micro_batches,
                double(r.peak_bytes()) / unit.bytes, 100.0 * r.prediction.bubble, r.fits ? "yes" : "NO");
  }
  if (!recs.front().fits) {
    std::printf("  no layout fits, even with full recomputation: try --zero-stage 1-3\n");
    if (!rejected.empty()) std::printf("  layouts that break a rule:%s\n", rejections_text(rejected).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dsp-plan: per-rank training and serving memory, validation and layout recommendations"};
  Options o;
  app.add_option("--model-config", o.model_config, "Hugging Face config.json of the model (flags below override it)");
  o.model_flags.add_to(app);
  app.add_option("--tensor-model-parallel-size", o.tensor, "tensor-parallel size");
  app.add_option("--pipeline-model-parallel-size", o.pipeline, "pipeline stages");
  app.add_option("--expert-model-parallel-size", o.expert, "expert-parallel size (divides DP)");
  app.add_option("--world-size", o.world_size, "ranks (default: the cluster's GPUs, else TP x PP); DP = world / (TP x PP)");
  app.add_option("--pipeline-schedule", o.plan.pipeline.schedule, "gpipe, 1f1b or interleaved")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved"}));
  app.add_option("--num-layers-per-virtual-pipeline-stage", o.plan.pipeline.num_layers_per_virtual_stage,
                 "layers per model chunk (interleaved schedule)");
  app.add_option("--pipeline-layer-split", o.plan.pipeline.layer_split, "explicit layers per (virtual) stage, e.g. 16,15,15,14")
      ->delimiter(',');
  app.add_option("--micro-batch-size", o.plan.micro_batch_size, "sequences per micro-batch");
  app.add_option("--global-batch-size", o.plan.global_batch_size, "sequences per step (default: micro-batch-size x world size)");
  app.add_option("--precision", o.precision, "fp32, or bf16 or fp16 mixed precision (dsp-train's --bf16 / --fp16)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--zero-stage", o.plan.zero_stage, "ZeRO stage 0-3 (optimizer state, + gradients, + parameters sharded over DP)")
      ->check(CLI::Range(0, 3));
  o.recompute_flags.add_to(app);
  app.add_option("--ddp-bucket-size", o.plan.ddp_bucket_size, "gradient bucket bytes");
  app.add_option("--serving-tensor-model-parallel-size", o.serving_tensor, "serving TP (default: the training TP)");
  app.add_option("--serving-batch-size", o.serving_batch, "sequences served at once");
  app.add_option("--serving-max-tokens", o.serving_tokens, "tokens per sequence, prompt + generated (default: seq length)");
  app.add_option("--serving-dtype", o.serving_dtype, "fp32 or bf16 weights and KV cache (default: bf16, fp32 with --precision fp32)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--serving-block-size", o.serving_block_size, "tokens per paged KV cache block (dsp-generate's --block-size)")
      ->check(samples::at_least(1));
  app.add_option("--serving-kv-cache-memory", o.serving_kv_cache_memory,
                 "bytes of KV cache per serving rank (dsp-generate's --kv-cache-memory); default: "
                 "--serving-gpu-memory-utilization of --gpu-memory minus weights and workspace")
      ->check(samples::at_least(0));
  app.add_option("--serving-gpu-memory-utilization", o.serving_gpu_memory_utilization,
                 "fraction of --gpu-memory a serving rank may use (dsp-generate's --gpu-memory-utilization)");
  app.add_option("--gpus-per-node", o.cluster.gpus_per_node, "GPUs per node");
  app.add_option("--num-nodes", o.cluster.num_nodes, "nodes");
  app.add_option("--gpu-memory", o.gpu_memory_gb, "memory per GPU, GB (1e9 bytes)");
  app.add_option("--num-recommendations", o.num_recommendations, "layouts to list");

  return samples::run_main(app, argc, argv, [&] {
    namespace plan = dsp::plan;
    // The model: the config file, then the flags given explicitly.
    dsp::model::ModelConfig m;
    if (!o.model_config.empty()) {
      std::ifstream in(o.model_config);
      DSP_CHECK_AS(dsp::InputError, in.good(), "model config '", o.model_config, "' cannot be opened");
      nlohmann::json j;
      try {
        in >> j;
      } catch (const nlohmann::json::exception& e) {
        throw dsp::InputError(dsp::detail::concat("model config '", o.model_config, "' is not valid JSON: ", e.what()));
      }
      const auto file = dsp::model::ModelConfig::from_hf_json(j);
      m = o.model_flags.config(app, &file);
    } else {
      m = o.model_flags.config(app);
    }
    if (o.model_config.empty() && !o.model_flags.any_given(app))
      std::printf("no --model-config or model flags given: planning dsp-train's default model\n");
    print_model(m);

    plan::TrainingPlan base = o.plan;
    base.model = m;
    base.precision = plan::precision_from_name(o.precision);
    base.recompute = o.recompute_flags.config();
    const bool cluster_given = app.count("--gpus-per-node") + app.count("--num-nodes") + app.count("--gpu-memory") > 0;
    o.cluster.gpu_memory_bytes = static_cast<std::int64_t>(o.gpu_memory_gb * 1e9);
    const bool layout_given = app.count("--tensor-model-parallel-size") + app.count("--pipeline-model-parallel-size") > 0;
    const int world = o.world_size > 0 ? o.world_size
                      : cluster_given  ? o.cluster.world_size()
                                       : o.tensor * o.pipeline * o.expert;
    if (app.count("--global-batch-size") == 0) base.global_batch_size = base.micro_batch_size * world;
    base.layout = {.tensor = o.tensor, .pipeline = o.pipeline, .data = std::max(1, world / std::max(1, o.tensor * o.pipeline)),
                   .expert = o.expert};

    std::vector<plan::Recommendation> recs;
    std::vector<plan::Rejection> rejected;
    if (cluster_given) recs = plan::recommend(base, o.cluster, &rejected);
    plan::TrainingPlan chosen = base;
    if (!layout_given && cluster_given) {
      DSP_CHECK_AS(dsp::ConfigError, !recs.empty(), "no layout of ", o.cluster.num_nodes, " node(s) x ",
                   o.cluster.gpus_per_node, " GPUs validates for this model with global batch ",
                   base.global_batch_size, " and micro-batch ", base.micro_batch_size, "; each layout breaks a rule:",
                   rejections_text(rejected));
      chosen = recs.front().plan;
      std::printf("layout: none given; using the first recommendation\n");
    }
    plan::validate(chosen, world);  // every broken rule, with its numbers; exit code 1

    plan::ServingPlan sp{m, o.serving_tensor > 0 ? o.serving_tensor : chosen.layout.tensor, o.serving_batch,
                         o.serving_tokens, 0};
    const std::string sdtype = o.serving_dtype.empty() ? (base.precision == plan::Precision::Fp32 ? "fp32" : "bf16")
                                                       : o.serving_dtype;
    sp.dtype_bytes = sdtype == "fp32" ? 4 : 2;
    m.validate(sp.tensor);
    const plan::MemoryLedger serving = plan::predict_serving(sp);
    print_ledgers(chosen, plan::predict_training(chosen), sp, serving, cluster_given ? o.cluster.gpu_memory_bytes : 0);
    // The serving engine's paged KV cache: blocks of this budget per rank, as serve::Engine sizes it.
    const std::int64_t budget = o.serving_kv_cache_memory >= 0
                                    ? o.serving_kv_cache_memory
                                    : static_cast<std::int64_t>(o.serving_gpu_memory_utilization *
                                                                static_cast<double>(o.cluster.gpu_memory_bytes)) -
                                          serving.parameters - serving.workspace;
    const std::int64_t per_block = plan::kv_cache_bytes_per_block(m, sp.tensor, o.serving_block_size, sp.dtype_bytes);
    const std::int64_t blocks = plan::kv_cache_blocks(m, sp.tensor, o.serving_block_size, sp.dtype_bytes, budget);
    std::printf("\nserving KV cache (paged, TP%d): blocks of %lld tokens, %lld bytes each per rank; a budget of %lld bytes "
                "per rank%s holds %lld blocks = %lld tokens\n",
                sp.tensor, static_cast<long long>(o.serving_block_size), static_cast<long long>(per_block),
                static_cast<long long>(std::max<std::int64_t>(budget, 0)),
                o.serving_kv_cache_memory >= 0 ? " (--serving-kv-cache-memory)" : " (utilization x GPU memory - weights - workspace)",
                static_cast<long long>(blocks), static_cast<long long>(blocks * o.serving_block_size));
    if (cluster_given) print_recommendations(recs, rejected, o.cluster, o.num_recommendations);
  });
}
