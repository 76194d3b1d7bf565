#pragma once
// The model flags dsp-train and dsp-plan share (Megatron spelling), and the rules that turn
// them into a ModelConfig: --num-query-groups defaults to the heads, --moe-ffn-hidden-size to
// --ffn-hidden-size, --moe-shared-expert-intermediate-size counts shared experts, embeddings
// are tied unless --untie-embeddings-and-output-weights, MoE flags need --num-experts, MLA's
// widths need --multi-latent-attention (whose unset widths take Megatron's defaults).
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "dsp/core/divide.hpp"
#include "dsp/model/config.hpp"
#include "dsp/model/recompute.hpp"

namespace samples {

class ModelFlags {
 public:
  /// Adds every model flag to `app`, writing into this object.
  void add_to(CLI::App& app) {
    using C = dsp::model::ModelConfig;
    option(app, "--num-layers", &C::num_layers, "decoder layers");
    option(app, "--hidden-size", &C::hidden_size, "hidden size");
    option(app, "--num-attention-heads", &C::num_attention_heads, "attention heads");
    option(app, "--num-query-groups", &C::num_query_groups, "key/value heads (GQA); default = heads");
    option(app, "--ffn-hidden-size", &C::ffn_hidden_size, "SwiGLU intermediate size");
    option(app, "--seq-length", &C::seq_length, "tokens per sequence");
    option(app, "--vocab-size", &C::vocab_size, "vocabulary (bytes: 256)");
    option(app, "--rotary-base", &C::rope_theta, "RoPE theta");
    option(app, "--norm-epsilon", &C::norm_epsilon, "RMSNorm epsilon");
    option(app, "--init-method-std", &C::init_method_std, "std of the normal initialisation");
    flag(app, "--use-flash-attn", &C::use_flash_attn,
         "memory-efficient attention: keep each query's log-sum-exp for backward, not the [s, s] probabilities");
    app.add_flag("--untie-embeddings-and-output-weights", untie_, "separate output layer (default: tied)");
    app.add_flag("--multi-latent-attention")
        ->description("Multi-head Latent Attention (DeepSeek-V2/V3) instead of GQA; its serving cache is the KV latent");
    option(app, "--q-lora-rank", &C::q_lora_rank, "MLA: query latent width (default: none, a full q_proj)");
    option(app, "--kv-lora-rank", &C::kv_lora_rank, "MLA: the cached key/value latent width (default 32)");
    option(app, "--qk-head-dim", &C::qk_nope_head_dim, "MLA: per-head query/key width without RoPE (default 128)");
    option(app, "--qk-pos-emb-head-dim", &C::qk_rope_head_dim,
           "MLA: the decoupled RoPE width, one key shared by all heads (default 64)");
    option(app, "--v-head-dim", &C::v_head_dim, "MLA: per-head value width (default 128)");
    option(app, "--num-experts", &C::num_experts, "routed experts per MoE layer (0: dense model)");
    option(app, "--moe-router-topk", &C::moe_router_topk, "experts per token");
    option(app, "--moe-ffn-hidden-size", &C::moe_ffn_hidden_size,
           "SwiGLU intermediate size of each expert (default: ffn-hidden-size)");
    app.add_option("--moe-shared-expert-intermediate-size", shared_expert_intermediate_size_,
                   "total intermediate size of the shared experts (a multiple of moe-ffn-hidden-size)");
    option(app, "--num-shared-experts", &C::num_shared_experts,
           "shared experts, each moe-ffn-hidden-size wide (or give the total size above)");
    option(app, "--first-k-dense-replace", &C::first_k_dense_replace,
           "leading dense layers before the MoE layers (Megatron: --moe-layer-freq [0]*K+[1]*(L-K))");
    app.add_option("--moe-router-score-function", score_function_, "softmax (DeepSeek-V2) or sigmoid (DeepSeek-V3)")
        ->check(CLI::IsMember({"softmax", "sigmoid"}));
    flag(app, "--moe-router-norm-topk-prob", &C::moe_router_norm_topk_prob,
         "renormalise the top-k gate weights to sum 1 (always with sigmoid)");
    option(app, "--moe-router-topk-scaling-factor", &C::moe_router_topk_scaling_factor,
           "multiplies every gate weight (routed_scaling_factor)");
    option(app, "--moe-router-num-groups", &C::moe_router_num_groups, "expert groups for group-limited routing");
    option(app, "--moe-router-group-topk", &C::moe_router_group_topk, "groups each token may pick experts from");
    flag(app, "--moe-router-enable-expert-bias", &C::moe_router_enable_expert_bias,
         "auxiliary-loss-free balancing: a per-expert bias on the selection scores, updated every step");
  }

