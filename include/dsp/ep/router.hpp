#pragma once
// Mixture-of-experts routers: which top-k experts each token goes to and with what gate
// weight. Softmax top-k (DeepSeek-V2 report: scores softmax over all experts, optional
// renormalisation of the k weights) and sigmoid scores with a per-expert correction bias
// (DeepSeek-V3 report section 2.1.2, eqs 12-16: the bias changes which experts are chosen,
// never the gate weights, which come from the unbiased scores and are normalised to sum 1),
// both optionally group-limited (Hugging Face modeling_deepseek MoEGate, n_group/topk_group)
// and scaled by routed_scaling_factor. Router math is fp32 with fp64 sums.
//   scores s = softmax(z) or sigmoid(z)        z: logits [tokens, E]
//   chosen   = topk_k(s + bias, groups masked)  (ties to the lower expert index; a group scores
//              the sum of its top-2, or its top-1 with GroupScore::Max, as DeepSeek-V3 / -V2)
//   weights  = scale * s[chosen] (/ sum s[chosen] when normalising)
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "dsp/backend/host/elementwise.hpp"
#include "dsp/backend/host/router.hpp"
#include "dsp/backend/host/sigmoid.hpp"
#include "dsp/backend/host/softmax.hpp"
#include "dsp/core/error.hpp"

namespace dsp::ep {

/// How router logits become scores: softmax over the experts (DeepSeek-V2) or an
/// independent sigmoid per expert (DeepSeek-V3).
enum class ScoreFunction { Softmax, Sigmoid };

/// Router hyper-parameters (Megatron flag / Hugging Face field in the comments).
struct RouterConfig {
  std::int64_t num_experts = 8;  ///< E, routed experts (--num-experts / n_routed_experts)
  std::int64_t top_k = 2;        ///< k, experts per token (--moe-router-topk / num_experts_per_tok)
  ScoreFunction score = ScoreFunction::Softmax;
  bool norm_topk_prob = false;   ///< renormalise the k weights to sum 1 (always on for Sigmoid)
  std::int64_t num_groups = 1;   ///< expert groups (--moe-router-num-groups / n_group)
  std::int64_t group_topk = 1;   ///< groups kept per token (--moe-router-group-topk / topk_group)
  float routed_scaling_factor = 1.0f;  ///< multiplies every gate weight (routed_scaling_factor)
  /// How a group is scored: TopTwoSum (DeepSeek-V3, topk_method noaux_tc) or Max (DeepSeek-V2,
  /// topk_method group_limited_greedy).
  backend::GroupScore group_score = backend::GroupScore::TopTwoSum;

  /// Whether the k weights are divided by their sum: norm_topk_prob, or Sigmoid scores
  /// (V3 eq. 13), and only for k > 1 (as Hugging Face and Megatron: one weight stays s_e).
  bool normalizes() const { return top_k > 1 && (norm_topk_prob || score == ScoreFunction::Sigmoid); }

