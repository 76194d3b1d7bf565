#pragma once
// ZeroOptimizer: AdamW whose state is partitioned over the data-parallel group, the Zero
// Redundancy Optimizer of Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
// Trillion Parameter Models", SC'20, section 5 (P_os, P_os+g, P_os+g+p):
//   stage 0  every rank holds whole gradients and moments (plain data parallelism: the
//            buckets all-reduce);
//   stage 1  Adam moments partitioned: the buckets reduce-scatter, each rank updates the
//            slice of every parameter it owns (dp/partition.hpp) and all-gathers the
//            parameters after the step;
//   stage 2  gradients partitioned too: a full gradient exists only from the first backward
//            that reaches its part of the model (acquire) until its bucket is packed for the
//            reduce-scatter; what stays is the owned slice;
//   stage 3  parameters partitioned too: each rank keeps its slices; a part's parameters
//            (embedding, one block, the output head; model::CausalLM::parameter_parts) are
//            all-gathered just before its forward and its backward and freed after, and the
//            part expected next is gathered in the background meanwhile (prefetch).
// Routed experts are partitioned over the expert-data-parallel group (their own buckets).
// In fp32 (T = float) the master weights are the parameters themselves (no separate copy).
//
// Mixed precision (T = bf16 or fp16: precision::Bf16Mixed / Fp16Mixed; Micikevicius et al.,
// "Mixed Precision Training", ICLR 2018, section 3.1; the ZeRO paper's 2 + 2 + 12 bytes per
// parameter): the parameters are stored in T (the whole local shard, or from stage 3 the owned
// slice), the gradients in T in the buckets (dp::GradBuckets with mixed_precision), and the
// fp32 master weights and both moments of the owned slice are the optimizer state. A
// parameter's fp32 values (Parameter::value, the 16-bit values widened) exist only while a part
// of the model that reads it is acquired, at every stage; its fp32 gradient only from the
// acquire before its first backward until its bucket is packed. The update widens the 16-bit
// gradient (times the loss-scale and clipping factors), steps the master slice and rounds it
// back into the stored parameter, which stages 1 and 2 all-gather in T. Rounding and widening
// go through Backend's convert ops (backend/host/convert.hpp, backend/cuda/convert.cuh), so
// mixed precision runs wherever the tensors live.
//
// Gradient-norm clipping (Pascanu et al. 2013) is here too, because which elements a rank
// holds depends on the stage: each global element counts once (replicated parameters on TP
// rank 0 only, K/V heads replicated over TP on the first rank holding them, a tied copy on the
// other stage not at all; a routed expert on the one rank of its expert-parallel group).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "dsp/backend/host/adamw.hpp"
#include "dsp/backend/host/elementwise.hpp"
#include "dsp/comm/communicator.hpp"
#include "dsp/comm/detail/keep_alive.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/memory_space.hpp"
#include "dsp/core/space_buffer.hpp"
#include "dsp/dp/grad_buckets.hpp"
#include "dsp/parallel/parameter.hpp"
#include "dsp/precision/loss_scaler.hpp"
#include "dsp/dp/partition.hpp"

namespace dsp::zero {

/// Hyper-parameters (Megatron names: --adam-beta1, --adam-beta2, --adam-eps, --weight-decay).
struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  ///< decoupled; not applied to 1-D parameters (norms)

  /// Throws ConfigError naming the flag and the value unless 0 <= beta1, beta2 < 1 (a beta of
  /// 1 divides by zero in the bias correction 1 - beta^t), eps > 0 and weight_decay >= 0 (NaN
  /// fails every check).
  void validate() const {
    for (auto [flag, value] : {std::pair{"--adam-beta1", beta1}, {"--adam-beta2", beta2}})
      DSP_CHECK_AS(ConfigError, value >= 0.0f && value < 1.0f, flag, " must be in [0, 1), got ", value);
    DSP_CHECK_AS(ConfigError, eps > 0.0f, "--adam-eps must be > 0, got ", eps);
    DSP_CHECK_AS(ConfigError, weight_decay >= 0.0f, "--weight-decay must be >= 0, got ", weight_decay);
  }
};

/// Throws ConfigError unless stage is 0, 1, 2 or 3 (--zero-stage).
inline void validate_zero_stage(int stage) {
  DSP_CHECK_AS(ConfigError, stage >= 0 && stage <= 3, "--zero-stage must be 0, 1, 2 or 3, got ", stage);
}

