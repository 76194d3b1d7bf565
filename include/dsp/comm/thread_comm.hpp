#pragma once
// ThreadComm: ranks are threads of one process sharing memory (the embedded default
// communicator). Collectives meet at a barrier, exchange buffer pointers, and then every
// rank reads its peers' buffers directly: all_reduce is a reduce-scatter (rank r reduces
// chunk r in place) followed by an all-gather of the reduced chunks. The reduction order
// over ranks is fixed (rank 0, 1, ...), so every rank gets bit-identical results.
//
// Who calls what (CUB style): every collective must be called by all ranks of the
// communicator in the same order with matching sizes; it blocks the calling host thread
// until this rank's part is complete; the result is on every rank unless stated otherwise.
// The `*_async` forms return a Work at once and run on this rank's communication thread
// (collectives in issue order, so sync and async calls can be mixed; receives on a thread of
// their own; sends are buffered and complete at once).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <span>
#include <vector>

#include "dsp/comm/detail/group.hpp"
#include "dsp/comm/detail/worker.hpp"
#include "dsp/comm/reduce_op.hpp"
#include "dsp/comm/work.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/error.hpp"

namespace dsp::comm {

namespace detail {
/// Which collective a rank entered; checked first at every rendezvous so that mismatched
/// calls fail with CommError on every rank instead of reading the wrong buffers.
enum class OpCode : std::int64_t { AllReduce, ReduceScatter, AllGather, Broadcast, AllToAllV, Barrier, Split };
inline const char* op_name(std::int64_t op) {
  static const char* names[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all_v", "barrier", "split"};
  return op >= 0 && op < 7 ? names[op] : "?";
}

/// One rank's end of a Group; holds the algorithms. Copied into queued async tasks so that
/// moving the ThreadComm handle never invalidates them.
struct Endpoint {
  std::shared_ptr<Group> group;
  int rank = 0;

  template <class T>
  using Acc = decltype(to_accum(T{}));

  void sync(const char* op) const { group->arrive_and_wait(rank, op); }
  int size() const { return group->size; }

  // Posts ptr and {op, meta...}, meets every rank, and checks that all ranks entered the same
  // collective and, when same_args, with the same arguments. Every rank runs the same checks
  // on the same data, so either all throw CommError or none does.
  void post(OpCode op, const void* ptr, std::vector<std::int64_t> meta, bool same_args = true) {
    meta.insert(meta.begin(), static_cast<std::int64_t>(op));
    group->ptr[rank] = ptr;
    group->meta[rank] = std::move(meta);
    const char* name = op_name(static_cast<std::int64_t>(op));
    sync(name);
    for (int q = 0; q < size(); ++q) {
      const auto& m0 = group->meta[0];
      const auto& mq = group->meta[q];
      std::string msg;
      if (mq[0] != m0[0])
        msg = ::dsp::detail::concat("collective mismatch: rank 0 called ", op_name(m0[0]), ", rank ", q, " called ",
                                    op_name(mq[0]));
      else if (same_args && mq != m0)
        msg = ::dsp::detail::concat(name, ": ranks disagree on size/arguments (rank 0: ", m0.size() > 1 ? m0[1] : -1,
                                    ", rank ", q, ": ", mq.size() > 1 ? mq[1] : -1, ")");
      if (!msg.empty()) {
        sync(name);  // everybody has compared before anyone throws
        throw CommError(msg);
      }
    }
  }

  void barrier_impl() {
    post(OpCode::Barrier, nullptr, {});
    sync("barrier");  // nobody posts the next collective while a peer still checks this one
  }

  template <class T>
  const T* peer(int q) const { return static_cast<const T*>(group->ptr[q]); }

  std::pair<std::int64_t, std::int64_t> chunk(std::int64_t n, int r) const {
    const std::int64_t p = size();
    return {n * r / p, n * (r + 1) / p};
  }

  // out[i] = combine over ranks q = 0, 1, ... of peer_q[src_offset + i], for i in [begin, end),
  // accumulated in to_accum's type. One loop per operator (no per-element switch) so the
  // compiler can keep it tight; the rank order, hence the result, is the same for every op.
  template <class T, class Combine>
  void reduce_loop(T* out, std::int64_t src_offset, std::int64_t begin, std::int64_t end, Combine combine) const {
    std::vector<const T*> src(static_cast<std::size_t>(size()));
    for (int q = 0; q < size(); ++q) src[static_cast<std::size_t>(q)] = peer<T>(q) + src_offset;
    const std::size_t p = src.size();
    for (std::int64_t i = begin; i < end; ++i) {
      Acc<T> a = to_accum(src[0][i]);
      for (std::size_t q = 1; q < p; ++q) a = combine(a, to_accum(src[q][i]));
      out[i] = from_accum<T>(a);
    }
  }
  template <class T>
  void reduce_range(T* out, std::int64_t src_offset, std::int64_t begin, std::int64_t end, ReduceOp op) const {
    using A = Acc<T>;
    switch (op) {
      case ReduceOp::Sum: return reduce_loop(out, src_offset, begin, end, [](A x, A y) { return x + y; });
      case ReduceOp::Max: return reduce_loop(out, src_offset, begin, end, [](A x, A y) { return std::max(x, y); });
      case ReduceOp::Min: return reduce_loop(out, src_offset, begin, end, [](A x, A y) { return std::min(x, y); });
    }
  }

  template <class T>
  void all_reduce_impl(std::span<T> data, ReduceOp op) {
    const auto n = static_cast<std::int64_t>(data.size());
    post(OpCode::AllReduce, data.data(), {n, static_cast<std::int64_t>(op)});
    auto [b, e] = chunk(n, rank);
    reduce_range(data.data(), 0, b, e, op);  // only this rank writes chunk r; peers read chunk q != r
    sync("all_reduce");
    for (int q = 0; q < size(); ++q) {
      if (q == rank) continue;
      auto [qb, qe] = chunk(n, q);
      std::copy(peer<T>(q) + qb, peer<T>(q) + qe, data.data() + qb);
    }
    sync("all_reduce");
  }

  template <class T>
  void reduce_scatter_impl(std::span<const T> in, std::span<T> out, ReduceOp op) {
    const auto n = static_cast<std::int64_t>(out.size());
    DSP_CHECK_AS(CommError, static_cast<std::int64_t>(in.size()) == n * size(), "reduce_scatter: input has ",
                 in.size(), " elements, expected ", size(), " x ", n);
    post(OpCode::ReduceScatter, in.data(), {n, static_cast<std::int64_t>(op)});
    std::vector<T> tmp(static_cast<std::size_t>(n));  // `out` may alias `in`
    reduce_range(tmp.data() - 0, n * rank, 0, n, op);
    sync("reduce_scatter");
    std::copy(tmp.begin(), tmp.end(), out.begin());
  }

  template <class T>
  void all_gather_impl(std::span<const T> in, std::span<T> out) {
    const auto n = static_cast<std::int64_t>(in.size());
    DSP_CHECK_AS(CommError, static_cast<std::int64_t>(out.size()) == n * size(), "all_gather: output has ",
                 out.size(), " elements, expected ", size(), " x ", n);
    post(OpCode::AllGather, in.data(), {n});
    for (int q = 0; q < size(); ++q)
      if (peer<T>(q) != out.data() + n * q) std::copy(peer<T>(q), peer<T>(q) + n, out.data() + n * q);
    sync("all_gather");
  }

  template <class T>
  void broadcast_impl(std::span<T> data, int root) {
    DSP_CHECK_AS(CommError, root >= 0 && root < size(), "broadcast: root ", root, " outside [0, ", size(), ")");
    post(OpCode::Broadcast, data.data(), {static_cast<std::int64_t>(data.size()), root});
    if (rank != root) std::copy(peer<T>(root), peer<T>(root) + data.size(), data.data());
    sync("broadcast");
  }

  template <class T>
  void send_impl(std::span<const T> data, int dst, int tag) {
    DSP_CHECK_AS(CommError, dst >= 0 && dst < size() && dst != rank, "send: bad destination rank ", dst);
    group->post_message(rank, dst, tag, data.data(), data.size_bytes());
  }
  template <class T>
  void recv_impl(std::span<T> data, int src, int tag) {
    DSP_CHECK_AS(CommError, src >= 0 && src < size() && src != rank, "recv: bad source rank ", src);
    group->take_message(src, rank, tag, data.data(), data.size_bytes());
  }

  template <class T>
  void all_to_all_v_impl(std::span<const T> in, const std::vector<std::int64_t>& send_counts, std::span<T> out,
                         const std::vector<std::int64_t>& recv_counts) {
    const int p = size();
    DSP_CHECK_AS(CommError, static_cast<int>(send_counts.size()) == p && static_cast<int>(recv_counts.size()) == p,
                 "all_to_all_v: counts must have one entry per rank (", p, ")");
    DSP_CHECK_AS(CommError, std::accumulate(send_counts.begin(), send_counts.end(), std::int64_t{0}) ==
                                static_cast<std::int64_t>(in.size()),
                 "all_to_all_v: send counts do not sum to the input size ", in.size());
    DSP_CHECK_AS(CommError, std::accumulate(recv_counts.begin(), recv_counts.end(), std::int64_t{0}) ==
                                static_cast<std::int64_t>(out.size()),
                 "all_to_all_v: recv counts do not sum to the output size ", out.size());
    std::vector<std::int64_t> meta = send_counts;  // [send counts..., recv counts...]
    meta.insert(meta.end(), recv_counts.begin(), recv_counts.end());
    post(OpCode::AllToAllV, in.data(), std::move(meta), /*same_args=*/false);
    // Every rank checks the whole count matrix, so either all ranks throw or none does.
    for (int src = 0; src < p; ++src)
      for (int dst = 0; dst < p; ++dst)
        if (group->meta[src][1 + dst] != group->meta[dst][1 + p + src]) {
          const std::string msg = ::dsp::detail::concat("all_to_all_v: rank ", src, " sends ", group->meta[src][1 + dst],
                                                        " elements to rank ", dst, ", which expects ",
                                                        group->meta[dst][1 + p + src]);
          sync("all_to_all_v");
          throw CommError(msg);
        }
    std::int64_t out_off = 0;
    for (int q = 0; q < p; ++q) {
      const auto sc = group->meta[q].begin() + 1;  // rank q's send counts
      const std::int64_t in_off = std::accumulate(sc, sc + rank, std::int64_t{0});
      std::copy(peer<T>(q) + in_off, peer<T>(q) + in_off + sc[rank], out.data() + out_off);
      out_off += recv_counts[q];
    }
    sync("all_to_all_v");
  }

  Endpoint split_impl(int color, int key) {
    post(OpCode::Split, nullptr, {color, key}, /*same_args=*/false);
    std::vector<int> members;  // old ranks with my colour, ordered by (key, old rank)
    for (int q = 0; q < size(); ++q)
      if (group->meta[q][1] == color) members.push_back(q);
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return group->meta[a][2] < group->meta[b][2]; });
    const int leader = *std::min_element(members.begin(), members.end());
    if (rank == leader)
      group->objs[rank] = std::make_shared<detail::Group>(group->universe, static_cast<int>(members.size()));
    sync("split");
    auto g = group->objs[leader];
    const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
    sync("split");
    if (rank == leader) group->objs[rank].reset();
    return {std::move(g), new_rank};
  }

};
}  // namespace detail

