#pragma once
// MoELayer: the DeepSeekMoE feed-forward (Dai et al. 2024, DeepSeekMoE, section 3; DeepSeek-V3
// report section 2.1.2): fine-grained routed experts chosen per token by a router, plus shared
// experts every token goes through,
//   y = sum_{e in topk(x)} g_e(x) FFN_e(x) + sum_s FFN_s(x)       x, y [tokens, hidden]
// with expert parallelism (routed experts split over the EP group, tokens moved by an
// ExpertDispatcher) and tensor parallelism (every expert split over TP as the dense MLP is; the
// router replicated). Each TP rank routes the same tokens identically and runs the same
// all-to-all with the same TP rank of the other EP ranks; the routed and shared experts'
// partial outputs are summed and all-reduced over TP once in forward (one all-reduce per
// block, as Megatron's row-parallel output); backward all-reduces over TP twice: the gate
// weights' gradient [tokens, k] (small) and the input gradient.
// Where it runs: the router's GEMM, the experts and every move of token rows run where the
// tensors live (the current memory space: a GPU's memory with backend::Cuda); the routing
// decisions (scores, top-k, capacity, the aux loss and their backward) run on the host from a
// copy of the logits [tokens, E] (tokens x E x 4 bytes per layer and micro-batch; the all-to-all
// needs the per-expert counts on the host anyway), and the logits' gradient goes back the same way.
// The router's GEMMs stay fp32 inside a 16-bit MatmulPrecisionScope (backend/matmul_precision.hpp),
// as DeepSeek-V3's gate computes in fp32 and Megatron's --moe-router-dtype fp32: the routing
// decisions and the aux loss's gradient keep fp32 logits.
// Hugging Face names under "model.layers.{i}.mlp": gate.weight [E, hidden],
// gate.e_score_correction_bias [E] (with the expert bias), experts.{e}.{gate,up,down}_proj.weight
// with the global expert index e, shared_experts.{gate,up,down}_proj.weight.
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dsp/backend/host/elementwise.hpp"
#include "dsp/backend/linear.hpp"
#include "dsp/backend/matmul_precision.hpp"
#include "dsp/comm/communicator.hpp"
#include "dsp/ep/balance.hpp"
#include "dsp/ep/capacity.hpp"
#include "dsp/ep/expert_dispatcher.hpp"
#include "dsp/ep/grouped_experts.hpp"
#include "dsp/ep/router.hpp"
#include "dsp/model/config.hpp"
#include "dsp/model/forward_context.hpp"
#include "dsp/model/parts.hpp"

namespace dsp::model {

/// What an MoE layer's training forwards saw since the last clear(), on this rank.
struct MoeLayerStats {
  std::int64_t layer = -1;                     ///< global layer index
  std::vector<std::int64_t> tokens_per_expert;  ///< [E] times each expert was chosen (before dropping)
  std::int64_t dropped = 0;                    ///< assignments dropped by capacity
  double aux_loss = 0.0;                       ///< sum of the micro-batches' aux loss x aux_loss_scale

  void clear() {
    std::fill(tokens_per_expert.begin(), tokens_per_expert.end(), 0);
    dropped = 0;
    aux_loss = 0.0;
  }
};

/// The global expert index e of a routed expert's tensor name (one holding ".mlp.experts.{e}.",
/// optimizer moments included), nullopt for any other name.
inline std::optional<std::int64_t> expert_index(const std::string& name) {
  static constexpr std::string_view key = ".mlp.experts.";
  const auto at = name.find(key);
  if (at == std::string::npos) return std::nullopt;
  const auto digits = at + key.size(), end = name.find('.', digits);
  if (end == std::string::npos || end == digits) return std::nullopt;
  std::int64_t e = 0;
  for (auto i = digits; i < end; ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    e = e * 10 + (name[i] - '0');
  }
  return e;
}

/// `spec` renamed to global expert `e`: its name and its parts' names (fused gate/up) with
/// ".mlp.experts.{old}." replaced. Throws Error when spec.name is no expert's.
inline ShardedTensor with_expert_index(ShardedTensor spec, std::int64_t e) {
  const auto old = expert_index(spec.name);
  DSP_CHECK(old.has_value(), "with_expert_index: ", spec.name, " is not a routed expert's tensor");
  const std::string from = ".mlp.experts." + std::to_string(*old) + ".", to = ".mlp.experts." + std::to_string(e) + ".";
  const auto rename = [&](std::string& name) {
    const auto at = name.find(from);
    if (at != std::string::npos) name.replace(at, from.size(), to);
  };
  rename(spec.name);
  for (auto& part : spec.parts) rename(part.name);
  return spec;
}

template <class Policy>
class MoELayer {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;
  struct Saved {
    Tensor x;
    ep::Routing routing;
    ep::DispatchPlan plan;
    Tensor back;  // [A, hidden] the experts' partial outputs, in plan order
    typename ep::GroupedExperts<Backend>::Saved routed;
    std::optional<typename ep::GroupedExperts<Backend>::Saved> shared;
    /// The activations (routing and plan: host indices and fp32 statistics, and the plan's
    /// copies of its order and gate weights where the rows live).
    std::vector<Tensor*> tensors() {
      std::vector<Tensor*> out{&x, &back};
      for (Tensor* t : routed.tensors()) out.push_back(t);
      if (shared)
        for (Tensor* t : shared->tensors()) out.push_back(t);
      return out;
    }
  };

