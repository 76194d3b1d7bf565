#pragma once
// ExpertDispatcher: moves tokens to the ranks that own their experts and back (expert
// parallelism, GShard, Lepikhin et al. 2020, section 2.2; DeepSeekMoE / Megatron-Core's
// alltoall token dispatcher). Expert e lives on EP rank e / (E / ep), as local expert
// e % (E / ep). The forward of an MoE layer is
//   rows  = permute(x)            [A, hidden]  kept (token, slot) assignments, sorted by expert
//   local = dispatch(rows)        [R, hidden]  rows for this rank's experts, expert-major
//   out   = experts(local)        [R, hidden]  (grouped GEMMs, one block per local expert)
//   back  = undispatch(out)       [A, hidden]  in `rows` order again
//   y     = combine(back)         [tokens, hidden] = sum over kept slots of weight x row
// and its backward runs the same pieces in reverse: combine_backward, dispatch (of the row
// gradients), the experts' backward, undispatch, unpermute. dispatch and undispatch are
// all_to_all_v over the expert-parallel group and are each other's backward. An expert, or a
// whole rank, that gets no tokens is a normal case (zero rows).
//
// The plan is made on the host from a host Routing (the sort by expert and the per-expert counts,
// which size the all-to-all); the rows move wherever the tokens' tensors live (the current memory
// space, core/memory_space.hpp: a GPU's memory with backend::Cuda), through the backend's ops and
// the communicator, with copies of the plan's order and gate weights in that space.
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "dsp/backend/host/moe_permute.hpp"
#include "dsp/comm/communicator.hpp"
#include "dsp/core/memory_space.hpp"
#include "dsp/core/space_buffer.hpp"
#include "dsp/core/tensor.hpp"
#include "dsp/ep/router.hpp"

namespace dsp::ep {

/// Where one batch's assignments travel; made by ExpertDispatcher::plan (collective), reused by
/// every dispatch/undispatch of that batch, forward and backward. Move-only (it holds copies in a
/// memory space).
struct DispatchPlan {
  std::int64_t top_k = 1;
  std::vector<std::int64_t> order;          ///< [A] kept assignments (token * k + slot), sorted by expert
  std::vector<std::int64_t> expert_counts;  ///< [E] of them per expert (this rank's tokens)
  std::vector<std::int64_t> send_rows;      ///< [ep] rows sent to each EP rank
  std::vector<std::int64_t> recv_rows;      ///< [ep] rows received from each EP rank
  std::vector<std::int64_t> recv_counts;    ///< [ep, local experts] rows received per (source, local expert)
  std::vector<std::int64_t> rows_per_local_expert;  ///< [local experts] rows each local expert runs
  /// order [A] and the routing's gate weights [tokens, k], in the memory space current at plan()
  /// (host memory: plain copies), counted in the category current then (a plan kept for
  /// backward is an activation): what the row-moving ops read.
  SpaceArray<std::int64_t> order_in_space;
  SpaceArray<float> weights_in_space;

  std::int64_t assignments() const { return static_cast<std::int64_t>(order.size()); }
  /// Rows this rank's experts run: sum of recv_rows.
  std::int64_t local_rows() const { return std::accumulate(recv_rows.begin(), recv_rows.end(), std::int64_t{0}); }
};

template <comm::Communicator Comm, class Backend = backend::Host>
class ExpertDispatcher {
 public:
  /// ep: the expert-model-parallel group (size 1: every expert local, no communication).
  /// Throws ConfigError, naming both numbers, when num_experts is not divisible by ep.size().
  ExpertDispatcher(Comm& ep, std::int64_t num_experts, std::int64_t hidden)
      : ep_(&ep),
        num_experts_(num_experts),
        num_local_(local_experts(num_experts, ep.size())),
        hidden_(hidden) {}

  std::int64_t num_local_experts() const { return num_local_; }
  /// Global index of this rank's first expert.
  std::int64_t first_local_expert() const { return num_local_ * ep_->rank(); }
  Comm& expert_group() { return *ep_; }

  /// Sorts the kept assignments of `r` by expert (on the host) and exchanges the per-expert
  /// counts with the EP group; copies the order and r's gate weights into the current memory
  /// space (r's capacity must be applied already: combine reads these weights). Collective over
  /// the EP group. Throws Error when r.num_experts is not E.
  DispatchPlan plan(const Routing& r) {
    DSP_CHECK(r.num_experts == num_experts_, "dispatch plan: routing over ", r.num_experts,
              " experts, dispatcher over ", num_experts_);
    const int p = ep_->size();
    DispatchPlan d;
    d.top_k = r.top_k;
    d.order.resize(r.experts.size());
    d.expert_counts.resize(static_cast<std::size_t>(num_experts_));
    d.order.resize(static_cast<std::size_t>(sort_by_expert(backend::Host{}, r.experts.data(), r.kept.data(),
                                                           static_cast<std::int64_t>(r.experts.size()), num_experts_,
                                                           d.order.data(), d.expert_counts.data())));
    d.recv_counts.resize(static_cast<std::size_t>(num_experts_));
    const std::vector<std::int64_t> per_rank(static_cast<std::size_t>(p), num_local_);
    ep_->all_to_all_v(std::span<const std::int64_t>(d.expert_counts), per_rank, std::span(d.recv_counts), per_rank);
    d.send_rows.assign(static_cast<std::size_t>(p), 0);
    d.recv_rows.assign(static_cast<std::size_t>(p), 0);
    d.rows_per_local_expert.assign(static_cast<std::size_t>(num_local_), 0);
    for (int q = 0; q < p; ++q)
      for (std::int64_t j = 0; j < num_local_; ++j) {
        const auto i = static_cast<std::size_t>(q * num_local_ + j);
        d.send_rows[static_cast<std::size_t>(q)] += d.expert_counts[i];
        d.recv_rows[static_cast<std::size_t>(q)] += d.recv_counts[i];
        d.rows_per_local_expert[static_cast<std::size_t>(j)] += d.recv_counts[i];
      }
    d.order_in_space =
        SpaceArray<std::int64_t>(std::span<const std::int64_t>(d.order), current_memory_space(), memory::current_category());
    d.weights_in_space =
        SpaceArray<float>(std::span<const float>(r.weights), current_memory_space(), memory::current_category());
    return d;
  }

