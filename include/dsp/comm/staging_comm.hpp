#pragma once
// StagingComm: a Communicator for tensors in a memory space its inner communicator cannot read
// (GPU memory with ThreadComm, or with an MPI that is not CUDA-aware): every operation copies
// its inputs out to host buffers through the calling thread's current MemorySpace, runs the
// inner operation on them, and copies its outputs back. With ThreadComm this is the
// shared-device path: several ranks (threads) on one GPU run the TP/PP/DP logic exactly as
// on separate devices, their collectives going through host memory. Outside any memory space
// (host tensors) every call goes straight to the inner communicator.
//
// Cost: two copies of every payload (device-to-host and back) on top of the inner operation,
// and each copy waits for the space's stream. It exists to test parallel layouts on one GPU;
// NcclComm is the communicator for real multi-GPU runs.
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "dsp/comm/communicator.hpp"
#include "dsp/comm/detail/keep_alive.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/core/memory_space.hpp"

namespace dsp::comm {

template <Communicator Inner>
class StagingComm {
 public:
  /// Wraps `inner` (e.g. world.split(0, world.rank()) of the ThreadComm that comm::launch
  /// gives each rank: the same ranks, owned here).
  explicit StagingComm(Inner inner) : inner_(std::move(inner)) {}

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  Inner& inner() { return inner_; }

