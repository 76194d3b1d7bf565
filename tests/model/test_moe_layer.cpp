// model::MoELayer and ep::ExpertDispatcher against references written here.
//
// The layer (forward and backward) runs with comm::launch over TP x EP ranks (DP = EP, every DP
// rank with its own tokens, 10 or 15 of them) at (TP, EP) = (1,1), (1,2), (1,4), (2,2), for
// softmax and sigmoid routing (expert bias, group-limited selection, routed scaling factor,
// normalised weights), with and without shared experts. The reference is plain fp64 loops over
// the GLOBAL weights, drawn as TP1 dsp::Parameters of the same Hugging Face names (values
// depend on (seed, name, global index) only, so this is the global tensor of every layout and
// every layer's shard must equal its slice of it bitwise): per token
//   y = sum over kept chosen experts e of g_e SwiGLU_e(x) + SwiGLU_shared(x)
// and its hand-written backward (SwiGLU, gate weights through normalisation and scaling,
// softmax / sigmoid). Only the expert choice comes from ep::route (on the reference's logits
// rounded to fp32), and capacity dropping from ep::apply_capacity: both are tested against their
// own references in test_router.cpp; the layer's choice and drops must equal them exactly.
// Compared: y, dx, the router gradient, every shared and routed expert gradient (a routed
// expert's gradient sums the tokens of every EP rank; router and shared gradients are the
// rank's own tokens, before any DP reduction). Further cases: every token routed to EP rank 0's
// experts (the other ranks receive nothing and their expert gradients are exactly 0, as is that
// of an expert of rank 0 no token chose); a small capacity factor (drops counted in stats(), the
// aux loss independent of the capacity); ExpertDispatcher's plan, dispatch / undispatch (bitwise)
// and combine / combine_backward against counts and sums by hand at EP 1, 2, 4; experts not
// divisible by EP.
//
// Tolerance: norm-wise relative error (tests/relative_error.hpp) below kTol = 1e-6. The layer is
// fp32 with short sums (hidden 16, expert width 4..16, k <= 3 slots, a TP all-reduce of 2
// partials); a dot product of random-sign terms loses u = 6e-8 relative to sum |a_i b_i|, which
// exceeds |sum a_i b_i| by a few times, and the router gradient also goes through differences of
// near-equal terms (normalised weights: w_2 (dg_1 - dg_2) / D; softmax: s (ds - <ds, s>)).
// Rounding the fp64 reference to fp32 for the comparison adds at most 6e-8. Measured worst cases
// over all cases below: router gradient 5.3e-7 (sigmoid, every token on EP rank 0), routed
// expert gradients 3.7e-7, output 3.4e-7, shared expert gradients 2.2e-7, dx 1.9e-7. A wrong
// expert, slot, weight, a missing TP reduction or term is an O(1e-2 .. 1) error. A reference
// gradient that is exactly zero (an expert no token reached) must be exactly zero in the layer.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "../backend/gradcheck.hpp"
#include "../relative_error.hpp"
#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/model/moe_layer.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/policy.hpp"

using namespace dsp;