class ThreadComm {
 public:
  ThreadComm() = default;
  ThreadComm(std::shared_ptr<detail::Group> group, int rank) : ep_{std::move(group), rank} {}
  ThreadComm(ThreadComm&&) noexcept = default;
  ThreadComm& operator=(ThreadComm&&) noexcept = default;
  ThreadComm(const ThreadComm&) = delete;
  ThreadComm& operator=(const ThreadComm&) = delete;

  /// This rank's index in [0, size()).
  int rank() const { return ep_.rank; }
  /// Number of ranks in this communicator.
  int size() const { return ep_.group ? ep_.group->size : 0; }
  bool valid() const { return ep_.group != nullptr; }

  /// In-place element-wise reduction of `data` over all ranks; every rank gets the result.
  /// bf16 is accumulated in fp32 and rounded once. Throws CommError on a size mismatch.
  template <class T>
  void all_reduce(std::span<T> data, ReduceOp op = ReduceOp::Sum) {
    run("all_reduce", [=, ep = ep_]() mutable { ep.all_reduce_impl(data, op); });
  }
  template <class T>
  Work all_reduce_async(std::span<T> data, ReduceOp op = ReduceOp::Sum) {
    return submit([=, ep = ep_]() mutable { ep.all_reduce_impl(data, op); });
  }

