#pragma once
// Data-parallel gradient reduction in buckets, overlapped with backward (the scheme of
// PyTorch DDP, Li et al., VLDB 2020, section 3.2.3, and Megatron-LM's distributed optimizer
// grad buffer): parameters are grouped, in the order backward finishes their gradients,
// into buckets of at most `bucket_size_bytes` of communication payload; on the last
// micro-batch of a step, a bucket's all-reduce (sum over the data-parallel group) starts as
// soon as the last of its gradients is final and runs on the communicator's asynchronous
// path while backward continues; finish() waits for all of them just before the optimizer.
// Earlier micro-batches of a step (gradient accumulation) only accumulate: nothing is
// reduced until the last one (Megatron's no_sync).
//
// Overlap on or off runs the same buckets in the same order through the same collective, so
// the reduced gradients are bitwise identical; only when each all-reduce starts differs.
// With a 16-bit communication dtype (bf16 or fp16) every bucket is rounded to it once,
// all-reduced in it (ThreadComm and MpiComm accumulate in fp32 and round the sum once; NcclComm
// sums as NCCL does, in the 16-bit type), and widened back to fp32.
//
// ZeRO (zero::ZeroOptimizer, stages 1-3) reduce-scatters instead: each parameter is split over
// the group as dp/partition.hpp says, a bucket's payload holds rank 0's slices of its
// parameters, then rank 1's, ..., and each rank receives the summed slices it owns (reduced()).
// From stage 2 the full gradients are released as soon as they are packed, and the payload
// lives only from the bucket's launch to finish(): what stays between steps is the owned
// slice of each gradient.
//
// Mixed precision (precision::Bf16Mixed / Fp16Mixed; `mixed_precision`): the payload, in the
// 16-bit communication dtype, is where the gradients are kept (the fp16 gradients of the ZeRO
// paper, section 3.1): every full fp32 gradient is released once packed, at every stage; the
// sums stay in the payload (stages 0 and 1, counted as Gradients, allocated even with one DP
// rank) or in a 16-bit copy of the owned slices (from stage 2); reduced<T>() reads them.
//
// Gradients in a memory space (device memory, core/memory_space.hpp): payloads and reduced
// slices live in the space current at construction (core/space_buffer.hpp), gradients are packed
// into them and unpacked by the space's copies (fp32) or the Backend's convert ops (16 bits,
// backend/host/convert.hpp, backend/cuda/convert.cuh), and the communicator reduces them where
// they are (a communicator that reads device memory: StagingComm over ThreadComm for ranks
// sharing a device, NcclComm for device buffers).
#include <cstdint>
#include <algorithm>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <variant>
#include <vector>

#include "dsp/backend/host/convert.hpp"
#include "dsp/comm/communicator.hpp"
#include "dsp/comm/detail/keep_alive.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/core/memory_space.hpp"
#include "dsp/core/space_buffer.hpp"
#include "dsp/parallel/parameter.hpp"
#include "dsp/dp/partition.hpp"