namespace ep_moe_layer_test {
using P = Policy<backend::Host, comm::ThreadComm>;
using Moe = model::MoELayer<P>;
using ep::ScoreFunction;
using test::random_vector;
using test::relative_error;

namespace {

constexpr double kTol = 1e-6;
constexpr std::int64_t kLayer = 3, kSeq = 5, kHidden = 16, kExperts = 8;
constexpr std::uint64_t kSeed = 42;
constexpr float kDownStd = 0.2f;
const std::string kPrefix = "model.layers.3.mlp";  // kLayer's Hugging Face prefix

// ---------------------------------------------------------------------------------------------
// Configurations

struct RoutingCase {
  const char* name;
  ScoreFunction score;
  std::int64_t top_k;
  bool norm_topk_prob;
  std::int64_t groups, group_topk;
  float scaling;
  bool expert_bias;
  std::int64_t shared;  // shared experts
};

// init std 0.3 makes the router logits O(1) (well-separated choices) and the outputs O(1).
model::ModelConfig config_of(const RoutingCase& r) {
  model::ModelConfig c{.hidden_size = kHidden, .init_method_std = 0.3f};
  c.num_experts = kExperts;
  c.moe_router_topk = r.top_k;
  c.moe_ffn_hidden_size = 8;
  c.num_shared_experts = r.shared;
  c.moe_router_score_function = r.score;
  c.moe_router_norm_topk_prob = r.norm_topk_prob;
  c.moe_router_num_groups = r.groups;
  c.moe_router_group_topk = r.group_topk;
  c.moe_router_topk_scaling_factor = r.scaling;
  c.moe_router_enable_expert_bias = r.expert_bias;
  return c;
}

std::vector<RoutingCase> routing_cases() {
  using enum ScoreFunction;
  return {
      {"softmax k2", Softmax, 2, false, 1, 1, 1.0f, false, 0},
      {"softmax k3 normalised, 1 shared", Softmax, 3, true, 1, 1, 1.0f, false, 1},
      {"sigmoid k2 bias scale 1.5", Sigmoid, 2, false, 1, 1, 1.5f, true, 0},
      {"sigmoid k3 bias groups 4/2 scale 2.5, 2 shared", Sigmoid, 3, false, 4, 2, 2.5f, true, 2},
  };
}

// A non-zero correction bias, the same on every rank ([-0.2, 0.2]: sigmoid scores spread ~0.15,
// so it changes some choices).
std::vector<float> bias_of(const model::ModelConfig& c) {
  return c.moe_router_enable_expert_bias ? random_vector(static_cast<std::size_t>(c.num_experts), 9, -0.2f, 0.2f)
                                         : std::vector<float>{};
}

// DP rank dp's micro-batch: 2 or 3 sequences of kSeq tokens (uneven over the EP ranks), x and dy
// uniform in [-1, 1).
struct Batch {
  std::int64_t sequences;
  std::vector<float> x, dy;
  std::int64_t tokens() const { return sequences * kSeq; }
};
Batch batch_of(int dp) {
  const std::int64_t b = 2 + dp % 2, n = b * kSeq * kHidden;
  const auto size = static_cast<std::size_t>(n);
  return {b, random_vector(size, 100 + dp), random_vector(size, 200 + dp)};
}

// Hugging Face names of the layer's parameters.
std::string expert_prefix(std::int64_t e) { return kPrefix + ".experts." + std::to_string(e); }
const std::string kShared = kPrefix + ".shared_experts", kRouter = kPrefix + ".gate.weight";
std::string gate_up_name(const std::string& ffn) { return ffn + ".gate_up_proj.weight"; }
std::string down_name(const std::string& ffn) { return ffn + ".down_proj.weight"; }

// moe.parameters() in its documented order: router, shared experts, routed experts [first, first + count).
std::vector<std::string> expected_names(const model::ModelConfig& c, std::int64_t first, std::int64_t count) {
  std::vector<std::string> names{kRouter};
  auto ffn = [&](const std::string& p) {
    names.push_back(gate_up_name(p));
    names.push_back(down_name(p));
  };
  if (c.num_shared_experts > 0) ffn(kShared);
  for (std::int64_t e = first; e < first + count; ++e) ffn(expert_prefix(e));
  return names;
}

// ---------------------------------------------------------------------------------------------
// The fp64 reference

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

class Reference {
 public:
  struct Param {
    Tensor value;               // global fp32 weights
    std::vector<double> grad;   // global fp64 gradient
  };
  struct Output {
    std::vector<double> y, dx;
    std::vector<std::int32_t> experts;  // [tokens, k] the choice
    std::vector<std::uint8_t> kept;     // [tokens, k] after capacity
  };

  Reference(const model::ModelConfig& c, std::vector<float> bias) : c_(c), bias_(std::move(bias)) {
    add(ShardedTensor::replicated(kRouter, {c.num_experts, kHidden}), c.init_method_std);
    for (std::int64_t e = 0; e < c.num_experts; ++e) add_ffn(expert_prefix(e), c.moe_ffn_hidden_size);
    if (c.num_shared_experts > 0) add_ffn(kShared, c.num_shared_experts * c.moe_ffn_hidden_size);
  }

  const Param& param(const std::string& name) const {
    const auto it = params_.find(name);
    REQUIRE_MESSAGE(it != params_.end(), "the layer has a parameter the reference does not know: ", name);
    return it->second;
  }