  /// The inner communicator's operations with the same contracts (who calls, which ranks hold
  /// the result, what blocks); spans may be in the current memory space. Staged, a blocking
  /// form is the asynchronous one waited on. The asynchronous forms copy the results back when
  /// the Work completes: in wait(), on the waiting thread, or in the first completed() that
  /// finds the inner operation done (so that completed() may then wait for the space's copy). A staged operation's host buffers live until it completes, even
  /// when its Work is dropped first. The inner communicator sees disjoint host buffers, so its
  /// checks of overlapping arguments do not apply.
  template <class T>
  void all_reduce(std::span<T> data, ReduceOp op = ReduceOp::Sum) {
    if (!current_memory_space()) return inner_.all_reduce(data, op);
    all_reduce_async(data, op).wait();
  }
  template <class T>
  Work all_reduce_async(std::span<T> data, ReduceOp op = ReduceOp::Sum) {
    MemorySpace* s = current_memory_space();
    if (!s) return inner_.all_reduce_async(data, op);
    auto h = stage_in(s, data);
    return copy_out_on_wait(s, inner_.all_reduce_async(h->span(), op), h, data, "all_reduce");
  }

  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::Sum) {
    if (!current_memory_space()) return inner_.reduce_scatter(in, out, op);
    reduce_scatter_async(in, out, op).wait();
  }
  template <class T>
  Work reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::Sum) {
    MemorySpace* s = current_memory_space();
    if (!s) return inner_.reduce_scatter_async(in, out, op);
    auto hin = stage_in(s, in);
    auto hout = stage<T>(out.size());
    Work w = inner_.reduce_scatter_async(std::span<const T>(hin->span()), hout->span(), op);
    return copy_out_on_wait(s, std::move(w), hout, out, "reduce_scatter", hin);
  }

  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    if (!current_memory_space()) return inner_.all_gather(in, out);
    all_gather_async(in, out).wait();
  }
  template <class T>
  Work all_gather_async(std::span<const T> in, std::span<T> out) {
    MemorySpace* s = current_memory_space();
    if (!s) return inner_.all_gather_async(in, out);
    auto hin = stage_in(s, in);
    auto hout = stage<T>(out.size());
    Work w = inner_.all_gather_async(std::span<const T>(hin->span()), hout->span());
    return copy_out_on_wait(s, std::move(w), hout, out, "all_gather", hin);
  }

  template <class T>
  void broadcast(std::span<T> data, int root) {
    if (!current_memory_space()) return inner_.broadcast(data, root);
    broadcast_async(data, root).wait();
  }
  template <class T>
  Work broadcast_async(std::span<T> data, int root) {
    MemorySpace* s = current_memory_space();
    if (!s) return inner_.broadcast_async(data, root);
    auto h = stage_in(s, data);
    return copy_out_on_wait(s, inner_.broadcast_async(h->span(), root), h, data, "broadcast");
  }

  template <class T>
  void send(std::span<const T> data, int dst, int tag = 0) {
    if (!current_memory_space()) return inner_.send(data, dst, tag);
    send_async(data, dst, tag).wait();
  }
  template <class T>
  Work send_async(std::span<const T> data, int dst, int tag = 0) {
    MemorySpace* s = current_memory_space();
    if (!s) return inner_.send_async(data, dst, tag);
    auto h = stage_in(s, data);
    Work w = inner_.send_async(std::span<const T>(h->span()), dst, tag);
    return copy_out_on_wait(s, std::move(w), h, std::span<T>{}, "send");
  }
  template <class T>
  void recv(std::span<T> data, int src, int tag = 0) {
    if (!current_memory_space()) return inner_.recv(data, src, tag);
    recv_async(data, src, tag).wait();
  }
  template <class T>
  Work recv_async(std::span<T> data, int src, int tag = 0) {
    MemorySpace* s = current_memory_space();
    if (!s) return inner_.recv_async(data, src, tag);
    auto h = stage<T>(data.size());
    return copy_out_on_wait(s, inner_.recv_async(h->span(), src, tag), h, data, "recv");
  }

  template <class T>
  void all_to_all_v(std::span<const T> in, std::vector<std::int64_t> send_counts, std::span<T> out,
                    std::vector<std::int64_t> recv_counts) {
    if (!current_memory_space()) return inner_.all_to_all_v(in, std::move(send_counts), out, std::move(recv_counts));
    all_to_all_v_async(in, std::move(send_counts), out, std::move(recv_counts)).wait();
  }
  template <class T>
  Work all_to_all_v_async(std::span<const T> in, std::vector<std::int64_t> send_counts, std::span<T> out,
                          std::vector<std::int64_t> recv_counts) {
    MemorySpace* s = current_memory_space();
    if (!s) return inner_.all_to_all_v_async(in, std::move(send_counts), out, std::move(recv_counts));
    auto hin = stage_in(s, in);
    auto hout = stage<T>(out.size());
    Work w = inner_.all_to_all_v_async(std::span<const T>(hin->span()), std::move(send_counts), hout->span(),
                                       std::move(recv_counts));
    return copy_out_on_wait(s, std::move(w), hout, out, "all_to_all_v", hin);
  }

  void barrier() { inner_.barrier(); }
  Work barrier_async() { return inner_.barrier_async(); }
  /// The inner communicator's split, wrapped.
  StagingComm split(int color, int key) { return StagingComm(inner_.split(color, key)); }

 private:
  // A host copy of one payload, counted as Communication. If it is destroyed while an
  // exception unwinds (its operation may still be in flight on peers), its storage goes to
  // comm::detail::keep_until_exit instead of being freed.
  template <class T>
  struct Staged {
    std::vector<T, memory::CountingAllocator<T>> host;
    explicit Staged(std::size_t n)
        : host(n, T{}, memory::CountingAllocator<T>(memory::Category::Communication)) {}
    std::span<T> span() { return host; }
    // Copies the host values to `out` (in space s); nothing for an empty out.
    void copy_out(MemorySpace* s, std::span<T> out) const {
      if (!out.empty()) s->copy(out.data(), host.data(), out.size_bytes());
    }
  };
  template <class T>
  static std::shared_ptr<Staged<T>> stage(std::size_t n) {
    return std::shared_ptr<Staged<T>>(new Staged<T>(n), [](Staged<T>* p) {
      if (std::uncaught_exceptions() > 0) detail::keep_until_exit(std::move(p->host));
      delete p;
    });
  }
  template <class T>
  static std::shared_ptr<Staged<std::remove_const_t<T>>> stage_in(MemorySpace* s, std::span<T> in) {
    auto h = stage<std::remove_const_t<T>>(in.size());
    if (!in.empty()) s->copy(h->host.data(), in.data(), in.size_bytes());
    return h;
  }
  // An operation in flight on staged buffers: if it is dropped before it completed, the buffers
  // go to keep_until_exit (the inner communicator may still read or write them).
  template <class T>
  struct InFlight {
    Work inner;
    std::shared_ptr<Staged<T>> out;
    std::shared_ptr<void> in;
    InFlight(Work w, std::shared_ptr<Staged<T>> o, std::shared_ptr<void> i)
        : inner(std::move(w)), out(std::move(o)), in(std::move(i)) {}
    InFlight(const InFlight&) = delete;
    InFlight& operator=(const InFlight&) = delete;
    ~InFlight() {
      if (inner.completed()) return;
      detail::keep_until_exit(std::move(out));
      detail::keep_until_exit(std::move(in));
    }
  };
  // A Work that waits for `w`, then copies `h` to `out` in space s; `keep` (the staged input)
  // lives as long as the operation.
  template <class T>
  static Work copy_out_on_wait(MemorySpace* s, Work w, std::shared_ptr<Staged<T>> h, std::span<T> out, const char* op,
                               std::shared_ptr<void> keep = nullptr) {
    auto f = std::make_shared<InFlight<T>>(std::move(w), std::move(h), std::move(keep));
    return Work([s, f, out] {
      f->inner.wait();
      f->out->copy_out(s, out);
    }, [f] { return f->inner.completed(); }, op);
  }

  Inner inner_;
};

}  // namespace dsp::comm