namespace dsp::dp {

/// Element type of the data-parallel gradient all-reduce (`--grad-reduce-dtype`). fp16 has
/// fp32's precision to 2^-11 but a range of only 6e-8 .. 65504: use it with loss scaling
/// (train::TrainConfig::loss_scaler), whose overflow check then sees the transport's infinities.
enum class GradReduceDType { Fp32, Bf16, Fp16 };

/// Parses "fp32" / "bf16" / "fp16"; throws ConfigError naming the value otherwise.
inline GradReduceDType grad_reduce_dtype_from_name(const std::string& name) {
  if (name == "fp32") return GradReduceDType::Fp32;
  if (name == "bf16") return GradReduceDType::Bf16;
  if (name == "fp16") return GradReduceDType::Fp16;
  throw ConfigError("--grad-reduce-dtype must be fp32, bf16 or fp16, got '" + name + "'");
}

/// Settings of the bucketed data-parallel reduction (Megatron flag names).
struct DdpConfig {
  /// --ddp-bucket-size: largest communication payload of one bucket, bytes (a parameter
  /// larger than this gets a bucket of its own; parameters are never split). Megatron's flag
  /// of the same name counts elements. Default 4 MiB: bench_overlap (benchmarks/RESULTS.md)
  /// measured 13 buckets of the demo model's 3.3 MB of gradients in 0.23 ms against 0.21 ms
  /// for one all-reduce (~2 us per bucket), so the size only decides how early the first
  /// all-reduce can start; at the default the small sample models fit one bucket, so pass a
  /// smaller size to overlap them.
  std::int64_t bucket_size_bytes = 4 << 20;
  /// --overlap-grad-reduce: start each bucket's all-reduce during backward (true) or all of
  /// them after backward (false). The results are bitwise the same.
  bool overlap_grad_reduce = false;
  /// --grad-reduce-dtype: dtype the gradients travel in.
  GradReduceDType grad_reduce_dtype = GradReduceDType::Fp32;
};

/// Buckets of gradients over one data-parallel group. Not copyable (holds pointers into the
/// parameters); one per model replica rank. Backend: whose convert ops round gradients to 16
/// bits and widen them back (it must read the memory the gradients and payloads live in).
template <comm::Communicator Comm, class Backend>
class GradBuckets {
 public:
  /// params: this rank's parameters in the order backward finishes their gradients (e.g.
  /// CausalLM::grad_ready_order()). own_bucket: a parameter that gets a bucket to itself (the
  /// tied embedding of a model split over stages: the first and last stage then all-reduce
  /// identical buffers, so both copies get bitwise the same sum whatever algorithm the
  /// communicator picks for a message size). Collective over `dp`: checks that every DP rank
  /// made the same buckets (count, elements, dtype). Throws ConfigError when
  /// bucket_size_bytes < 1 or the ranks' buckets differ (e.g. different --ddp-bucket-size or
  /// --grad-reduce-dtype). With more than one DP rank it allocates every bucket's payload
  /// (its gradients' elements x 4 bytes, or 2 in bf16 / fp16), counted as memory::Category::Communication.
  /// zero_stage >= 1: reduce-scatter into owned slices (reduced()); the payload then has the
  /// padded size (N x the slices) and is allocated even with one rank; the reduced slices are
  /// Communication at stage 1 (the full gradients stay) and Gradients from stage 2, where the
  /// payload exists only while a reduction is in flight and every full gradient is released
  /// (Tensor{}) once packed: whoever accumulates into it next must allocate it again.
  /// mixed_precision: the gradients are kept in the 16-bit grad_reduce_dtype (see the top of the
  /// file); every full gradient is released once packed. Throws ConfigError when it is fp32.
  /// Payloads and reduced slices are allocated in the current memory space; launching a bucket
  /// throws Error when a gradient is in other memory than the buckets and the payload is 16-bit.
  GradBuckets(Comm& dp, const std::vector<Parameter*>& params, DdpConfig config,
              const Parameter* own_bucket = nullptr, int zero_stage = 0, bool mixed_precision = false)
      : dp_(&dp), config_(config), zero_stage_(zero_stage), mixed_(mixed_precision) {
    DSP_CHECK_AS(ConfigError, config.bucket_size_bytes >= 1, "--ddp-bucket-size must be >= 1 byte, got ",
                 config.bucket_size_bytes);
    DSP_CHECK_AS(ConfigError, !mixed_ || config.grad_reduce_dtype != GradReduceDType::Fp32,
                 "mixed precision keeps the gradients in 16 bits: --grad-reduce-dtype must be bf16 or fp16");
    const std::int64_t elem = config.grad_reduce_dtype == GradReduceDType::Fp32 ? 4 : 2;
    for (auto* p : params) {
      const std::int64_t bytes = p->grad.numel() * elem;
      const bool alone = p == own_bucket || (!buckets_.empty() && buckets_.back().params.back() == own_bucket);
      if (buckets_.empty() || alone ||
          (buckets_.back().elements > 0 && (buckets_.back().elements * elem + bytes > config.bucket_size_bytes)))
        buckets_.emplace_back();
      Bucket& b = buckets_.back();
      const ShardRange range = shard_range(p->grad.numel(), dp.size(), dp.rank());
      where_[p] = {static_cast<int>(buckets_.size() - 1), b.slice_elements, b.elements, range};
      b.params.push_back(p);
      b.elements += p->grad.numel();
      b.slice_elements += range.size;
    }
    std::int64_t elements = 0;
    for (auto& b : buckets_) {
      elements += b.elements;
      if (mixed_) {  // the payload holds the gradients; from stage 2 only while in flight
        if (zero_stage >= 2) b.reduced = make_payload(config.grad_reduce_dtype, b.slice_elements, memory::Category::Gradients);
        else allocate_payload(b);
      } else if (sharded()) {
        b.reduced = Payload<float>(static_cast<std::size_t>(b.slice_elements),
                                   zero_stage >= 2 ? memory::Category::Gradients : memory::Category::Communication,
                                   space_);
        if (zero_stage == 1) allocate_payload(b);
      } else if (dp.size() > 1) {  // with one rank nothing is communicated: no payload
        allocate_payload(b);
      }
    }
    if (dp.size() > 1) {  // all ranks must issue the same all-reduces: compare max and min
      const std::int64_t mine[3] = {static_cast<std::int64_t>(buckets_.size()), elements, elem};
      std::vector<std::int64_t> hi(mine, mine + 3), lo(mine, mine + 3);
      dp.all_reduce(std::span(hi), comm::ReduceOp::Max);
      dp.all_reduce(std::span(lo), comm::ReduceOp::Min);
      DSP_CHECK_AS(ConfigError, hi == lo, "data-parallel ranks made different gradient buckets (buckets ", lo[0], "-",
                   hi[0], ", elements ", lo[1], "-", hi[1], ", bytes per element ", lo[2], "-", hi[2],
                   "): every rank needs the same --ddp-bucket-size and --grad-reduce-dtype");
    }
  }
  GradBuckets(const GradBuckets&) = delete;
  GradBuckets& operator=(const GradBuckets&) = delete;
  /// Waits for all-reduces still in flight, so their payloads outlive them. While an exception
  /// unwinds this rank (its peers may never join those all-reduces) it does not wait: it hands
  /// the payloads to a process-lifetime store (freed at exit) for the communicator to finish or
  /// abort the operations on.
  ~GradBuckets() {
    for (auto& b : buckets_) {
      if (b.work.completed()) continue;
      if (std::uncaught_exceptions() > 0) {
        comm::detail::keep_until_exit(std::move(b.payload));  // moved, not copied: the buffers stay where they are
        comm::detail::keep_until_exit(std::move(b.reduced));
        continue;
      }
      try {
        b.work.wait();
      } catch (...) {  // a destructor must not throw; the failure was reported where it happened
      }
    }
  }