  /// One rank's tokens x [n, hidden] with output gradient dy: returns y and dx, accumulates the
  /// parameter gradients. opt.capacity_factor > 0 drops assignments as the layer's training
  /// forward does.
  Output run(const std::vector<float>& x, const std::vector<float>& dy, const ep::MoeOptions& opt) {
    const std::int64_t h = kHidden, E = c_.num_experts, k = c_.moe_router_topk,
                       n = static_cast<std::int64_t>(x.size()) / h;
    const ep::RouterConfig rc = c_.router();
    const Tensor& wr = params_.at(kRouter).value;
    std::vector<double> z(static_cast<std::size_t>(n * E));
    std::vector<float> zf(z.size());
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t e = 0; e < E; ++e) {
        double s = 0;
        for (std::int64_t i = 0; i < h; ++i) s += double(wr[e * h + i]) * x[t * h + i];
        z[t * E + e] = s;
        zf[t * E + e] = static_cast<float>(s);
      }
    ep::Routing r = ep::route(rc, zf, bias_);
    if (opt.capacity_factor > 0.0f)
      ep::apply_capacity(r, ep::expert_capacity(opt.capacity_factor, n, k, E), opt.drop_policy);

    Output out{std::vector<double>(x.size()), std::vector<double>(x.size()), r.experts, r.kept};
    for (std::int64_t t = 0; t < n; ++t) {
      const std::vector<double> xt(x.begin() + t * h, x.begin() + (t + 1) * h),
          dyt(dy.begin() + t * h, dy.begin() + (t + 1) * h);
      // scores, gate weights g_j = scale * s_j / D (D = sum of the k chosen scores when normalising)
      std::vector<double> s(E);
      double zmax = -INFINITY, zsum = 0;
      for (std::int64_t e = 0; e < E; ++e) zmax = std::max(zmax, z[t * E + e]);
      for (std::int64_t e = 0; e < E; ++e) zsum += std::exp(z[t * E + e] - zmax);
      for (std::int64_t e = 0; e < E; ++e)
        s[e] = rc.score == ScoreFunction::Softmax ? std::exp(z[t * E + e] - zmax) / zsum : sigmoid(z[t * E + e]);
      const auto chosen = [&](std::int64_t j) { return r.experts[t * k + j]; };
      const auto kept = [&](std::int64_t j) { return r.kept[t * k + j] != 0; };
      double D = 1.0;
      if (rc.normalizes()) {
        D = 0.0;
        for (std::int64_t j = 0; j < k; ++j) D += s[chosen(j)];
      }
      // forward
      std::vector<std::vector<double>> outs(k), gus(k);
      std::vector<double> g(k, 0.0), yt(h, 0.0), gu_shared;
      for (std::int64_t j = 0; j < k; ++j) {
        if (!kept(j)) continue;  // dropped by capacity: weight 0, the expert never sees it
        g[j] = rc.routed_scaling_factor * s[chosen(j)] / D;
        outs[j] = ffn_forward(expert_prefix(chosen(j)), xt, gus[j]);
        for (std::int64_t i = 0; i < h; ++i) yt[i] += g[j] * outs[j][i];
      }
      if (c_.num_shared_experts > 0) {
        const auto ys = ffn_forward(kShared, xt, gu_shared);
        for (std::int64_t i = 0; i < h; ++i) yt[i] += ys[i];
      }
      std::copy(yt.begin(), yt.end(), out.y.begin() + t * h);
      // backward
      std::vector<double> dxt(h, 0.0), dg(k, 0.0);
      for (std::int64_t j = 0; j < k; ++j) {
        if (!kept(j)) continue;
        std::vector<double> dout(h);
        for (std::int64_t i = 0; i < h; ++i) {
          dg[j] += dyt[i] * outs[j][i];
          dout[i] = g[j] * dyt[i];
        }
        ffn_backward(expert_prefix(chosen(j)), xt, gus[j], dout, dxt);
      }
      if (c_.num_shared_experts > 0) ffn_backward(kShared, xt, gu_shared, dyt, dxt);
      // gate weights -> scores -> logits -> router weight and x
      double dg_s = 0.0;
      for (std::int64_t j = 0; j < k; ++j) dg_s += dg[j] * s[chosen(j)];
      std::vector<double> ds(E, 0.0), dz(E);
      for (std::int64_t j = 0; j < k; ++j)
        ds[chosen(j)] = rc.routed_scaling_factor * (rc.normalizes() ? dg[j] / D - dg_s / (D * D) : dg[j]);
      double ds_s = 0.0;
      for (std::int64_t e = 0; e < E; ++e) ds_s += ds[e] * s[e];
      for (std::int64_t e = 0; e < E; ++e)
        dz[e] = rc.score == ScoreFunction::Softmax ? s[e] * (ds[e] - ds_s) : ds[e] * s[e] * (1.0 - s[e]);
      auto& dwr = params_.at(kRouter).grad;
      for (std::int64_t e = 0; e < E; ++e)
        for (std::int64_t i = 0; i < h; ++i) {
          dwr[e * h + i] += dz[e] * xt[i];
          dxt[i] += double(wr[e * h + i]) * dz[e];
        }
      std::copy(dxt.begin(), dxt.end(), out.dx.begin() + t * h);
    }
    return out;
  }

