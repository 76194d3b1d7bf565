#pragma once
// pp::Engine: runs one rank's action list of a validated pipeline Schedule over the pipeline
// group. Receives are posted asynchronously when their Recv action is reached (the schedules
// post each one a compute action ahead, so the transfer overlaps the previous compute) and
// waited for by the compute that consumes them; sends are buffered by every communicator, so
// they never wait. What a forward or backward computes is the caller's (Hooks): the engine
// only moves the tensors at stage boundaries and keeps the outputs until they are sent.
//
// Bubble: busy time is the time inside the hooks; everything else (waiting for a peer's
// activation or gradient, posting and sending, and, for a rank that finishes early, the wait
// for the last rank) is idle. Over the pipeline: bubble = 1 - sum_r busy_r / (p x max_r wall_r)
// (pipeline_bubble_fraction), the idle share of the p ranks' time during the step; in theory
// (p-1)/(m+p-1) for GPipe and 1F1B with uniform stages and (p-1)/(v m + p-1) interleaved
// (Narayanan et al., SC'21, section 2.2; theoretical_bubble_fraction). One rank's own
// 1 - busy / wall (ScheduleStats::bubble_fraction) leaves out its wait after its last action,
// so it is lower on the ranks that finish first.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "dsp/comm/communicator.hpp"
#include "dsp/comm/detail/keep_alive.hpp"
#include "dsp/core/tensor.hpp"
#include "dsp/core/trace.hpp"
#include "dsp/pp/schedule.hpp"

namespace dsp::pp {

/// What one run of a schedule did on this rank.
struct ScheduleStats {
  double seconds = 0.0;       ///< wall time of the run, seconds
  double busy_seconds = 0.0;  ///< time inside forward and backward hooks, seconds
  /// Most (micro-batch, chunk) pairs forwarded and not yet backwarded at once: stashed
  /// activations, each of one model chunk (1/v of the rank's layers when interleaved).
  int peak_in_flight = 0;
  /// This rank's idle share of its own run: 1 - busy / wall (0 for an empty run).
  double bubble_fraction() const { return seconds > 0.0 ? 1.0 - busy_seconds / seconds : 0.0; }
};

/// The step's bubble over the pipeline group: 1 - sum of busy / (p x longest wall time).
/// Collective over `pipeline`; every rank gets the result.
template <comm::Communicator Comm>
double pipeline_bubble_fraction(Comm& pipeline, const ScheduleStats& stats) {
  std::vector<double> busy{stats.busy_seconds}, wall{stats.seconds};
  pipeline.all_reduce(std::span(busy));
  pipeline.all_reduce(std::span(wall), comm::ReduceOp::Max);
  return wall[0] > 0.0 ? 1.0 - busy[0] / (pipeline.size() * wall[0]) : 0.0;
}

/// Message tags on the pipeline group: one per direction, so each (peer, direction) is a
/// channel matched in order (what validate() checks the schedules against).
inline constexpr int kActivationTag = 1;
inline constexpr int kGradTag = 2;

/// Forward only, stage after stage (evaluation, inference): for each virtual stage s of
/// `num_stages` held by this rank (s % p == rank, Megatron's layout), receives the previous
/// stage's output (boundary shape) unless s == 0, runs y = fn(s, x) (x empty on stage 0) and
/// sends y to the next stage's rank unless s is the last. Returns the last stage's output on
/// its rank, an empty tensor elsewhere. Collective over `pipeline`; sends are buffered, so the
/// stages of one rank simply run in order.
template <comm::Communicator Comm, class Fn>
Tensor forward_stages(Comm& pipeline, int num_stages, const Shape& boundary, Fn fn) {
  const int p = pipeline.size();
  Tensor last;
  for (int s = pipeline.rank(); s < num_stages; s += p) {
    Tensor x;
    if (s > 0) {
      x = Tensor(boundary);
      pipeline.recv(x.raw_span(), (s - 1) % p, kActivationTag);
    }
    Tensor y = fn(s, std::move(x));
    if (s + 1 < num_stages)
      pipeline.send(std::span<const float>(y.raw_span()), (s + 1) % p, kActivationTag);
    else
      last = std::move(y);
  }
  return last;
}

template <comm::Communicator Comm>
class Engine {
 public:
  /// The computations a schedule runs; called on this rank's thread in schedule order.
  struct Hooks {
    /// Forward of micro-batch mb on virtual stage `stage`: input = the previous stage's output
    /// (boundary shape; empty on stage 0). Returns the output for the next stage (boundary
    /// shape; ignored on the last stage).
    std::function<Tensor(int mb, int stage, Tensor input)> forward;
    /// Backward of mb on `stage`: grad_output = dL/d(output) from the next stage (boundary
    /// shape; empty on the last stage); last: this is the stage's last backward of the run
    /// (the step's gradients become final in it). Returns dL/d(input) for the previous stage
    /// (boundary shape; ignored on stage 0).
    std::function<Tensor(int mb, int stage, Tensor grad_output, bool last)> backward;
  };