  /// Builds this rank's shards of `spec` (MoeSpec::describe of global layer `layer` for this
  /// EP rank), in the spec's order. tp: the tensor-parallel group; ep: the expert-parallel group
  /// (the same TP rank of EP ranks; size 1 holds every expert). Throws ConfigError, naming the
  /// numbers, when the experts do not split over ep.size() or their width over TP; Error when
  /// spec lists other experts than this EP rank's.
  MoELayer(Comm& tp, Comm& ep, const ModelConfig& c, std::int64_t layer, const MoeSpec& spec, std::uint64_t seed)
      : tp_(&tp),
        router_config_(c.router()),
        hidden_(c.hidden_size),
        dispatcher_((c.validate_expert_parallel(ep.size()), ep), c.num_experts, c.hidden_size),
        router_(spec.router, seed, tp.size(), tp.rank()),
        shared_(spec.shared ? std::make_optional<ep::GroupedExperts<Backend>>(std::vector{*spec.shared}, c.hidden_size,
                                                                             seed, tp.size(), tp.rank())
                            : std::nullopt),
        routed_(local_experts(spec), c.hidden_size, seed, tp.size(), tp.rank()),
        bias_(spec.expert_bias ? std::make_optional<Parameter>(*spec.expert_bias, seed, tp.size(), tp.rank())
                               : std::nullopt) {  // a buffer: moved by the balancing step, never by a gradient
    stats_.layer = layer;
    stats_.tokens_per_expert.assign(static_cast<std::size_t>(c.num_experts), 0);
  }

  /// x [tokens, hidden] (the same on every TP rank) -> [tokens, hidden]. In training
  /// (ctx.training) applies ctx.moe's capacity and, unless ctx.recomputing, records the load,
  /// drops and aux loss in stats(). saved (may be null) keeps what backward needs.
  /// Collective over the EP group, then the TP group.
  Tensor forward(const ForwardContext& ctx, const Tensor& x, Saved* saved) {
    const std::int64_t n = x.dim(0), e = router_config_.num_experts;
    Tensor logits({n, e});
    {
      backend::MatmulPrecisionScope fp32(backend::MatmulPrecision::Fp32);  // the router stays fp32 (see the top)
      linear_forward(Backend{}, x.data(), router_.value.data(), logits.data(), n, hidden_, e);
    }
    Tensor logits_copy, bias_copy;  // host copies of tensors in a memory space
    const Tensor& host_logits = on_host(logits, logits_copy);
    ep::Routing r = ep::route(router_config_, host_logits.span(),
                      bias_ ? std::span<const float>(on_host(bias_->value, bias_copy).span()) : std::span<const float>{});
    if (ctx.training) {  // a re-run for recomputation applies the capacity again but counts nothing
      if (!ctx.recomputing) {
        const auto load = ep::expert_load(r);
        for (std::size_t i = 0; i < load.size(); ++i) stats_.tokens_per_expert[i] += load[i];
        if (ctx.moe.aux_loss_coeff > 0.0f)
          stats_.aux_loss += double(ep::sequence_aux_loss(r, ctx.seq, ctx.moe.aux_loss_coeff)) * ctx.moe.aux_loss_scale;
      }
      if (ctx.moe.capacity_factor > 0.0f) {
        const auto dropped =
            ep::apply_capacity(r, ep::expert_capacity(ctx.moe.capacity_factor, n, r.top_k, e), ctx.moe.drop_policy);
        if (!ctx.recomputing) stats_.dropped += dropped.dropped;
      }
    }
    ep::DispatchPlan plan = dispatcher_.plan(r);
    const Tensor local = dispatcher_.dispatch(plan, dispatcher_.permute(plan, x));
    const bool keep_act = !ctx.recompute.selective();
    Tensor back = dispatcher_.undispatch(plan, routed_.forward(local, plan.rows_per_local_expert,
                                                               saved ? &saved->routed : nullptr, keep_act,
                                                               ctx.activations));
    precision::round_activations(Backend{}, ctx.activations, back);
    Tensor y = dispatcher_.combine(plan, r, back);
    if (shared_) {
      if (saved) saved->shared.emplace();
      const Tensor s = shared_->forward(x, {n}, saved ? &*saved->shared : nullptr, keep_act, ctx.activations);
      add(Backend{}, s.numel(), s.data(), y.data());
    }
    if (tp_->size() > 1) tp_->all_reduce(y.raw_span());
    if (saved) {
      saved->x = x;
      saved->routing = std::move(r);
      saved->plan = std::move(plan);
      saved->back = std::move(back);
    }
    return y;
  }