 private:
  void add(const ShardedTensor& spec, float std) {
    const dsp::Parameter p(spec, {dsp::Init::Normal, std}, kSeed, 1, 0);
    params_[spec.name] = {p.value, std::vector<double>(static_cast<std::size_t>(p.value.numel()), 0.0)};
  }
  void add_ffn(const std::string& prefix, std::int64_t ffn) {
    add(ShardedTensor::gate_up(gate_up_name(prefix), kHidden, ffn,
                               {prefix + ".gate_proj.weight", prefix + ".up_proj.weight"}),
        c_.init_method_std);
    add(ShardedTensor::split(down_name(prefix), {kHidden, ffn}, 1), kDownStd);
  }

  // SwiGLU: [g; u] = W_gate_up x [2f], out = W_down (silu(g) * u) [hidden]; gu is kept for backward.
  std::vector<double> ffn_forward(const std::string& prefix, const std::vector<double>& x,
                                  std::vector<double>& gu) const {
    const Tensor& wgu = params_.at(gate_up_name(prefix)).value;
    const Tensor& wd = params_.at(down_name(prefix)).value;
    const std::int64_t h = kHidden, f = wgu.dim(0) / 2;
    gu.assign(static_cast<std::size_t>(2 * f), 0.0);
    for (std::int64_t r = 0; r < 2 * f; ++r)
      for (std::int64_t i = 0; i < h; ++i) gu[r] += double(wgu[r * h + i]) * x[i];
    std::vector<double> out(h, 0.0);
    for (std::int64_t o = 0; o < h; ++o)
      for (std::int64_t j = 0; j < f; ++j) out[o] += double(wd[o * f + j]) * gu[j] * sigmoid(gu[j]) * gu[f + j];
    return out;
  }
  // Accumulates W_gate_up and W_down gradients and dx for one token with output gradient dout.
  void ffn_backward(const std::string& prefix, const std::vector<double>& x, const std::vector<double>& gu,
                    const std::vector<double>& dout, std::vector<double>& dx) {
    Param& pgu = params_.at(gate_up_name(prefix));
    Param& pd = params_.at(down_name(prefix));
    const std::int64_t h = kHidden, f = pgu.value.dim(0) / 2;
    for (std::int64_t j = 0; j < f; ++j) {
      const double gj = gu[j], uj = gu[f + j], sg = sigmoid(gj);
      double da = 0.0;
      for (std::int64_t o = 0; o < h; ++o) {
        da += double(pd.value[o * f + j]) * dout[o];
        pd.grad[o * f + j] += dout[o] * gj * sg * uj;
      }
      const double dgate = da * uj * sg * (1.0 + gj * (1.0 - sg)), dup = da * gj * sg;
      for (std::int64_t i = 0; i < h; ++i) {
        pgu.grad[j * h + i] += dgate * x[i];
        pgu.grad[(f + j) * h + i] += dup * x[i];
        dx[i] += double(pgu.value[j * h + i]) * dgate + double(pgu.value[(f + j) * h + i]) * dup;
      }
    }
  }