  /// Throws ConfigError naming the numbers unless E >= 1, 1 <= k <= E, groups >= 1 divides E,
  /// 1 <= group_topk <= groups, k <= group_topk * E / groups (enough experts in the kept
  /// groups), and routed_scaling_factor is finite and > 0.
  void validate() const {
    DSP_CHECK_AS(ConfigError, num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
    DSP_CHECK_AS(ConfigError, top_k >= 1 && top_k <= num_experts, "router top_k (", top_k,
                 ") must be in [1, num_experts = ", num_experts, "]");
    DSP_CHECK_AS(ConfigError, num_groups >= 1 && num_experts % num_groups == 0, "router num_groups (", num_groups,
                 ") must be >= 1 and divide num_experts (", num_experts, ")");
    DSP_CHECK_AS(ConfigError, group_topk >= 1 && group_topk <= num_groups, "router group_topk (", group_topk,
                 ") must be in [1, num_groups = ", num_groups, "]");
    DSP_CHECK_AS(ConfigError, top_k <= group_topk * (num_experts / num_groups), "router top_k (", top_k,
                 ") exceeds the experts of the kept groups: group_topk (", group_topk, ") x experts per group (",
                 num_experts / num_groups, ")");
    DSP_CHECK_AS(ConfigError, std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0.0f,
                 "routed_scaling_factor must be finite and > 0, got ", routed_scaling_factor);
  }
};

/// The routing of a batch of tokens (fp32): what the forward chose and what backward needs.
struct Routing {
  std::int64_t tokens = 0, top_k = 0, num_experts = 0;
  std::vector<std::int32_t> experts;  ///< [tokens, top_k] chosen experts, best biased score first
  std::vector<float> weights;         ///< [tokens, top_k] gate weights (0 where dropped)
  std::vector<float> scores;          ///< [tokens, E] softmax or sigmoid of the logits, unbiased
  std::vector<std::uint8_t> kept;     ///< [tokens, top_k] 1 = kept, 0 = dropped by capacity
};

namespace detail {
/// dlogits [tokens, E] += d(scores)/d(logits)^T dscores; dscores [tokens, E] is consumed.
template <class Backend>
void add_scores_backward(ScoreFunction score, const Routing& r, std::vector<float>& dscores, std::span<float> dlogits) {
  const std::int64_t n = r.tokens * r.num_experts;
  DSP_CHECK(static_cast<std::int64_t>(dlogits.size()) == n, "router backward: dlogits has ", dlogits.size(),
            " values, expected tokens x experts = ", r.tokens, " x ", r.num_experts);
  if (score == ScoreFunction::Softmax)
    softmax_backward(Backend{}, r.scores.data(), dscores.data(), r.tokens, r.num_experts, dscores.data());
  else
    sigmoid_backward(Backend{}, n, r.scores.data(), dscores.data(), dscores.data());
  add(Backend{}, n, dscores.data(), dlogits.data());
}

inline void check_matches(const RouterConfig& cfg, const Routing& r) {
  DSP_CHECK(cfg.num_experts == r.num_experts && cfg.top_k == r.top_k, "router backward: routing of E=",
            r.num_experts, ", k=", r.top_k, " does not match the config (E=", cfg.num_experts, ", k=", cfg.top_k, ")");
}
}  // namespace detail

/// Routes logits [tokens, E] (tokens = logits.size() / E) with the correction bias [E] (empty
/// = none; it only changes the choice). Returns experts, weights, scores, all kept. Throws
/// ConfigError for a bad config, Error when logits.size() is not a multiple of E, the bias is
/// neither empty nor [E], or a score is NaN.
template <class Backend = backend::Host>
Routing route(const RouterConfig& cfg, std::span<const float> logits, std::span<const float> bias = {}) {
  cfg.validate();
  const std::int64_t e = cfg.num_experts, k = cfg.top_k, size = static_cast<std::int64_t>(logits.size());
  DSP_CHECK(size % e == 0, "route: ", size, " logits are not a multiple of num_experts (", e, ")");
  DSP_CHECK(bias.empty() || static_cast<std::int64_t>(bias.size()) == e, "route: bias has ", bias.size(),
            " values, expected 0 or num_experts (", e, ")");
  Routing r;
  r.tokens = size / e;
  r.top_k = k;
  r.num_experts = e;
  r.scores.resize(logits.size());
  r.experts.resize(static_cast<std::size_t>(r.tokens * k));
  r.weights.resize(r.experts.size());
  r.kept.assign(r.experts.size(), 1);
  if (cfg.score == ScoreFunction::Softmax) softmax_forward(Backend{}, logits.data(), r.tokens, e, e, r.scores.data());
  else sigmoid_forward(Backend{}, size, logits.data(), r.scores.data());
  router_topk(Backend{}, r.scores.data(), bias.empty() ? nullptr : bias.data(), r.tokens, e, cfg.num_groups,
              cfg.group_topk, k, r.experts.data(), cfg.group_score);
  router_gate_weights(Backend{}, r.scores.data(), r.experts.data(), r.tokens, e, k, cfg.normalizes(),
                      cfg.routed_scaling_factor, r.weights.data());
  return r;
}

/// Backward of route: d(weights) [tokens, k] -> adds d(logits) [tokens, E], through the
/// scaling, the normalisation and the scores; the selection is piecewise constant and the bias
/// gets no gradient. Dropped slots (kept == 0) have weight constant 0: their dweights are
/// ignored. Throws Error when the sizes or the config do not match the routing.
template <class Backend = backend::Host>
void route_backward(const RouterConfig& cfg, const Routing& r, std::span<const float> dweights,
                    std::span<float> dlogits) {
  detail::check_matches(cfg, r);
  DSP_CHECK(dweights.size() == r.weights.size(), "route_backward: dweights has ", dweights.size(),
            " values, expected tokens x k = ", r.weights.size());
  std::vector<float> dscores(r.scores.size());
  router_gate_weights_backward(Backend{}, r.scores.data(), r.experts.data(), r.kept.data(), dweights.data(), r.tokens,
                               r.num_experts, r.top_k, cfg.normalizes(), cfg.routed_scaling_factor, dscores.data());
  detail::add_scores_backward<Backend>(cfg.score, r, dscores, dlogits);
}

/// Tokens per expert [E] of the selection (before any capacity dropping): what the
/// auxiliary-loss-free bias update and the load metrics read.
template <class Backend = backend::Host>
std::vector<std::int64_t> expert_load(const Routing& r) {
  std::vector<std::int64_t> load(static_cast<std::size_t>(r.num_experts));
  expert_counts(Backend{}, r.experts.data(), static_cast<std::int64_t>(r.experts.size()), r.num_experts, load.data());
  return load;
}

}  // namespace dsp::ep