  /// Starts a step's last micro-batch: from now on mark_ready() counts gradients as final.
  void begin_last_micro_batch() {
    for (auto& b : buckets_) b.ready = 0;
    next_launch_ = 0;
  }

  /// Reports that p's gradient is final for this step (call once per parameter during the
  /// last micro-batch's backward). With overlap on, every bucket whose gradients are all
  /// final starts its all-reduce, in bucket order. Throws Error for an unknown parameter or
  /// one reported twice.
  void mark_ready(Parameter& p) {
    const auto it = where_.find(&p);
    DSP_CHECK(it != where_.end(), "grad buckets: parameter ", p.spec.name, " is not in any bucket");
    Bucket& b = buckets_[static_cast<std::size_t>(it->second.bucket)];
    DSP_CHECK(b.ready < static_cast<int>(b.params.size()), "grad buckets: ", p.spec.name, " reported twice");
    ++b.ready;
    if (config_.overlap_grad_reduce) launch_ready();
  }

  /// Starts every bucket not started yet (all of them when overlap is off), waits for all,
  /// and writes the sums back into the gradients (ZeRO: into the owned slices, reduced()).
  /// Call once per step before clipping and the optimizer; it also resets the buckets for the
  /// next step. Collective over the data-parallel group.
  void finish() {
    while (next_launch_ < buckets_.size()) launch(buckets_[next_launch_++]);
    for (auto& b : buckets_) {
      if (!sharded() && dp_->size() == 1) continue;
      b.work.wait();
      b.work = comm::Work{};
      std::visit(
          [&]<class T>(Payload<T>& payload) {
            if (mixed_) {  // the sums stay in the payload; from stage 2 the owned block is kept
              if (zero_stage_ < 2) return;
              copy_elements(space_, std::get<Payload<T>>(b.reduced).data(),
                            payload.data() + b.slice_elements * dp_->rank(), static_cast<std::size_t>(b.slice_elements));
              payload = Payload<T>{};
              return;
            }
            if (!sharded()) {
              for_each_slice(b, payload, [&](Parameter& p, std::span<T> slice) {
                unpack(p, slice.data(), p.grad.data(), slice.size());
              });
              return;
            }
            if constexpr (!std::is_same_v<T, float>)  // a 16-bit payload was reduced in place: widen this rank's block
              convert(Backend{}, b.slice_elements, payload.data() + b.slice_elements * dp_->rank(),
                      std::get<Payload<float>>(b.reduced).data());
            if (zero_stage_ >= 2) payload = Payload<T>{};  // lives only while in flight
          },
          b.payload);
    }
    begin_last_micro_batch();  // the next step starts from no bucket launched
  }