  model::ModelConfig c_;
  std::vector<float> bias_;
  std::map<std::string, Param> params_;
};

Tensor to_tensor(const std::vector<double>& v, const Shape& shape) {
  Tensor t(shape);
  REQUIRE(static_cast<std::int64_t>(v.size()) == t.numel());
  std::transform(v.begin(), v.end(), t.values().begin(), [](double d) { return static_cast<float>(d); });
  return t;
}

bool all_zero(const Tensor& t) {
  return std::all_of(t.values().begin(), t.values().end(), [](float v) { return v == 0.0f; });
}

// got against the reference (norm-wise, kTol); a reference that is exactly zero must be matched exactly.
void check_close(const Tensor& got, const Tensor& want, const std::string& what) {
  CAPTURE(what);
  REQUIRE(got.shape() == want.shape());
  if (all_zero(want)) CHECK(all_zero(got));
  else CHECK(relative_error(got, want) < kTol);
}

// ---------------------------------------------------------------------------------------------
// The layer against the reference

// One rank's layer after its forward and backward, for a test case's own checks.
struct RankRun {
  DeviceMesh<comm::ThreadComm>& mesh;
  Moe& moe;
  const Moe::Saved& saved;
  const model::ForwardContext& ctx;
  const Tensor& x;
  const Reference::Output& ref;  // the reference on this rank's tokens
};

// Builds the layer at (tp, ep) (DP = EP), runs forward and backward on every rank's own batch
// and checks output, dx, routing and every parameter and gradient against the reference; then
// calls extra on every rank.
void check_layer(const std::string& label, const model::ModelConfig& c, int tp, int ep, const std::vector<float>& bias,
                 const ep::MoeOptions& opt = {}, const std::function<void(RankRun&)>& extra = {}) {
  comm::launch(tp * ep, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = tp, .expert = ep});
    CAPTURE(label);  // (captures are per thread: made here, on the rank)
    CAPTURE(tp);
    CAPTURE(ep);
    CAPTURE(mesh.dp_rank());
    Moe moe(mesh.tensor_group(), mesh.expert_group(), c, kLayer,
            model::MoeSpec::describe(c, kLayer, kDownStd, mesh.expert_group().size(), mesh.expert_group().rank()), kSeed);
    REQUIRE((moe.expert_bias() != nullptr) == !bias.empty());
    if (!bias.empty()) std::copy(bias.begin(), bias.end(), moe.expert_bias()->value.values().begin());

    const Batch b = batch_of(mesh.dp_rank());
    const std::int64_t n = b.tokens();
    auto ctx = model::ForwardContext::for_training(b.sequences, kSeq);
    ctx.moe = opt;
    const Tensor x({n, kHidden}, b.x);
    Moe::Saved saved;
    const Tensor y = moe.forward(ctx, x, &saved);
    const Tensor dx = moe.backward(ctx, Tensor({n, kHidden}, b.dy), saved);

    // own: this rank's tokens (output, dx, router and shared gradients); all: every EP rank's
    // tokens, whose sum is a routed expert's gradient (its EP rank receives them all).
    Reference own(c, bias), all(c, bias);
    const Reference::Output ref = own.run(b.x, b.dy, opt);
    for (int q = 0; q < ep; ++q) {
      const Batch bq = batch_of(q);
      all.run(bq.x, bq.dy, opt);
    }
    CHECK(saved.routing.experts == ref.experts);
    CHECK(saved.routing.kept == ref.kept);
    check_close(y, to_tensor(ref.y, y.shape()), "y");
    check_close(dx, to_tensor(ref.dx, dx.shape()), "dx");

    const std::int64_t local = c.num_experts / ep;
    std::vector<std::string> names;
    const int tp_rank = mesh.tp_rank();
    for (auto* p : moe.parameters()) {
      names.push_back(p->spec.name);
      const bool routed = p->spec.name.find(".experts.") != std::string::npos;
      CHECK(p->expert == routed);
      const Reference::Param& want = (routed ? all : own).param(p->spec.name);
      CHECK(p->value.values() == shard_of(p->spec, want.value, tp, tp_rank).values());  // the global weights
      check_close(p->grad, shard_of(p->spec, to_tensor(want.grad, want.value.shape()), tp, tp_rank),
                  p->spec.name + " grad");
    }
    CHECK(names == expected_names(c, local * mesh.ep_rank(), local));
    if (extra) {
      RankRun run{mesh, moe, saved, ctx, x, ref};
      extra(run);
    }
  });
}

const std::vector<std::pair<int, int>> kLayouts{{1, 1}, {1, 2}, {1, 4}, {2, 2}};  // (TP, EP)

}  // namespace

TEST_CASE("MoE layer output and gradients equal an fp64 reference: softmax / sigmoid, shared experts, TP x EP") {
  for (const auto& rc : routing_cases()) {
    const auto c = config_of(rc);
    for (auto [tp, ep] : kLayouts) check_layer(rc.name, c, tp, ep, bias_of(c));
  }
}