  /// x [tokens, hidden] -> rows [A, hidden] in plan order (each kept assignment's token row).
  Tensor permute(const DispatchPlan& d, const Tensor& x) const {
    Tensor rows({d.assignments(), hidden_});
    permute_rows(Backend{}, x.data(), d.order_in_space.data(), d.assignments(), d.top_k, hidden_, rows.data());
    return rows;
  }
  /// Backward of permute: rows [A, hidden] -> dx [tokens, hidden] (a token's slots summed).
  Tensor unpermute(const DispatchPlan& d, const Tensor& rows, std::int64_t tokens) const {
    Tensor dx({tokens, hidden_});
    unpermute_rows_add(Backend{}, rows.data(), d.order_in_space.data(), d.assignments(), d.top_k, hidden_, dx.data());
    return dx;
  }

  /// rows [A, hidden] in plan order -> this rank's experts' rows [R, hidden], expert-major
  /// (local expert 0's rows from EP rank 0, 1, ..., then local expert 1's ...). Collective over
  /// the EP group; with one EP rank the rows are already in that order and are returned as they are.
  Tensor dispatch(const DispatchPlan& d, Tensor rows) {
    if (ep_->size() == 1) return rows;
    Tensor received({d.local_rows(), hidden_});
    ep_->all_to_all_v(std::span<const float>(rows.raw_span()), scaled(d.send_rows), received.raw_span(),
                      scaled(d.recv_rows));
    Tensor out({d.local_rows(), hidden_});
    regroup_rows(Backend{}, received.data(), d.recv_counts.data(), ep_->size(), num_local_, hidden_, true, out.data());
    return out;
  }
  /// Inverse of dispatch: expert-major rows [R, hidden] -> [A, hidden] in plan order on the
  /// ranks the tokens came from. Collective over the EP group (none with one EP rank).
  Tensor undispatch(const DispatchPlan& d, Tensor local) {
    if (ep_->size() == 1) return local;
    Tensor by_source({d.local_rows(), hidden_});
    regroup_rows(Backend{}, local.data(), d.recv_counts.data(), ep_->size(), num_local_, hidden_, false,
                 by_source.data());
    Tensor rows({d.assignments(), hidden_});
    ep_->all_to_all_v(std::span<const float>(by_source.raw_span()), scaled(d.recv_rows), rows.raw_span(),
                      scaled(d.send_rows));
    return rows;
  }

  /// y [tokens, hidden] = sum over each token's kept slots of weight x its row (rows [A,
  /// hidden] in plan order; weights [tokens, k]: the plan's copy of r's).
  Tensor combine(const DispatchPlan& d, const Routing& r, const Tensor& rows) const {
    Tensor y({r.tokens, hidden_});
    combine_rows(Backend{}, rows.data(), d.weights_in_space.data(), d.order_in_space.data(), d.assignments(), d.top_k,
                 hidden_, y.data());
    return y;
  }
  /// Backward of combine: given dy [tokens, hidden], returns d(rows) [A, hidden] and adds
  /// dot(dy_t, row) to dweights [tokens, k] (host memory) of every kept slot; the dots are
  /// computed where the rows live and copied to the host. Throws Error when dweights is not
  /// [tokens, k].
  Tensor combine_backward(const DispatchPlan& d, const Routing& r, const Tensor& rows, const Tensor& dy,
                          std::span<float> dweights) const {
    DSP_CHECK(dweights.size() == r.weights.size(), "combine_backward: dweights has ", dweights.size(),
              " values, expected tokens x k = ", r.weights.size());
    Tensor drows({d.assignments(), hidden_});
    const auto backward = [&](float* out) {
      combine_rows_backward(Backend{}, rows.data(), d.weights_in_space.data(), d.order_in_space.data(),
                            d.assignments(), d.top_k, hidden_, dy.data(), drows.data(), out);
    };
    if (!rows.space()) {  // host memory: straight into dweights
      backward(dweights.data());
      return drows;
    }
    SpaceBuffer<float> dots(dweights.size(), memory::current_category(), rows.space());  // zeroed
    backward(dots.data());
    std::vector<float> host(dweights.size());
    copy_elements(dots.space(), host.data(), dots.data(), host.size());
    for (std::size_t i = 0; i < host.size(); ++i) dweights[i] += host[i];
    return drows;
  }

 private:
  static std::int64_t local_experts(std::int64_t num_experts, int ep_size) {
    DSP_CHECK_AS(ConfigError, num_experts >= 1 && num_experts % ep_size == 0, "number of experts (", num_experts,
                 ") is not divisible by expert-model-parallel-size (", ep_size, ")");
    return num_experts / ep_size;
  }

  std::vector<std::int64_t> scaled(const std::vector<std::int64_t>& rows) const {
    std::vector<std::int64_t> out(rows);
    for (auto& v : out) v *= hidden_;
    return out;
  }

  Comm* ep_;
  std::int64_t num_experts_, num_local_, hidden_;
};

}  // namespace dsp::ep