  /// ZeRO stage >= 1: the summed gradient of the slice of p this rank owns, its
  /// ShardRange::valid() elements (valid after finish(), until the next step's reduction of
  /// p's bucket). Stage 0: p's whole gradient. T: float, or with mixed precision the 16-bit
  /// grad_reduce_dtype (bf16 / fp16). Throws Error for a parameter in no bucket or another T.
  template <class T = float>
  std::span<T> reduced(Parameter& p) {
    const auto it = where_.find(&p);
    DSP_CHECK(it != where_.end(), "grad buckets: parameter ", p.spec.name, " is not in any bucket");
    const Slot& slot = it->second;
    Bucket& b = buckets_[static_cast<std::size_t>(slot.bucket)];
    if (!mixed_) {
      DSP_CHECK((std::is_same_v<T, float>), "grad buckets: fp32 gradients read as 16-bit");
      if constexpr (std::is_same_v<T, float>) {
        if (!sharded()) return p.grad.raw_span();  // where the gradient lives
        return std::get<Payload<float>>(b.reduced).raw_span().subspan(static_cast<std::size_t>(slot.offset),
                                                                      static_cast<std::size_t>(slot.range.valid()));
      }
    }
    AnyPayload& where = zero_stage_ >= 2 ? b.reduced : b.payload;
    DSP_CHECK(std::holds_alternative<Payload<T>>(where), "grad buckets: ", p.spec.name,
              "'s gradient is kept in another dtype than the one asked for");
    const std::int64_t at = zero_stage_ == 0   ? slot.flat
                            : zero_stage_ == 1 ? b.slice_elements * dp_->rank() + slot.offset
                                               : slot.offset;
    return std::get<Payload<T>>(where).raw_span().subspan(
        static_cast<std::size_t>(at), static_cast<std::size_t>(sharded() ? slot.range.valid() : slot.range.numel));
  }
  /// The slice of p this rank owns (the whole gradient at stage 0). Throws Error as reduced().
  ShardRange range(const Parameter& p) const {
    const auto it = where_.find(&p);
    DSP_CHECK(it != where_.end(), "grad buckets: parameter ", p.spec.name, " is not in any bucket");
    return sharded() ? it->second.range : ShardRange{it->second.range.numel, it->second.range.numel, 0};
  }
  /// Whether p is in one of the buckets.
  bool contains(const Parameter& p) const { return where_.contains(&p); }
  /// The ZeRO stage the buckets reduce for (0: all-reduce of whole gradients).
  int zero_stage() const { return zero_stage_; }
  /// Whether the gradients are kept in 16 bits (the constructor's mixed_precision).
  bool mixed_precision() const { return mixed_; }
  Comm& group() const { return *dp_; }
  /// The memory space the payloads and reduced slices live in (current at construction; null:
  /// host memory).
  MemorySpace* space() const { return space_; }