TEST_CASE("MoE layer: every token routed to EP rank 0's experts; an expert of that rank gets none") {
  // Sigmoid scores lie in (0, 1), so a correction bias of +5 on experts [0, wanted) makes every
  // token choose among them (the bias selects, it never weighs). At EP 2 rank 0 owns experts
  // 0..3 and expert 3 is left out (zero tokens on a rank that gets all of them); at EP 4 it owns 0, 1.
  const auto c = config_of({"sigmoid k2 bias, 1 shared", ScoreFunction::Sigmoid, 2, false, 1, 1, 1.0f, true, 1});
  for (auto [tp, ep] : std::vector<std::pair<int, int>>{{1, 2}, {2, 2}, {1, 4}}) {
    const std::int64_t local = c.num_experts / ep, wanted = std::max(c.moe_router_topk, local - 1);
    std::vector<float> bias(static_cast<std::size_t>(c.num_experts), 0.0f);
    std::fill_n(bias.begin(), wanted, 5.0f);
    check_layer("all tokens to EP rank 0", c, tp, ep, bias, {}, [&](RankRun& run) {
      const auto& e = run.saved.routing.experts;
      CHECK(std::all_of(e.begin(), e.end(), [&](std::int32_t v) { return v < wanted; }));
      const auto& plan = run.saved.plan;
      for (int q = 1; q < ep; ++q) CHECK(plan.send_rows[static_cast<std::size_t>(q)] == 0);
      // routed gradients of experts that saw no token: exactly zero
      auto params = run.moe.parameters();
      const std::size_t first_routed = params.size() - static_cast<std::size_t>(2 * local);
      const std::int64_t first = local * run.mesh.ep_rank();
      for (std::int64_t j = 0; j < local; ++j) {
        const bool idle = first + j >= wanted;
        CHECK((plan.rows_per_local_expert[static_cast<std::size_t>(j)] == 0) == idle);
        for (std::size_t i = 0; i < 2; ++i) {
          const Tensor& g = params[first_routed + static_cast<std::size_t>(2 * j) + i]->grad;
          CHECK(all_zero(g) == idle);
        }
      }
      if (run.mesh.ep_rank() != 0) CHECK(plan.local_rows() == 0);
    });
  }
}

TEST_CASE("MoE layer with a small capacity factor: dropped assignments contribute nothing; aux loss unchanged") {
  // capacity ceil(0.5 x tokens x k / E) = 2 or 3 per expert of a rank's 30 or 45 assignments: many drops.
  const auto c = config_of({"softmax k3 normalised, 1 shared", ScoreFunction::Softmax, 3, true, 1, 1, 1.0f, false, 1});
  for (auto policy : {ep::DropPolicy::Probability, ep::DropPolicy::Position})
    for (auto [tp, ep] : std::vector<std::pair<int, int>>{{1, 2}, {2, 2}}) {
      const ep::MoeOptions opt{.capacity_factor = 0.5f, .drop_policy = policy};
      const char* label = policy == ep::DropPolicy::Probability ? "capacity, by probability" : "capacity, by position";
      check_layer(label, c, tp, ep, {}, opt, [&](RankRun& run) {
        auto& stats = run.moe.stats();
        const auto dropped = std::count(run.ref.kept.begin(), run.ref.kept.end(), std::uint8_t{0});
        CHECK(dropped > 0);
        CHECK(stats.dropped == dropped);
        const auto& load = stats.tokens_per_expert;  // counted before dropping
        CHECK(std::accumulate(load.begin(), load.end(), std::int64_t{0}) == run.x.dim(0) * c.moe_router_topk);
        // The balance loss is computed from the choice before dropping: the same, bitwise, for
        // any capacity (dropless, the small one, one that drops nothing).
        std::vector<double> aux;
        for (float factor : {0.0f, 0.5f, 4.0f}) {
          stats.clear();
          auto ctx = run.ctx;
          ctx.moe.capacity_factor = factor;
          ctx.moe.aux_loss_coeff = 0.01f;
          Moe::Saved s;
          run.moe.forward(ctx, run.x, &s);
          aux.push_back(stats.aux_loss);
          CHECK((stats.dropped > 0) == (factor == 0.5f));
        }
        CHECK(aux[0] > 0.0);
        CHECK(aux[1] == aux[0]);
        CHECK(aux[2] == aux[0]);
      });
    }
}

// ---------------------------------------------------------------------------------------------
// ExpertDispatcher