  /// The model of the flags given: over `base` (e.g. a config.json) only the flags on the
  /// command line; without a base, the defaults above. moe_training_flags: the caller's other
  /// flags that need an MoE model (checked when the result is dense). Throws ConfigError for a
  /// shared-expert size that does not divide, both shared-expert flags, or an MoE flag
  /// without experts.
  dsp::model::ModelConfig config(const CLI::App& app, const dsp::model::ModelConfig* base = nullptr,
                                 const std::vector<std::string>& moe_training_flags = {}) const {
    dsp::model::ModelConfig m = base ? *base : model_;
    if (base)
      for (const auto& [name, copy] : fields_)
        if (app.count(name) > 0) copy(m, model_);
    if (!base || app.count("--untie-embeddings-and-output-weights") > 0) m.tie_word_embeddings = !untie_;
    if (!base && app.count("--num-query-groups") == 0) m.num_query_groups = m.num_attention_heads;
    apply_mla(app, base, m);
    if (app.count("--moe-router-score-function") > 0)
      m.moe_router_score_function =
          score_function_ == "sigmoid" ? dsp::ep::ScoreFunction::Sigmoid : dsp::ep::ScoreFunction::Softmax;
    if (m.num_experts == 0) {  // dense (a negative count is left to ModelConfig::validate)
      std::vector<std::string> moe_flags = moe_training_flags;
      for (const auto& [name, copy] : fields_)
        if (name.starts_with("--moe-") || name == "--num-shared-experts" || name == "--first-k-dense-replace")
          moe_flags.push_back(name);
      moe_flags.insert(moe_flags.end(), {"--moe-shared-expert-intermediate-size", "--moe-router-score-function"});
      for (const auto& flag : moe_flags)
        DSP_CHECK_AS(dsp::ConfigError, app.count(flag) == 0, flag, " needs an MoE model (--num-experts > 0)");
      return m;
    }
    if (m.moe_ffn_hidden_size == 0) m.moe_ffn_hidden_size = m.ffn_hidden_size;
    if (app.count("--moe-shared-expert-intermediate-size") > 0) {
      DSP_CHECK_AS(dsp::ConfigError, app.count("--num-shared-experts") == 0,
                   "give --moe-shared-expert-intermediate-size or --num-shared-experts, not both");
      m.num_shared_experts =
          dsp::divide(shared_expert_intermediate_size_, m.moe_ffn_hidden_size, "--moe-shared-expert-intermediate-size",
                      "--moe-ffn-hidden-size");
    }
    return m;
  }

  /// Whether the command line gives any model flag.
  bool any_given(const CLI::App& app) const {
    for (const auto& [name, copy] : fields_)
      if (app.count(name) > 0) return true;
    return app.count("--untie-embeddings-and-output-weights") + app.count("--moe-shared-expert-intermediate-size") +
               app.count("--moe-router-score-function") + app.count("--multi-latent-attention") > 0;
  }

 private:
  static constexpr const char* kMlaWidths[] = {"--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
                                               "--qk-pos-emb-head-dim", "--v-head-dim"};