  /// out[i] = reduce over ranks q of in_q[rank*out.size() + i]; in.size() == size()*out.size().
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::Sum) {
    run("reduce_scatter", [=, ep = ep_]() mutable { ep.reduce_scatter_impl(in, out, op); });
  }
  template <class T>
  Work reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::Sum) {
    return submit([=, ep = ep_]() mutable { ep.reduce_scatter_impl(in, out, op); });
  }

  /// out[q*in.size() + i] = in_q[i]; out.size() == size()*in.size(). `in` may alias its own
  /// block of `out`.
  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    run("all_gather", [=, ep = ep_]() mutable { ep.all_gather_impl(in, out); });
  }
  template <class T>
  Work all_gather_async(std::span<const T> in, std::span<T> out) {
    return submit([=, ep = ep_]() mutable { ep.all_gather_impl(in, out); });
  }

  /// Copies root's `data` into every other rank's `data`.
  template <class T>
  void broadcast(std::span<T> data, int root) {
    run("broadcast", [=, ep = ep_]() mutable { ep.broadcast_impl(data, root); });
  }
  template <class T>
  Work broadcast_async(std::span<T> data, int root) {
    return submit([=, ep = ep_]() mutable { ep.broadcast_impl(data, root); });
  }

  /// Sends data to rank dst. Buffered: copies and returns at once, so it never waits for the
  /// receiver and is never queued behind this rank's pending operations. Matched, in order,
  /// by recv(src = rank(), tag) on dst.
  template <class T>
  void send(std::span<const T> data, int dst, int tag = 0) {
    require_valid();
    ep_.send_impl(data, dst, tag);
  }
  /// As send; the returned Work is already complete (it carries send's error, if any).
  template <class T>
  Work send_async(std::span<const T> data, int dst, int tag = 0) {
    auto state = std::make_shared<Work::State>();
    try {
      send(data, dst, tag);
      state->finish(nullptr);
    } catch (...) {
      state->finish(std::current_exception());
    }
    return Work(state);
  }
  /// Receives exactly data.size() elements from rank src; CommError when the sizes differ.
  /// Receives are ordered among themselves but independent of collectives: a pending
  /// recv_async does not hold up a later send or collective of this rank.
  template <class T>
  void recv(std::span<T> data, int src, int tag = 0) {
    require_valid();
    if (p2p_worker_ && p2p_worker_->pending() > 0)
      return p2p_worker_->submit([=, ep = ep_]() mutable { ep.recv_impl(data, src, tag); }).wait();
    ep_.recv_impl(data, src, tag);
  }
  template <class T>
  Work recv_async(std::span<T> data, int src, int tag = 0) {
    require_valid();
    if (!p2p_worker_) p2p_worker_ = std::make_shared<detail::Worker>(ep_.group->universe, ep_.rank);
    return p2p_worker_->submit([=, ep = ep_]() mutable { ep.recv_impl(data, src, tag); });
  }

  /// Personalised exchange: this rank sends send_counts[q] elements (consecutive in `in`, in
  /// rank order) to rank q and receives recv_counts[q] elements from rank q into `out` (in
  /// rank order). Zero counts are allowed. Throws CommError when a peer's send count does
  /// not match this rank's recv count.
  template <class T>
  void all_to_all_v(std::span<const T> in, std::vector<std::int64_t> send_counts, std::span<T> out,
                    std::vector<std::int64_t> recv_counts) {
    run("all_to_all_v", [=, ep = ep_]() mutable { ep.all_to_all_v_impl(in, send_counts, out, recv_counts); });
  }
  template <class T>
  Work all_to_all_v_async(std::span<const T> in, std::vector<std::int64_t> send_counts, std::span<T> out,
                          std::vector<std::int64_t> recv_counts) {
    return submit([=, ep = ep_]() mutable { ep.all_to_all_v_impl(in, send_counts, out, recv_counts); });
  }

  /// Returns when every rank called barrier.
  void barrier() {
    run("barrier", [ep = ep_]() mutable { ep.barrier_impl(); });
  }
  Work barrier_async() {
    return submit([ep = ep_]() mutable { ep.barrier_impl(); });
  }

  /// Collective: ranks with the same colour (>= 0) form a new communicator, ordered by
  /// (key, old rank) as MPI_Comm_split.
  ThreadComm split(int color, int key) {
    DSP_CHECK_AS(CommError, color >= 0, "split: colour must be >= 0, got ", color);
    ThreadComm result;
    run("split", [&] {
      auto e = ep_.split_impl(color, key);
      result = ThreadComm(std::move(e.group), e.rank);
    });
    return result;
  }
  /// As split; `out` is assigned when the returned Work completes (keep it alive until then).
  Work split_async(int color, int key, ThreadComm& out) {
    DSP_CHECK_AS(CommError, color >= 0, "split: colour must be >= 0, got ", color);
    return submit([=, &out, ep = ep_]() mutable {
      auto e = ep.split_impl(color, key);
      out = ThreadComm(std::move(e.group), e.rank);
    });
  }

 private:
  void require_valid() const { DSP_CHECK_AS(CommError, ep_.group != nullptr, "use of an empty ThreadComm"); }

  // Runs fn on the calling thread, or after the queued async work when there is some.
  void run(const char*, const std::function<void()>& fn) {
    require_valid();
    if (worker_ && worker_->pending() > 0) return worker_->submit(fn).wait();
    fn();
  }
  Work submit(std::function<void()> fn) {
    require_valid();
    if (!worker_) worker_ = std::make_shared<detail::Worker>(ep_.group->universe, ep_.rank);
    return worker_->submit(std::move(fn));
  }
  detail::Endpoint ep_;
  std::shared_ptr<detail::Worker> worker_;      // collectives, in issue order
  std::shared_ptr<detail::Worker> p2p_worker_;  // receives, in issue order
};

}  // namespace dsp::comm