namespace {

// Rank q's routing for the dispatcher checks: 3 + 2q tokens (rank 1 none at all: it sends
// nothing), k = 2 distinct experts per token from 0..5 (experts 6 and 7 are never chosen: at
// EP 4 rank 3 receives nothing), slot (token 1, slot 1) dropped.
ep::Routing hand_routing(int q) {
  ep::Routing r;
  r.tokens = q == 1 ? 0 : 3 + 2 * q;
  r.top_k = 2;
  r.num_experts = kExperts;
  for (std::int64_t t = 0; t < r.tokens; ++t) {
    const auto e0 = static_cast<std::int32_t>((3 * q + t * t) % 6);
    const auto e1 = static_cast<std::int32_t>((e0 + 1 + t % 3) % 6);
    r.experts.insert(r.experts.end(), {e0, e1});
    r.kept.insert(r.kept.end(), {1, std::uint8_t(t == 1 ? 0 : 1)});
  }
  r.weights = random_vector(r.experts.size(), 50 + q, 0.1f, 1.0f);
  for (std::size_t a = 0; a < r.kept.size(); ++a)
    if (!r.kept[a]) r.weights[a] = 0.0f;
  return r;
}

// Rank q's token rows, exactly representable and telling (rank, token, column) apart.
Tensor hand_rows(int q, std::int64_t tokens) {
  Tensor x({tokens, kHidden});
  for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = static_cast<float>(1000 * q + 100 * (i / kHidden) + i % kHidden);
  return x;
}

// Kept assignments of expert e, in token order.
std::vector<std::int64_t> assignments_of(const ep::Routing& r, std::int64_t e) {
  std::vector<std::int64_t> out;
  for (std::size_t a = 0; a < r.experts.size(); ++a)
    if (r.kept[a] && r.experts[a] == e) out.push_back(static_cast<std::int64_t>(a));
  return out;
}

std::vector<float> row(const Tensor& t, std::int64_t i) {
  const std::int64_t w = t.dim(1);
  return {t.values().begin() + i * w, t.values().begin() + (i + 1) * w};
}

}  // namespace