  // --multi-latent-attention: the widths not given (nor in the base) take Megatron-Core's
  // defaults (kv_lora_rank 32, qk_head_dim 128, qk_pos_emb_head_dim 64, v_head_dim 128, no
  // query latent); a width given must be positive (--q-lora-rank 0: none). MLA has no query
  // groups: --num-query-groups other than the heads is refused, and they are set to the heads.
  // Without it, a width flag on a GQA model is a ConfigError naming it.
  void apply_mla(const CLI::App& app, const dsp::model::ModelConfig* base, dsp::model::ModelConfig& m) const {
    if (app.count("--multi-latent-attention") == 0) {
      if (base && base->is_mla()) return;
      for (const char* flag : kMlaWidths)
        DSP_CHECK_AS(dsp::ConfigError, app.count(flag) == 0, flag, " needs --multi-latent-attention");
      return;
    }
    using C = dsp::model::ModelConfig;
    for (auto [flag, field, fallback] : {std::tuple{"--kv-lora-rank", &C::kv_lora_rank, 32},
                                         {"--qk-head-dim", &C::qk_nope_head_dim, 128},
                                         {"--qk-pos-emb-head-dim", &C::qk_rope_head_dim, 64},
                                         {"--v-head-dim", &C::v_head_dim, 128}}) {
      if (app.count(flag) == 0 && m.*field == 0) m.*field = fallback;
      DSP_CHECK_AS(dsp::ConfigError, m.*field > 0, flag, " must be positive with --multi-latent-attention, got ", m.*field);
    }
    DSP_CHECK_AS(dsp::ConfigError, app.count("--num-query-groups") == 0 || m.num_query_groups == m.num_attention_heads,
                 "--num-query-groups ", m.num_query_groups, " with --multi-latent-attention: MLA has no query groups ",
                 "(every head reads the one latent); leave it out or give the heads, ", m.num_attention_heads);
    m.num_query_groups = m.num_attention_heads;
  }

  using Copy = std::function<void(dsp::model::ModelConfig&, const dsp::model::ModelConfig&)>;

  template <class T>
  void option(CLI::App& app, const char* name, T dsp::model::ModelConfig::*member, const char* help) {
    app.add_option(name, model_.*member, help);
    fields_.emplace_back(name, [member](auto& to, const auto& from) { to.*member = from.*member; });
  }
  void flag(CLI::App& app, const char* name, bool dsp::model::ModelConfig::*member, const char* help) {
    app.add_flag(name, model_.*member, help);
    fields_.emplace_back(name, [member](auto& to, const auto& from) { to.*member = from.*member; });
  }

  dsp::model::ModelConfig model_;
  bool untie_ = false;
  std::int64_t shared_expert_intermediate_size_ = 0;
  std::string score_function_ = "softmax";
  std::vector<std::pair<std::string, Copy>> fields_;  // flag -> copies its field from the flags' model
};

/// --recompute-granularity, --recompute-method, --recompute-num-layers (dsp-train trains with
/// them, dsp-plan predicts them).
class RecomputeFlags {
 public:
  void add_to(CLI::App& app) {
    app.add_option("--recompute-granularity", granularity_,
                   "activation recomputation: none, selective (attention core and MLP activation) or full (whole layers)")
        ->check(CLI::IsMember({"none", "selective", "full"}));
    app.add_option("--recompute-method", method_,
                   "full recomputation: uniform (groups of --recompute-num-layers) or block (the first "
                   "--recompute-num-layers layers of each stage)")
        ->check(CLI::IsMember({"uniform", "block"}));
    app.add_option("--recompute-num-layers", num_layers_,
                   "layers per recompute group (uniform) or recomputed per stage (block)");
  }
  /// Throws ConfigError as RecomputeConfig::from_names.
  dsp::model::RecomputeConfig config() const {
    return dsp::model::RecomputeConfig::from_names(granularity_, method_, num_layers_);
  }

 private:
  std::string granularity_ = "none", method_ = "uniform";
  std::int64_t num_layers_ = 1;
};

}  // namespace samples