/// T: the element type parameters and gradients are stored in (float, bf16 or fp16).
template <class Backend, comm::Communicator Comm, class T = float>
class ZeroOptimizer {
 public:
  using Buckets = dp::GradBuckets<Comm, Backend>;
  /// Whether parameters and gradients are stored in 16 bits.
  static constexpr bool mixed = !std::is_same_v<T, float>;

  /// params: this rank's parameters, each in exactly one of `buckets`, which were all built for
  /// the same ZeRO stage (GradBuckets' zero_stage); buckets.front() must be over the
  /// data-parallel group (the group clipping sums partitioned squares over). tp_size, tp_rank:
  /// this rank's place in the tensor-parallel group (which elements it owns for the norm).
  /// From stage 2 releases every gradient; at stage 3 keeps only the owned slice of every
  /// parameter (counted as Parameters) and frees the rest. Moments: the owned slices
  /// (OptimizerState). Mixed precision: the buckets must keep 16-bit gradients
  /// (mixed_precision); stores each parameter in T (Parameters), its owned slice's fp32 master
  /// copy as OptimizerState, and frees the fp32 values and gradients. Throws Error for a
  /// parameter in no bucket, buckets of mixed stages, or buckets that keep the wrong precision,
  /// and when a parameter or the buckets are in another memory space than the current one.
  /// offload_ratio (ZeRO-Offload, Ren et al., USENIX ATC'21, section 4; DeepSpeed's
  /// offload_optimizer.ratio, Megatron's --optimizer-offload-fraction): the fraction of the
  /// optimizer state kept in host memory and updated by the CPU: the state of the first
  /// parameters in `params` until that fraction of their elements is reached (so at least the
  /// fraction, by at most one parameter). Throws ConfigError outside [0, 1], and for an AdamW
  /// hyper-parameter out of range (AdamWConfig::validate). Built in a memory
  /// space (a device's), the offloaded moments and, in fp32, a host copy of each offloaded
  /// slice's values (Parameters) and gradient (Gradients) are in the space's pinned host memory
  /// (MemorySpace::pinned_host(); ordinary host memory when it has none), allocated once;
  /// with mixed precision the master slice is there too, and the pinned copies are of the
  /// 16-bit gradient (Gradients) and of the rounded slice the CPU sends back (Parameters), in T.
  ZeroOptimizer(std::vector<Parameter*> params, std::vector<Buckets*> buckets, AdamWConfig config,
                int tp_size, int tp_rank, double offload_ratio = 0.0)
      : config_(config),
        stage_(buckets.at(0)->zero_stage()),
        data_(&buckets.front()->group()),
        space_(current_memory_space()) {
    config_.validate();
    DSP_CHECK_AS(ConfigError, offload_ratio >= 0.0 && offload_ratio <= 1.0,
                 "the optimizer offload ratio must be in [0, 1], got ", offload_ratio);
    std::int64_t total = 0, offloaded = 0;  // parameter elements
    for (auto* p : params) total += p->value.numel();
    const auto space_name = [](const MemorySpace* m) { return m ? m->name() : std::string_view("host"); };
    for (auto* b : buckets) {
      DSP_CHECK(b->space() == space_, "zero: gradient buckets built in ", space_name(b->space()),
                " memory for an optimizer built in ", space_name(space_), " memory");
      DSP_CHECK(b->zero_stage() == stage_, "zero: gradient buckets for stages ", stage_, " and ", b->zero_stage());
      DSP_CHECK(b->mixed_precision() == mixed, "zero: the gradient buckets ", mixed ? "do not keep" : "keep",
                " 16-bit gradients");
    }
    for (auto* p : params) {
      DSP_CHECK(p->value.space() == space_, "zero: parameter ", p->spec.name, " is in ", space_name(p->value.space()),
                " memory, the optimizer was built in ", space_name(space_), " memory");
      Slot s;
      s.p = p;
      for (auto* b : buckets)
        if (b->contains(*p)) s.buckets = b;
      DSP_CHECK(s.buckets, "zero: parameter ", p->spec.name, " is in no gradient bucket");
      s.range = s.buckets->range(*p);
      s.shape = p->value.shape();
      const Shape moment = stage_ == 0 ? s.shape : Shape{s.range.size};
      s.offloaded = static_cast<double>(offloaded) < offload_ratio * static_cast<double>(total);
      if (s.offloaded) offloaded += dsp::numel(s.shape);
      MemorySpace* state_space = s.offloaded ? host_space() : space_;
      if (s.offloaded && space_) {  // the CPU update's inputs and output, copied through pinned memory each step
        const auto n = static_cast<std::size_t>(s.range.valid());
        if constexpr (mixed) s.staged_stored = SpaceBuffer<T>(n, memory::Category::Parameters, host_space());
        else s.staged_values = SpaceBuffer<float>(n, memory::Category::Parameters, host_space());
        s.staged_gradient = SpaceBuffer<T>(n, memory::Category::Gradients, host_space());
      }
      s.exp_avg = Tensor(moment, memory::Category::OptimizerState, state_space);
      s.exp_avg_sq = Tensor(moment, memory::Category::OptimizerState, state_space);
      auto w = ownership_weights(p->spec, tp_size, tp_rank);
      if (!std::all_of(w.begin(), w.end(), [](float x) { return x == 1.0f; }))
        s.weights = SpaceArray<float>(w);
      if (stage_ >= 2 || mixed) p->grad = Tensor{};
      if constexpr (mixed) {
        s.master = Tensor({s.range.size}, memory::Category::OptimizerState, state_space);
        copy_elements(space_, s.master.data(), p->value.data() + s.range.begin,
                      static_cast<std::size_t>(s.range.valid()));
      }
      if (transient_values()) {  // what is stored: the owned slice (stage 3) or the whole shard in T
        s.stored = SpaceBuffer<T>(static_cast<std::size_t>(stage_ == 3 ? s.range.size : p->value.numel()),
                                  memory::Category::Parameters, space_);
        store(s);
        p->value = Tensor{};
      }
      index_[p] = slots_.size();
      slots_.push_back(std::move(s));
    }
  }
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;
  /// Waits for a prefetch still in flight and for the space's copies back into the parameters
  /// of offloaded slots (they read pinned buffers freed here). While an exception unwinds this
  /// rank (its peers may never join that all-gather, or the communicator aborted it while a
  /// peer still copies) it does not wait: the prefetch buffers and every slice and moment go to a process-lifetime
  /// store (comm::detail::keep_until_exit) for the communicator to finish or abort on.
  ~ZeroOptimizer() {
    if (std::uncaught_exceptions() > 0) {  // peers may still read our slices or write our buffers
      abandon(prefetch_);
      comm::detail::keep_until_exit(std::move(slots_));
      return;
    }
    for (auto& g : prefetch_) {
      if (g.work.completed()) continue;
      try {
        g.work.wait();
      } catch (...) {  // a destructor must not throw; the failure was reported where it happened
      }
    }
    // the last step's copies back may still read the offloaded slots' pinned buffers
    if (space_ && std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return !s.staged_gradient.empty(); })) {
      try {
        space_->synchronize();
      } catch (...) {
      }
    }
  }

  int stage() const { return stage_; }

  /// L2 norm of the global gradient (reduced over data parallelism: after the buckets'
  /// finish()), then, when max_norm > 0 and the norm exceeds it, every gradient this rank
  /// updates from scaled by max_norm / (norm + 1e-6). Sums of squares are fp64; at stage 0 the
  /// routed experts' part is summed over the expert-parallel group `ep` (null: EP 1), from
  /// stage 1 every part over the data-parallel group (each element has one owner there), then
  /// over the model-parallel group `mp`. Collective over those groups. Returns the norm before
  /// clipping.
  float clip_grad_norm(float max_norm, Comm& mp, Comm* ep = nullptr) {
    std::vector<double> sq{0.0, 0.0};  // (others, routed experts)
    for (auto& s : slots_) {
      if (s.p->tied_copy) continue;  // its owner on the first stage counts it
      Tensor wide;
      const std::span<const float> g = fp32_gradient(s, wide);
      sq[s.p->expert ? 1 : 0] += sum_squares(Backend{}, static_cast<std::int64_t>(g.size()), g.data(),
                                             s.weights.empty() ? nullptr : s.weights.data() + s.range.begin);
    }
    if (stage_ == 0 && ep && ep->size() > 1) ep->all_reduce(std::span(sq).subspan(1));
    sq[0] += sq[1];
    if (stage_ >= 1 && data_->size() > 1) data_->all_reduce(std::span(sq).first(1));
    mp.all_reduce(std::span(sq).first(1));
    const float norm = static_cast<float>(std::sqrt(sq[0]));
    if (max_norm > 0.0f && norm > max_norm) {
      const float f = max_norm / (norm + 1e-6f);
      if constexpr (mixed) {
        grad_factor_ *= f;
      } else {
        for (auto& s : slots_) {
          const std::span<float> g = grad(s);
          scale(Backend{}, static_cast<std::int64_t>(g.size()), f, g.data());
        }
      }
    }
    return norm;
  }

  /// Loss scaling: multiplies every gradient this rank updates from by `factor` (1 / scale)
  /// and returns whether any of them held an infinity or NaN (this rank only). After the
  /// buckets' finish(), before clip_grad_norm. Mixed precision: the 16-bit gradients are not
  /// rewritten (they would underflow); `factor` becomes the multiplier the update and the norm
  /// apply as they widen them, until step().
  bool unscale_gradients(float factor) {
    bool found = false;
    if constexpr (mixed) grad_factor_ = factor;
    for (auto& s : slots_) {
      const std::span<T> g = grad(s);
      SpaceBuffer<T> copy;
      const std::span<const T> h = host_gradient(g, copy);
      found = found || !std::all_of(h.begin(), h.end(), [](T x) { return std::isfinite(static_cast<float>(x)); });
      if constexpr (!mixed) scale(Backend{}, static_cast<std::int64_t>(g.size()), factor, g.data());
    }
    return found;
  }

  /// The reduced gradient this rank updates parameter i from, in T: the owned slice's valid
  /// elements (the whole gradient at stage 0), in the optimizer's memory space (device memory
  /// when built in one: pass to ops or copy out). Valid between the buckets' finish() and
  /// step(). Mixed precision: before the unscale and clipping factors.
  std::span<T> gradient(std::size_t i) { return grad(slots_.at(i)); }

  /// One AdamW update (backend::adamw_update) of the slice of every parameter this rank owns,
  /// from its reduced (and clipped) gradient; at stages 1 and 2 then all-gathers the
  /// parameters over their groups. Collective over the buckets' groups from stage 1.
  /// Mixed precision: steps the fp32 master slice from the widened gradient and rounds it into
  /// the stored 16-bit parameter. Offloaded state (offload_ratio), as ZeRO-Offload (section
  /// 4.2) schedules it: in a memory space, the offloaded slices' gradients (and in fp32 their
  /// values) are copied into their pinned host copies (enqueued, then waited for once); the
  /// backend's updates of the rest are enqueued (on a device they run while the CPU works); the
  /// CPU updates the offloaded ones (the Host op, the same formula; mixed precision widens the
  /// 16-bit gradient first, as the backend would); their values (mixed precision: the rounded
  /// 16-bit slice) are copied back (enqueued: the space's later work waits for them, the host
  /// does not).
  void step(float lr) {
    drop_prefetch();
    ++step_;
    std::vector<HostStep> on_host;
    for (auto& s : slots_)
      if (s.offloaded) on_host.push_back(stage_to_host(s));
    if (space_ && !on_host.empty()) space_->synchronize();  // the copies out (and the backward before them)
    for (auto& s : slots_) {
      if (s.offloaded) continue;
      Tensor wide;
      const std::span<const float> g = fp32_gradient(s, wide);
      update(Backend{}, s, owned_values(s), g.data(), static_cast<std::int64_t>(g.size()), lr, stored_slice(s));
    }
    for (auto& h : on_host) {
      if constexpr (mixed)
        if (h.staged) {  // the 16-bit gradient has landed in pinned memory: widen it here
          h.wide = Tensor({h.n}, memory::Category::Workspace, nullptr);
          widen(backend::Host{}, h.n, h.slot->staged_gradient.data(), h.wide.data());
          h.gradient = h.wide.data();
        }
      update(backend::Host{}, *h.slot, h.values, h.gradient, h.n, lr, h.stored);
      if (!h.staged) continue;
      const auto n = static_cast<std::size_t>(h.n);
      if constexpr (mixed) space_->copy_async(stored_slice(*h.slot), h.stored, n * sizeof(T));
      else space_->copy_async(owned_values(*h.slot), h.values, n * sizeof(float));
    }
    grad_factor_ = 1.0f;
    if (stage_ == 1 || stage_ == 2) gather_parameters();
  }

  /// model::CausalLM::ParameterHooks::acquire. From stage 2 and with mixed precision, before
  /// a backward: allocates the zero fp32 gradient of each parameter of `part` that has none.
  /// Mixed precision below stage 3: widens each parameter of `part` into its fp32 values. At
  /// stage 3: makes each parameter of `part` whole (the all-gather started for it as the last
  /// `next`, or one now) and starts gathering `next` in the background. Collective over the
  /// parameters' groups: every data-parallel rank makes the same calls (same schedule), so the
  /// gathers match.
  void acquire(const std::vector<Parameter*>& part, const std::vector<Parameter*>* next, bool backward) {
    if ((stage_ >= 2 || mixed) && backward)
      for (auto* p : part)
        if (p->grad.empty()) p->grad = Tensor(slot(*p).shape, memory::Category::Gradients);
    if (!transient_values()) return;
    if (stage_ < 3) {
      for (auto* p : part) {
        Slot& s = slot(*p);
        if (p->value.empty()) {
          p->value = Tensor(s.shape, memory::Category::Parameters);
          load(s.stored.data(), p->value);
        }
        ++s.refs;
      }
      return;
    }
    std::vector<Gather> now;
    if (prefetched_ == &part) {
      now = std::move(prefetch_);
      prefetched_ = nullptr;
    } else {
      drop_prefetch();
      now = start_gather(part);
    }
    finish_gather(now);
    for (auto* p : part) ++slot(*p).refs;
    if (next) {
      prefetch_ = start_gather(*next);
      prefetched_ = next;
    }
  }
  /// model::CausalLM::ParameterHooks::release: at stage 3 and with mixed precision frees the
  /// fp32 values of each parameter of `part` no other acquired part still reads.
  void release(const std::vector<Parameter*>& part) {
    if (!transient_values()) return;
    for (auto* p : part) {
      Slot& s = slot(*p);
      DSP_CHECK(s.refs > 0, "zero: parameter ", p->spec.name, " released more often than acquired");
      if (--s.refs == 0) p->value = Tensor{};
    }
  }

  /// For a checkpoint: makes every parameter's fp32 values whole (stage 3: all-gathered; with
  /// mixed precision they are the master weights, gathered from stage 1). The moments stay
  /// partitioned (exp_avg). Collective over the groups. Undo with partition_after_checkpoint.
  void gather_for_checkpoint() {
    drop_prefetch();
    if constexpr (mixed)
      for (auto& s : slots_) {
        SpaceBuffer<float> gathered;
        if (stage_ > 0) gathered = whole(s, s.master);
        s.p->value = Tensor(s.shape, memory::Category::Parameters);
        copy_elements(space_, s.p->value.data(), stage_ > 0 ? gathered.data() : s.master.data(),
                      static_cast<std::size_t>(s.p->value.numel()));
      }
    else if (stage_ == 3)
      acquire(parameters(), nullptr, false);
  }
  /// After gather_for_checkpoint: when `loaded`, takes this rank's slices (or its stored copy)
  /// of the (now loaded) whole parameters; then frees what gather_for_checkpoint made whole.
  void partition_after_checkpoint(bool loaded) {
    for (auto& s : slots_) {
      if (loaded && mixed)
        copy_elements(space_, s.master.data(), s.p->value.data() + s.range.begin,
                      static_cast<std::size_t>(s.range.valid()));
      if (loaded && transient_values()) store(s);
      if (mixed) s.p->value = Tensor{};
    }
    if (stage_ == 3 && !mixed) release(parameters());
  }

  /// Optimizer steps taken so far.
  std::int64_t steps() const { return step_; }
  void set_steps(std::int64_t s) { step_ = s; }
  /// The parameters, in the order given.
  std::vector<Parameter*> parameters() const {
    std::vector<Parameter*> out;
    for (const auto& s : slots_) out.push_back(s.p);
    return out;
  }
  /// First and second moments of the part of parameter i this rank owns: of its whole local
  /// shape at stage 0; from stage 1 [range(i).size], the slice's range(i).valid() elements
  /// first, then zero padding. In the current space, or for offloaded state in its pinned
  /// host memory (which Tensor's host accessors refuse too: copy with the space).
  Tensor& exp_avg(std::size_t i) { return slots_.at(i).exp_avg; }
  Tensor& exp_avg_sq(std::size_t i) { return slots_.at(i).exp_avg_sq; }
  /// The slice of parameter i this rank owns (the whole parameter at stage 0).
  dp::ShardRange range(std::size_t i) const { return slots_.at(i).range; }
  /// The group parameter i's state is partitioned over (from stage 1) and its gradient reduced
  /// over: the data-parallel group, the expert-data-parallel group for a routed expert.
  Comm& group(std::size_t i) { return slots_.at(i).buckets->group(); }

 private:
  struct Slot {
    Parameter* p = nullptr;
    bool offloaded = false;          // moments (and master) in host memory, updated by the CPU
    Buckets* buckets = nullptr;
    dp::ShardRange range;
    Shape shape;                     // the whole local shape
    Tensor exp_avg, exp_avg_sq;      // the owned slice (whole at stage 0)
    Tensor master;                   // mixed precision: fp32 master weights of the owned slice
    SpaceBuffer<T> stored;           // stage 3: the owned slice; mixed precision: the whole shard below stage 3
    SpaceBuffer<float> staged_values;  // offloaded fp32 in a space: the CPU's copy of the owned values (pinned)
    SpaceBuffer<T> staged_gradient;    // offloaded in a space: the CPU's copy of the reduced gradient (pinned)
    SpaceBuffer<T> staged_stored;      // offloaded mixed precision in a space: the rounded slice sent back
    SpaceArray<float> weights;       // ownership weights of the whole local shard (empty: all owned), where the gradients are
    int refs = 0;                    // stage 3: acquired parts reading the parameter
  };

  // One AdamW update on backend B of the n owned values from gradient g (pointers B reads);
  // mixed precision: then the values (the master slice) rounded into `stored` (B writes it).
  template <class B>
  void update(B b, Slot& s, float* values, const float* g, std::int64_t n, float lr, T* stored) {
    adamw_update(b, n, values, g, s.exp_avg.data(), s.exp_avg_sq.data(), lr, config_.beta1, config_.beta2,
                 config_.eps, s.p->weight_decay ? config_.weight_decay : 0.0f, step_);
    if constexpr (mixed) convert(b, n, values, stored);
  }

  // An offloaded slot's update inputs in host memory: the owned values and the fp32 gradient.
  struct HostStep {
    Slot* slot = nullptr;
    std::int64_t n = 0;
    float* values = nullptr;
    const float* gradient = nullptr;
    T* stored = nullptr;  // mixed precision: where the update rounds the master slice to
    bool staged = false;  // in a space: the slot's pinned copies hold the inputs (and take the output)
    Tensor wide;          // mixed precision: the widened gradient (host memory)
  };
  // In host memory: the values and the (widened) gradient as they are, the stored slice. In a
  // space: the reduced gradient copied into the slot's pinned buffer, and in fp32 the values too
  // (enqueued: read them after space_->synchronize(); mixed precision widens the gradient
  // then, step()); mixed precision's master slice is in pinned memory already, and the update
  // rounds it into a pinned buffer, copied back after.
  HostStep stage_to_host(Slot& s) {
    HostStep h;
    h.slot = &s;
    h.values = owned_values(s);
    h.stored = stored_slice(s);
    if (!space_) {
      const std::span<const float> g = fp32_gradient(s, h.wide);
      h.n = static_cast<std::int64_t>(g.size());
      h.gradient = g.data();
      return h;
    }
    const std::span<T> g = grad(s);
    h.n = static_cast<std::int64_t>(g.size());
    space_->copy_async(s.staged_gradient.data(), g.data(), g.size_bytes());
    if constexpr (mixed) {
      h.stored = s.staged_stored.data();
    } else {
      h.gradient = s.staged_gradient.data();
      space_->copy_async(s.staged_values.data(), h.values, g.size_bytes());
      h.values = s.staged_values.data();
    }
    h.staged = true;
    return h;
  }
  // A gradient g in host memory: g itself, or (in a memory space: the parameter's gradient at
  // stage 0, the buckets' reduced slice from stage 1) a copy in `copy` (Workspace).
  std::span<const T> host_gradient(std::span<const T> g, SpaceBuffer<T>& copy) {
    if (!space_) return g;
    copy = SpaceBuffer<T>(g.size(), memory::Category::Workspace, nullptr);
    copy_elements(space_, copy.data(), g.data(), g.size());
    return copy.raw_span();
  }

  // A background all-gather of one parameter's slices (stage 3).
  struct Gather {
    Slot* slot = nullptr;
    SpaceBuffer<T> all;  // N x slice, rank-major
    comm::Work work;
  };

  Slot& slot(const Parameter& p) {
    const auto it = index_.find(&p);
    DSP_CHECK(it != index_.end(), "zero: parameter ", p.spec.name, " is not this optimizer's");
    return slots_[it->second];
  }

  std::span<T> grad(Slot& s) { return s.buckets->template reduced<T>(*s.p); }
  // The fp32 gradient the update reads: fp32, the reduced one in place; mixed precision, the
  // 16-bit one widened into `wide` (Workspace, in space_) times the unscale and clipping factors.
  std::span<const float> fp32_gradient(Slot& s, Tensor& wide) {
    const std::span<T> g = grad(s);
    if constexpr (!mixed) {
      return g;
    } else {
      const auto n = static_cast<std::int64_t>(g.size());
      wide = Tensor({n}, memory::Category::Workspace);
      widen(Backend{}, n, g.data(), wide.data());
      return wide.raw_span();
    }
  }
  // Mixed precision: out [n] = the 16-bit gradient g [n] widened times the unscale and clipping
  // factors, on backend B (multiplying by 1 is skipped: it changes no value).
  template <class B>
  void widen(B b, std::int64_t n, const T* g, float* out) const {
    convert(b, n, g, out);
    if (grad_factor_ != 1.0f) scale(b, n, grad_factor_, out);
  }

  // Whether Parameter::value exists only while acquired (stage 3, mixed precision).
  bool transient_values() const { return stage_ == 3 || mixed; }
  // Where offloaded state lives: the space's pinned host memory, or ordinary host memory.
  MemorySpace* host_space() const { return space_ ? space_->pinned_host() : nullptr; }

  // The elements the update writes: the master slice (mixed), the stored slice (stage 3) or the
  // parameter's owned elements.
  float* owned_values(Slot& s) {
    if constexpr (mixed) return s.master.data();
    else return stage_ == 3 ? s.stored.data() : s.p->value.data() + s.range.begin;
  }
  // The whole local shard that stages 1 and 2 all-gather into, in space_.
  T* whole_values(Slot& s) {
    if constexpr (mixed) return s.stored.data();
    else return s.p->value.data();
  }
  // Mixed precision: where s's owned slice is stored in T, in space_ (the update rounds into it).
  T* stored_slice(Slot& s) {
    if constexpr (mixed) return s.stored.data() + (stage_ == 3 ? 0 : s.range.begin);
    else return nullptr;
  }
  // Stores the part of s's fp32 values kept between uses (the owned slice at stage 3, else the
  // whole shard) in s.stored: copied (fp32) or rounded by Backend's convert (mixed precision).
  void store(Slot& s) {
    const bool slice = stage_ == 3;
    const std::int64_t begin = slice ? s.range.begin : 0, n = slice ? s.range.valid() : s.p->value.numel();
    if constexpr (mixed) convert(Backend{}, n, s.p->value.data() + begin, s.stored.data());
    else copy_elements(space_, s.stored.data(), s.p->value.data() + begin, static_cast<std::size_t>(n));
  }
  // Fills `out` (fp32, in space_) from `in` (its elements in T, in space_): copied, or widened by
  // Backend's convert (mixed precision).
  void load(const T* in, Tensor& out) {
    if constexpr (mixed) convert(Backend{}, out.numel(), in, out.data());
    else copy_elements(space_, out.data(), in, static_cast<std::size_t>(out.numel()));
  }

  // Starts all-gathering every parameter of `part` that is not whole yet (every buffer
  // allocated first: an allocation that fails leaves no gather in flight; a start that fails
  // leaves the buffers of those started to comm::detail::keep_until_exit).
  std::vector<Gather> start_gather(const std::vector<Parameter*>& part) {
    std::vector<Gather> out;
    for (auto* p : part) {
      Slot& s = slot(*p);
      if (!p->value.empty() || std::any_of(out.begin(), out.end(), [&](const Gather& g) { return g.slot == &s; }))
        continue;
      const auto n = static_cast<std::size_t>(s.range.size * s.buckets->group().size());
      out.push_back(Gather{&s, SpaceBuffer<T>(n, memory::Category::Communication, space_), {}});
    }
    try {
      for (auto& g : out)
        g.work =
            g.slot->buckets->group().all_gather_async(std::span<const T>(g.slot->stored.raw_span()), g.all.raw_span());
    } catch (...) {  // the gathers started before the failing one may still be in flight
      abandon(out);
      throw;
    }
    return out;
  }
  // Waits for the gathers and makes their parameters whole (unless something else did). When
  // that throws (a failed peer, an allocation), the buffers of gathers perhaps still in flight
  // go to comm::detail::keep_until_exit.
  void finish_gather(std::vector<Gather>& gathers) {
    try {
      for (auto& g : gathers) {
        g.work.wait();
        Parameter& p = *g.slot->p;
        if (!p.value.empty()) continue;
        p.value = Tensor(g.slot->shape, memory::Category::Parameters);
        load(g.all.data(), p.value);
      }
    } catch (...) {
      abandon(gathers);
      throw;
    }
    gathers.clear();
  }
  // Forgets gathers perhaps still in flight, their buffers kept until process exit.
  static void abandon(std::vector<Gather>& gathers) {
    for (auto& g : gathers) comm::detail::keep_until_exit(std::move(g.all));
    gathers.clear();
  }
  // Waits for a prefetch nobody asked for and forgets it.
  void drop_prefetch() {
    for (auto& g : prefetch_) g.work.wait();
    prefetch_.clear();
    prefetched_ = nullptr;
  }

  // Stages 1 and 2, after the update: every rank's slices of every parameter (in T) to every
  // rank of its group, all gathers in flight at once, then unpacked.
  void gather_parameters() {
    struct Out {
      Slot* slot;
      SpaceBuffer<T> mine, all;
      comm::Work work;
    };
    std::vector<Out> outs;
    outs.reserve(slots_.size());
    for (auto& s : slots_) {
      const auto n = static_cast<std::size_t>(s.buckets->group().size()), slice = static_cast<std::size_t>(s.range.size);
      outs.push_back(Out{&s, SpaceBuffer<T>(slice, memory::Category::Communication, space_),
                         SpaceBuffer<T>(slice * n, memory::Category::Communication, space_), {}});
    }
    try {  // every buffer allocated first: an allocation that fails leaves no gather in flight
      for (auto& o : outs) {
        Slot& s = *o.slot;
        copy_elements(space_, o.mine.data(), whole_values(s) + s.range.begin, static_cast<std::size_t>(s.range.valid()));
        o.work = s.buckets->group().all_gather_async(std::span<const T>(o.mine.raw_span()), o.all.raw_span());
      }
      for (auto& o : outs) {
        o.work.wait();
        copy_elements(space_, whole_values(*o.slot), o.all.data(), static_cast<std::size_t>(numel(o.slot->shape)));
      }
    } catch (...) {  // a peer or a copy failed: others may still read `mine` or write `all`
      for (auto& o : outs) {
        comm::detail::keep_until_exit(std::move(o.mine));
        comm::detail::keep_until_exit(std::move(o.all));
      }
      throw;
    }
  }

  // The whole local shard of a partitioned fp32 buffer (its slices all-gathered over the group:
  // the first numel(s.shape) elements), in space_ (Communication). A slice in the space's
  // pinned host memory (offloaded) travels from a copy in space_.
  SpaceBuffer<float> whole(Slot& s, const Tensor& slice) {
    Comm& group = s.buckets->group();
    const auto n = static_cast<std::size_t>(s.range.size);
    SpaceBuffer<float> all(n * static_cast<std::size_t>(group.size()), memory::Category::Communication, space_);
    SpaceBuffer<float> mine;
    if (slice.space() != space_) {
      mine = SpaceBuffer<float>(n, memory::Category::Communication, space_);
      copy_elements(space_, mine.data(), slice.data(), n);
    }
    group.all_gather(mine.empty() ? slice.raw_span() : std::span<const float>(mine.raw_span()), all.raw_span());
    return all;
  }

  AdamWConfig config_;
  int stage_;
  Comm* data_;
  MemorySpace* space_;  // the current memory space at construction: where fp32 values, gradients and buffers live
  std::vector<Slot> slots_;
  std::unordered_map<const Parameter*, std::size_t> index_;
  std::vector<Gather> prefetch_;
  const std::vector<Parameter*>* prefetched_ = nullptr;
  std::int64_t step_ = 0;
  float grad_factor_ = 1.0f;  // mixed precision: 1 / loss scale x clipping factor, until step()
};

}  // namespace dsp::zero