  /// Number of buckets.
  std::size_t size() const { return buckets_.size(); }
  /// Parameters of bucket i, in the order they become ready.
  const std::vector<Parameter*>& bucket(std::size_t i) const { return buckets_.at(i).params; }
  /// All-reduces bucket i has started since construction (one per step when DP > 1).
  std::int64_t reductions(std::size_t i) const { return buckets_.at(i).reductions; }
  const DdpConfig& config() const { return config_; }

 private:
  // A bucket's payload or reduced slices, in the memory space current at construction.
  template <class T>
  using Payload = SpaceBuffer<T>;
  using AnyPayload = std::variant<Payload<float>, Payload<bf16>, Payload<fp16>>;

  struct Bucket {
    std::vector<Parameter*> params;
    std::int64_t elements = 0;
    std::int64_t slice_elements = 0;  // ZeRO: the owned slices of the bucket's parameters, padded
    AnyPayload payload;               // in the communication dtype (none allocated: empty)
    AnyPayload reduced;               // ZeRO: the summed owned slices (mixed precision: 16-bit, stage >= 2)
    int ready = 0;
    std::int64_t reductions = 0;
    comm::Work work;
  };

  // Where a parameter sits: its bucket, its owned slice's offset in the bucket's reduced
  // slices and its ShardRange over the group.
  struct Slot {
    int bucket = 0;
    std::int64_t offset = 0;
    std::int64_t flat = 0;  // offset of the whole gradient in an unsharded payload
    ShardRange range;
  };

  bool sharded() const { return zero_stage_ >= 1; }
  // The space that copies between grad and an fp32 payload (in space_): space_, or grad's when
  // the buckets are in host memory.
  MemorySpace* copier(const Tensor& grad) const { return space_ ? space_ : grad.space(); }

  // The bucket's payload: its elements (ZeRO: N x its padded slices), counted as Communication
  // (mixed precision at stages 0 and 1: Gradients, it holds them). fp32 on a group of one
  // (nothing travels, so nothing is rounded, as at stage 0) unless mixed precision keeps 16 bits.
  void allocate_payload(Bucket& b) {
    const std::int64_t n = sharded() ? b.slice_elements * dp_->size() : b.elements;
    const GradReduceDType dtype = dp_->size() > 1 || mixed_ ? config_.grad_reduce_dtype : GradReduceDType::Fp32;
    b.payload = make_payload(dtype, n, mixed_ && zero_stage_ < 2 ? memory::Category::Gradients : memory::Category::Communication);
  }
  AnyPayload make_payload(GradReduceDType dtype, std::int64_t elements, memory::Category category) {
    const auto n = static_cast<std::size_t>(elements);
    if (dtype == GradReduceDType::Bf16) return Payload<bf16>(n, category, space_);
    if (dtype == GradReduceDType::Fp16) return Payload<fp16>(n, category, space_);
    return Payload<float>(n, category, space_);
  }
  // Whether a full gradient is released once packed (from stage 2, and with mixed precision).
  bool releases_gradients() const { return zero_stage_ >= 2 || mixed_; }