  /// dy [tokens, hidden] -> dx [tokens, hidden]; accumulates the router's and experts'
  /// gradients (an expert that got no tokens gets exactly zero), including the aux loss's
  /// (ctx.moe). Collective over the TP group and the EP group.
  Tensor backward(const ForwardContext& ctx, const Tensor& dy, const Saved& s) {
    const ep::Routing& r = s.routing;
    const std::int64_t n = dy.dim(0), e = router_config_.num_experts;
    std::vector<float> dweights(r.weights.size(), 0.0f);
    Tensor dback = dispatcher_.combine_backward(s.plan, r, s.back, dy, dweights);
    if (tp_->size() > 1) tp_->all_reduce(std::span(dweights));  // the rows were partial over TP
    Tensor dlocal = routed_.backward(dispatcher_.dispatch(s.plan, std::move(dback)), s.routed);
    Tensor dx = dispatcher_.unpermute(s.plan, dispatcher_.undispatch(s.plan, std::move(dlocal)), n);
    if (shared_) {
      const Tensor ds = shared_->backward(dy, *s.shared);
      add(Backend{}, ds.numel(), ds.data(), dx.data());
    }
    if (tp_->size() > 1) tp_->all_reduce(dx.raw_span());
    // The router: the same on every TP rank (dweights are summed), so added after the reduce.
    std::vector<float> host_dlogits(static_cast<std::size_t>(n * e), 0.0f);
    ep::route_backward(router_config_, r, dweights, host_dlogits);
    if (ctx.moe.aux_loss_coeff > 0.0f)
      ep::sequence_aux_loss_backward(router_config_, r, ctx.seq, ctx.moe.aux_loss_coeff,
                                 ctx.moe.aux_loss_scale * ctx.moe.loss_scale, host_dlogits);
    Tensor dlogits({n, e});
    dlogits.copy_from_host(host_dlogits);
    Tensor dx_router({n, hidden_});
    {
      backend::MatmulPrecisionScope fp32(backend::MatmulPrecision::Fp32);
      linear_backward_weight(Backend{}, dlogits.data(), s.x.data(), router_.grad.data(), n, hidden_, e);
      linear_backward_input(Backend{}, dlogits.data(), router_.value.data(), dx_router.data(), n, hidden_, e);
    }
    add(Backend{}, dx.numel(), dx_router.data(), dx.data());
    return dx;
  }

  /// The router, the shared experts, then this rank's routed experts (Parameter::expert).
  std::vector<Parameter*> parameters() {
    std::vector<Parameter*> p{&router_};
    if (shared_)
      for (auto* q : shared_->parameters()) p.push_back(q);
    for (auto* q : routed_.parameters()) p.push_back(q);
    return p;
  }
  /// State that is not trained by gradients but saved: the expert bias (empty without it).
  std::vector<Parameter*> buffers() {
    if (bias_) return {&*bias_};
    return {};
  }
  /// The correction bias [E], null without --moe-router-enable-expert-bias.
  Parameter* expert_bias() { return bias_ ? &*bias_ : nullptr; }

  MoeLayerStats& stats() { return stats_; }
  const ep::ExpertDispatcher<Comm, Backend>& dispatcher() const { return dispatcher_; }

 private:
  // t itself on the host, else a host copy of it in `copy`.
  static const Tensor& on_host(const Tensor& t, Tensor& copy) {
    if (!t.space()) return t;
    copy = t.to_host();
    return copy;
  }

  // spec's routed experts, checked to be the dispatcher's local experts.
  const std::vector<tp::SwiGluSpec>& local_experts(const MoeSpec& spec) const {
    DSP_CHECK(spec.first_expert == dispatcher_.first_local_expert() &&
                  static_cast<std::int64_t>(spec.experts.size()) == dispatcher_.num_local_experts(),
              "MoE layer: the spec lists experts [", spec.first_expert, ", ",
              spec.first_expert + static_cast<std::int64_t>(spec.experts.size()), "), this expert-parallel rank holds [",
              dispatcher_.first_local_expert(), ", ",
              dispatcher_.first_local_expert() + dispatcher_.num_local_experts(), ")");
    return spec.experts;
  }

  Comm* tp_;
  ep::RouterConfig router_config_;
  std::int64_t hidden_;
  ep::ExpertDispatcher<Comm, Backend> dispatcher_;
  // Declared (so allocated) in the order of MoeSpec: router, shared experts, routed experts, bias.
  Parameter router_;
  std::optional<ep::GroupedExperts<Backend>> shared_;
  ep::GroupedExperts<Backend> routed_;
  std::optional<Parameter> bias_;
  MoeLayerStats stats_;
};

}  // namespace dsp::model