  /// pipeline: the group of the schedule's p ranks (rank r runs schedule.ranks[r]).
  /// boundary_shape: shape of every activation and gradient crossing stages, e.g.
  /// [micro_batch * seq, hidden]. Validates the schedule (pp::validate). Throws ConfigError
  /// when it is invalid or its pipeline size is not the group's size.
  Engine(Comm& pipeline, Schedule schedule, Shape boundary_shape)
      : pipeline_(&pipeline), schedule_(std::move(schedule)), boundary_(std::move(boundary_shape)) {
    DSP_CHECK_AS(ConfigError, schedule_.pipeline_size == pipeline.size(), "schedule for ", schedule_.pipeline_size,
                 " pipeline ranks run on a pipeline group of ", pipeline.size());
    validate(schedule_);
    const auto& actions = schedule_.ranks[static_cast<std::size_t>(pipeline.rank())];
    for (std::size_t i = 0; i < actions.size(); ++i)
      if (actions[i].op == Op::Backward) last_backward_[actions[i].stage] = i;
  }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Runs this rank's actions once (one training step's micro-batches). Collective over the
  /// pipeline group. Rethrows a hook's exception; a peer's failure surfaces as the
  /// communicator's AbortedError / CommError from the receive waiting for it.
  ScheduleStats run(const Hooks& hooks) {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    ScheduleStats stats;
    Inbox inbox;
    std::map<Key, Tensor> outbox;  // computed, not yet sent
    int in_flight = 0;
    const int me = pipeline_->rank();
    const auto& actions = schedule_.ranks[static_cast<std::size_t>(me)];
    const auto timed = [&](auto&& f) {
      const auto start = clock::now();
      Tensor out = f();
      stats.busy_seconds += std::chrono::duration<double>(clock::now() - start).count();
      return out;
    };
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const Action& a = actions[i];
      const Key key{a.micro_batch, a.stage};
      switch (a.op) {
        case Op::RecvActivation:
          inbox.post(*pipeline_, boundary_, {a.micro_batch, a.stage, kActivationTag}, schedule_.rank_of(a.stage - 1));
          break;
        case Op::RecvGrad:
          inbox.post(*pipeline_, boundary_, {a.micro_batch, a.stage, kGradTag}, schedule_.rank_of(a.stage + 1));
          break;
        case Op::Forward: {
          Tensor in = a.stage > 0 ? inbox.take({a.micro_batch, a.stage, kActivationTag}) : Tensor{};
          Tensor out = timed([&] { return hooks.forward(a.micro_batch, a.stage, std::move(in)); });
          stats.peak_in_flight = std::max(stats.peak_in_flight, ++in_flight);
          if (a.stage + 1 < schedule_.num_stages()) outbox[key] = std::move(out);
          break;
        }
        case Op::Backward: {
          const bool last = last_backward_.at(a.stage) == i;
          Tensor dy = a.stage + 1 < schedule_.num_stages() ? inbox.take({a.micro_batch, a.stage, kGradTag}) : Tensor{};
          Tensor dx = timed([&] { return hooks.backward(a.micro_batch, a.stage, std::move(dy), last); });
          --in_flight;
          if (a.stage > 0) outbox[key] = std::move(dx);
          break;
        }
        case Op::SendActivation:
        case Op::SendGrad: {
          const bool fwd = a.op == Op::SendActivation;
          auto it = outbox.find(key);
          DSP_CHECK(it != outbox.end(), "pipeline: ", to_string(a), " before its computation");
          check_boundary(it->second, a);
          pipeline_->send(std::span<const float>(it->second.raw_span()), schedule_.rank_of(a.stage + (fwd ? 1 : -1)),
                          fwd ? kActivationTag : kGradTag);
          outbox.erase(it);
          break;
        }
      }
    }
    stats.seconds = std::chrono::duration<double>(clock::now() - t0).count();
    return stats;
  }

  const Schedule& schedule() const { return schedule_; }

  /// This rank's virtual stages in the order their last backward runs (when each stage's
  /// gradients become final for the step).
  std::vector<int> stages_by_last_backward() const {
    std::vector<std::pair<std::size_t, int>> by_index;
    for (auto [stage, index] : last_backward_) by_index.emplace_back(index, stage);
    std::sort(by_index.begin(), by_index.end());
    std::vector<int> out;
    for (auto [index, stage] : by_index) out.push_back(stage);
    return out;
  }

 private:
  using Key = std::pair<int, int>;  // (micro-batch, virtual stage)

  // Posted receives, by (micro-batch, stage, tag). While an exception unwinds the rank, the
  // buffers of receives still pending outlive it (their peers may still write them).
  struct Inbox {
    struct Pending {
      Tensor buffer;
      comm::Work work;
    };
    std::map<std::tuple<int, int, int>, Pending> pending;

    void post(Comm& c, const Shape& shape, std::tuple<int, int, int> key, int src) {
      Pending& p = pending[key];
      p.buffer = Tensor(shape);
      p.work = c.recv_async(p.buffer.raw_span(), src, std::get<2>(key));
    }
    Tensor take(std::tuple<int, int, int> key) {
      auto it = pending.find(key);
      DSP_CHECK(it != pending.end(), "pipeline: micro-batch ", std::get<0>(key), " of stage ", std::get<1>(key),
                " was never received");
      it->second.work.wait();
      Tensor t = std::move(it->second.buffer);
      pending.erase(it);
      return t;
    }
    ~Inbox() {
      for (auto& [key, p] : pending) {
        if (p.work.completed()) continue;
        comm::detail::keep_until_exit(std::move(p.buffer));
      }
    }
  };

  void check_boundary(const Tensor& t, const Action& a) const {
    DSP_CHECK(t.shape() == boundary_, "pipeline: ", to_string(a), " carries a tensor of shape ", shape_str(t.shape()),
              ", the stage boundary is ", shape_str(boundary_));
  }

  Comm* pipeline_;
  Schedule schedule_;
  Shape boundary_;
  std::map<int, std::size_t> last_backward_;  // virtual stage -> index of its last Backward
};

}  // namespace dsp::pp