  // ZeRO: packs rank q's slice of every parameter at q x slice_elements + the parameter's
  // offset (padding zero), releases the full gradients from stage 2, and starts the
  // reduce-scatter into the owned slices.
  void launch_sharded(Bucket& b) {
    if (std::visit([](const auto& payload) { return payload.empty(); }, b.payload)) allocate_payload(b);
    const int n = dp_->size();
    std::visit(
        [&]<class T>(Payload<T>& payload) {
          for (auto* p : b.params) {
            const Slot& slot = where_.at(p);
            for (int q = 0; q < n; ++q) {
              const ShardRange r = shard_range(slot.range.numel, n, q);
              const auto at = static_cast<std::size_t>(q * b.slice_elements + slot.offset);
              pack(*p, p->grad.data() + r.begin, payload.data() + at, static_cast<std::size_t>(r.valid()));
            }
            if (releases_gradients()) p->grad = Tensor{};
          }
          if constexpr (std::is_same_v<T, float>) {
            b.work = dp_->reduce_scatter_async(std::span<const float>(payload.raw_span()),
                                               std::get<Payload<float>>(b.reduced).raw_span());
          } else {  // reduced in place: this rank's block of the payload
            const auto mine = payload.raw_span().subspan(static_cast<std::size_t>(b.slice_elements * dp_->rank()),
                                                         static_cast<std::size_t>(b.slice_elements));
            b.work = dp_->reduce_scatter_async(std::span<const T>(payload.raw_span()), mine);
          }
        },
        b.payload);
    ++b.reductions;
  }

  void launch_ready() {
    while (next_launch_ < buckets_.size() &&
           buckets_[next_launch_].ready == static_cast<int>(buckets_[next_launch_].params.size()))
      launch(buckets_[next_launch_++]);
  }

  // n elements of p's gradient at `grad` into a payload at `out` and back: an fp32 payload is
  // copied wherever each lives; a 16-bit one is rounded (widened) by Backend's convert, which
  // needs both in one memory: throws Error naming the parameter and both memories otherwise.
  template <class T>
  void pack(const Parameter& p, const float* grad, T* out, std::size_t n) const {
    if constexpr (std::is_same_v<T, float>) {
      copy_elements(copier(p.grad), out, grad, n);
    } else {
      check_with_payload(p);
      convert(Backend{}, static_cast<std::int64_t>(n), grad, out);
    }
  }
  template <class T>
  void unpack(const Parameter& p, const T* in, float* grad, std::size_t n) const {
    if constexpr (std::is_same_v<T, float>) {
      copy_elements(copier(p.grad), grad, in, n);
    } else {
      check_with_payload(p);
      convert(Backend{}, static_cast<std::int64_t>(n), in, grad);
    }
  }
  void check_with_payload(const Parameter& p) const {
    DSP_CHECK(p.grad.space() == space_, "grad buckets: ", p.spec.name, "'s gradient is in ",
              p.grad.space() ? p.grad.space()->name() : "host", " memory, the 16-bit payloads in ",
              space_ ? space_->name() : "host", " memory");
  }

  // f(parameter, slice) for each parameter of the bucket: its gradient's elements sit at `slice`
  // of the bucket's (unsharded) payload.
  template <class T, class F>
  static void for_each_slice(Bucket& b, Payload<T>& payload, F f) {
    std::size_t off = 0;
    for (auto* p : b.params) {
      const auto n = static_cast<std::size_t>(p->grad.numel());
      f(*p, payload.raw_span().subspan(off, n));
      off += n;
    }
  }

  // Packs the bucket's gradients into its payload and starts the all-reduce (ZeRO: the
  // reduce-scatter).
  void launch(Bucket& b) {
    if (sharded()) return launch_sharded(b);
    if (dp_->size() == 1 && !mixed_) return;
    std::visit(
        [&]<class T>(Payload<T>& payload) {
          for_each_slice(b, payload, [&](Parameter& p, std::span<T> slice) {
            pack(p, p.grad.data(), slice.data(), slice.size());
          });
          if (releases_gradients())
            for (auto* p : b.params) p->grad = Tensor{};
          if (dp_->size() > 1) b.work = dp_->all_reduce_async(payload.raw_span());
        },
        b.payload);
    if (dp_->size() > 1) ++b.reductions;
  }

  Comm* dp_;
  MemorySpace* space_ = current_memory_space();  // where payloads and reduced slices live
  DdpConfig config_;
  int zero_stage_ = 0;
  bool mixed_ = false;
  std::vector<Bucket> buckets_;
  std::unordered_map<const Parameter*, Slot> where_;
  std::size_t next_launch_ = 0;
};

}  // namespace dsp::dp