TEST_CASE("ExpertDispatcher: plan counts, dispatch / undispatch, combine_backward at EP 1, 2, 4") {
  for (int p : {1, 2, 4}) {
    comm::launch(p, [&](comm::ThreadComm& world) {
      const int me = world.rank();
      CAPTURE(p);
      CAPTURE(me);
      const std::int64_t L = kExperts / p, k = 2;
      ep::ExpertDispatcher<comm::ThreadComm> d(world, kExperts, kHidden);
      CHECK(d.num_local_experts() == L);
      CHECK(d.first_local_expert() == me * L);
      const ep::Routing r = hand_routing(me);
      const ep::DispatchPlan plan = d.plan(r);

      // counts by hand (every rank can build every rank's routing)
      std::vector<std::int64_t> order, counts(kExperts);
      for (std::int64_t e = 0; e < kExperts; ++e) {
        const auto a = assignments_of(r, e);
        order.insert(order.end(), a.begin(), a.end());
        counts[static_cast<std::size_t>(e)] = static_cast<std::int64_t>(a.size());
      }
      CHECK(plan.order == order);
      CHECK(plan.expert_counts == counts);
      CHECK(counts[kExperts - 2] + counts[kExperts - 1] == 0);
      std::vector<std::int64_t> send(p, 0), recv(p, 0), per_local(L, 0);
      for (int q = 0; q < p; ++q)
        for (std::int64_t j = 0; j < L; ++j) {
          send[q] += counts[static_cast<std::size_t>(q * L + j)];
          const auto from_q = static_cast<std::int64_t>(assignments_of(hand_routing(q), me * L + j).size());
          recv[q] += from_q;
          per_local[j] += from_q;
          CHECK(plan.recv_counts[static_cast<std::size_t>(q * L + j)] == from_q);
        }
      CHECK(plan.send_rows == send);
      CHECK(plan.recv_rows == recv);
      CHECK(plan.rows_per_local_expert == per_local);

      // dispatch: expert-major, each expert's rows from EP rank 0, 1, ... in token order
      const Tensor x = hand_rows(me, r.tokens);
      const Tensor rows = d.permute(plan, x);
      const Tensor local = d.dispatch(plan, rows);
      std::vector<float> expected;
      std::vector<std::int64_t> row_expert;  // global expert of each local row
      for (std::int64_t j = 0; j < L; ++j)
        for (int q = 0; q < p; ++q) {
          const ep::Routing rq = hand_routing(q);
          const Tensor xq = hand_rows(q, rq.tokens);
          for (auto a : assignments_of(rq, me * L + j)) {
            const auto v = row(xq, a / k);
            expected.insert(expected.end(), v.begin(), v.end());
            row_expert.push_back(me * L + j);
          }
        }
      CHECK(std::vector<float>(local.values().begin(), local.values().end()) == expected);

      // undispatch is dispatch's inverse (bitwise), also after a per-expert change of the rows
      const Tensor back = d.undispatch(plan, local);
      CHECK(back.values() == rows.values());
      Tensor scaled = local;
      for (std::int64_t i = 0; i < scaled.dim(0); ++i)
        for (std::int64_t c = 0; c < kHidden; ++c) scaled[i * kHidden + c] *= static_cast<float>(row_expert[i] + 1);
      const Tensor out = d.undispatch(plan, scaled);
      REQUIRE(out.dim(0) == plan.assignments());
      for (std::int64_t i = 0; i < out.dim(0); ++i) {
        const std::int64_t a = plan.order[i];
        for (std::int64_t c = 0; c < kHidden; ++c)
          CHECK(out[i * kHidden + c] == rows[i * kHidden + c] * static_cast<float>(r.experts[a] + 1));
      }

      // combine: y_t = sum of kept slots' weight x row (plain fp64 sum, 2 terms: < 1e-6)
      const Tensor y = d.combine(plan, r, out);
      std::vector<double> y_ref(static_cast<std::size_t>(r.tokens * kHidden), 0.0);
      for (std::int64_t i = 0; i < out.dim(0); ++i) {
        const std::int64_t a = plan.order[i];
        for (std::int64_t c = 0; c < kHidden; ++c)
          y_ref[(a / k) * kHidden + c] += double(r.weights[a]) * out[i * kHidden + c];
      }
      if (r.tokens > 0) CHECK(relative_error(y, to_tensor(y_ref, y.shape())) < kTol);

      // combine_backward: drows = weight x dy (bitwise); dweights += <dy_t, row> (fp64 dot, one
      // fp32 rounding and one fp32 add: within 2 ulps, so 1e-6 of max(1, |value|)); dropped slots untouched.
      const Tensor dy({r.tokens, kHidden}, random_vector(static_cast<std::size_t>(r.tokens * kHidden), 60 + me));
      std::vector<float> dweights(r.weights.size(), 0.5f);
      const Tensor drows = d.combine_backward(plan, r, out, dy, dweights);
      std::vector<double> dw_ref(r.weights.size(), 0.5);
      for (std::int64_t i = 0; i < out.dim(0); ++i) {
        const std::int64_t a = plan.order[i], t = a / k;
        double dot = 0.0;
        for (std::int64_t c = 0; c < kHidden; ++c) {
          dot += double(dy[t * kHidden + c]) * out[i * kHidden + c];
          CHECK(drows[i * kHidden + c] == r.weights[a] * dy[t * kHidden + c]);
        }
        dw_ref[a] += dot;
      }
      CHECK(test::max_rel_diff(dweights, dw_ref) < kTol);
      for (std::size_t a = 0; a < r.kept.size(); ++a)
        if (!r.kept[a]) CHECK(dweights[a] == 0.5f);
    });
  }
}

TEST_CASE("MoE layer: experts not divisible by the expert-parallel size throw ConfigError naming both") {
  auto c = config_of({"softmax k2", ScoreFunction::Softmax, 2, false, 1, 1, 1.0f, false, 0});
  c.num_experts = 6;
  comm::launch(4, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.expert = 4});
    const auto message = [](const std::function<void()>& fn) -> std::string {
      try {
        fn();
      } catch (const ConfigError& e) {
        return e.what();
      }
      return "no ConfigError";
    };
    const std::string layer =
        message([&] {
          Moe(mesh.tensor_group(), mesh.expert_group(), c, kLayer,
              model::MoeSpec::describe(c, kLayer, kDownStd, mesh.expert_group().size(), mesh.expert_group().rank()), kSeed);
        });
    CAPTURE(layer);
    CHECK(layer.find("number of experts (6)") != std::string::npos);
    CHECK(layer.find("expert-model-parallel-size (4)") != std::string::npos);
    const std::string dispatcher =
        message([&] { ep::ExpertDispatcher<comm::ThreadComm>(mesh.expert_group(), 6, kHidden); });
    CAPTURE(dispatcher);
    CHECK(dispatcher.find("number of experts (6) is not divisible by expert-model-parallel-size (4)") != std::string::npos);
  });
}

}  // namespace ep_moe_layer_test
