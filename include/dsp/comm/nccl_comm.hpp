#pragma once
// NcclComm: the Communicator over NCCL, one GPU per rank, for ranks that are threads
// (created from a ThreadComm group) or processes (from an MpiComm): the unique id is made by
// rank 0 and broadcast over that group, then every rank joins with ncclCommInitRank.
//
// Buffers are device memory. The blocking forms also take host memory (the host-side values a
// trainer reduces besides tensors: loss sums, gradient norms, token counts): such a span is
// copied to a device buffer on the compute stream, the operation runs on it, the result is
// copied back, and the call waits for the compute stream (polling for NCCL's asynchronous errors,
// as barrier() does: a peer that failed ends the wait). The asynchronous forms throw
// CommError for host memory. Ordering, as in PyTorch's ProcessGroupNCCL: every operation is
// enqueued on the communicator's own stream after the work enqueued so far on the compute
// stream (the one given at creation: the ops' Cuda{stream}), through an event. The blocking
// forms then make the compute stream's later work wait for the operation (an event again) and
// return without blocking the host: the result is ready for every later op on the compute
// stream, and to_host() of it waits as usual. The `*_async` forms return a Work whose wait()
// does that step, and whose test() asks whether the operation finished. Only barrier() and the
// blocking forms given host memory block the host. Buffers must stay alive until the compute stream passed
// the operation; the communicator must outlive its Works.
//
// Who calls what (NCCL's rules): every collective is called by all ranks in the same order with
// matching sizes. send/recv pairs match in issue order per pair of ranks: NCCL has no tags, so
// the tag argument is accepted and ignored. Sends are not buffered: a send holds up the
// communication stream until the peer's matching recv runs, so a cycle of sends issued before
// their recvs deadlocks (order them, e.g. even ranks send first, or use all_to_all_v, which
// groups them). One host thread per communicator. bf16 and fp16 sums are NCCL's, rounded to 16 bits
// at each step of its algorithm, not accumulated in fp32 as ThreadComm's and MpiComm's are
// (DESIGN.md section 3): reduce fp32 copies where that matters.
//
// Errors: a failed NCCL call throws CommError naming the call, NCCL's error string and its last
// error message, and file:line. An asynchronous error (a peer that died, a network failure)
// surfaces at the next Work::wait or test or barrier, which aborts this rank's communicator
// (ncclCommAbort: its pending operations end) and throws CommError; the peers see their own
// error or time out. barrier() gives up after DSP_COMM_TIMEOUT_S (default 300 s) with
// TimeoutError, aborting likewise.
// Reference: NCCL User Guide, "Creating a communicator", "CUDA stream semantics", "Group calls".
#include <cuda_runtime.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/backend/cuda/stream.hpp"
#include "dsp/comm/reduce_op.hpp"
#include "dsp/comm/timeout.hpp"
#include "dsp/comm/work.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/error.hpp"

namespace dsp::comm {

namespace detail {

/// DSP_NCCL_CHECK's body: throws CommError unless r is ncclSuccess.
inline void nccl_check(ncclResult_t r, ncclComm_t comm, const char* call, const char* file, int line) {
  if (r == ncclSuccess) return;
  const char* last = ncclGetLastError(comm);
  throw CommError(dsp::detail::concat(call, " failed: ", ncclGetErrorString(r),
                                      last && *last ? dsp::detail::concat(" (", last, ")") : std::string(), " at ",
                                      file, ":", line));
}

/// NCCL's element type of T.
template <class T>
constexpr ncclDataType_t nccl_type() {
  if constexpr (std::is_same_v<T, float>) return ncclFloat32;
  else if constexpr (std::is_same_v<T, double>) return ncclFloat64;
  else if constexpr (std::is_same_v<T, bf16>) return ncclBfloat16;
  else if constexpr (std::is_same_v<T, fp16>) return ncclFloat16;
  else if constexpr (std::is_same_v<T, std::int32_t>) return ncclInt32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return ncclInt64;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return ncclUint8;
  else if constexpr (std::is_same_v<T, char> || std::is_same_v<T, std::int8_t>) return ncclInt8;
  else static_assert(sizeof(T) == 0, "NcclComm: no NCCL type for this element type");
}

inline ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Min:
      return ncclMin;
  }
  throw CommError("unknown ReduceOp");
}

}  // namespace detail

}  // namespace dsp::comm

/// Checks an NCCL call on communicator `handle` (may be nullptr): throws dsp::CommError with the
/// call, NCCL's error string, its last error message and file:line.
#define DSP_NCCL_CHECK(handle, call) ::dsp::comm::detail::nccl_check((call), (handle), #call, __FILE__, __LINE__)

namespace dsp::comm {

/// A group of ranks, one GPU each, communicating through NCCL (rules at the top of this file).
class NcclComm {
 public:
  /// An empty communicator (valid() is false), or moved-from. Moves keep pending Works valid.
  NcclComm() = default;
  NcclComm(NcclComm&& o) noexcept
      : state_(std::move(o.state_)), compute_(std::exchange(o.compute_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  NcclComm& operator=(NcclComm&& o) noexcept {
    state_ = std::move(o.state_);
    compute_ = std::exchange(o.compute_, nullptr);
    size_ = std::exchange(o.size_, 0);
    return *this;
  }

  /// Collective over `group` (a ThreadComm or MpiComm: anything with rank(), size() and
  /// broadcast): rank r of the group becomes rank r here, on the calling thread's current
  /// device (cudaSetDevice before; one device per rank, NCCL refuses two ranks on one GPU).
  /// `compute` is the stream the operations are ordered against. Throws CommError when NCCL
  /// fails (the message names the call).
  template <class Group>
  static NcclComm create(Group& group, backend::Cuda compute) {
    ncclUniqueId id{};
    if (group.rank() == 0) DSP_NCCL_CHECK(nullptr, ncclGetUniqueId(&id));
    std::array<std::int32_t, (sizeof(ncclUniqueId) + 3) / 4> words{};
    std::memcpy(words.data(), &id, sizeof id);
    group.broadcast(std::span<std::int32_t>(words), 0);
    std::memcpy(&id, words.data(), sizeof id);
    NcclComm c(compute);
    DSP_NCCL_CHECK(nullptr, ncclCommInitRank(&c.state_->comm, group.size(), id, group.rank()));
    c.state_->rank = group.rank();
    c.size_ = group.size();
    return c;
  }

  int rank() const { return state_ ? state_->rank : 0; }
  /// Number of ranks (0 when empty).
  int size() const { return size_; }
  bool valid() const { return state_ && state_->comm; }
  /// The NCCL communicator, for calls dsp does not wrap; stays owned by this object.
  ncclComm_t native() const { return state_ ? state_->comm : nullptr; }

  /// data [n] = the op over every rank's data [n], in place.
  template <class T>
  void all_reduce(std::span<T> data, ReduceOp op = ReduceOp::Sum) {
    DeviceView d(data, *this);
    all_reduce_async(d.span(), op).wait();
    d.finish();
  }
  template <class T>
  Work all_reduce_async(std::span<T> data, ReduceOp op = ReduceOp::Sum) {
    device_only("all_reduce", data.data());
    return enqueue("all_reduce", [&](cudaStream_t s) {
      DSP_NCCL_CHECK(state_->comm, ncclAllReduce(data.data(), data.data(), data.size(), detail::nccl_type<T>(),
                                          detail::nccl_op(op), state_->comm, s));
    });
  }

  /// out [n] = the op over every rank's in [size * n] block `rank`. Throws CommError when
  /// in.size() != size * out.size().
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::Sum) {
    DeviceView i(in, *this);
    DeviceView o(out, *this);
    reduce_scatter_async(i.span(), o.span(), op).wait();
    o.finish();
    i.finish();
  }
  template <class T>
  Work reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::Sum) {
    device_only("reduce_scatter", in.data(), out.data());
    check_blocks("reduce_scatter", in.size(), out.size());
    return enqueue("reduce_scatter", [&](cudaStream_t s) {
      DSP_NCCL_CHECK(state_->comm, ncclReduceScatter(in.data(), out.data(), out.size(), detail::nccl_type<T>(),
                                              detail::nccl_op(op), state_->comm, s));
    });
  }

  /// out [size * n] = every rank's in [n], in rank order. Throws CommError when out.size() !=
  /// size * in.size().
  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    DeviceView i(in, *this);
    DeviceView o(out, *this);
    all_gather_async(i.span(), o.span()).wait();
    o.finish();
    i.finish();
  }
  template <class T>
  Work all_gather_async(std::span<const T> in, std::span<T> out) {
    device_only("all_gather", in.data(), out.data());
    check_blocks("all_gather", out.size(), in.size());
    return enqueue("all_gather", [&](cudaStream_t s) {
      DSP_NCCL_CHECK(state_->comm, ncclAllGather(in.data(), out.data(), in.size(), detail::nccl_type<T>(), state_->comm, s));
    });
  }

  /// data [n] = root's data [n] on every rank.
  template <class T>
  void broadcast(std::span<T> data, int root) {
    DeviceView d(data, *this);
    broadcast_async(d.span(), root).wait();
    d.finish();
  }
  template <class T>
  Work broadcast_async(std::span<T> data, int root) {
    device_only("broadcast", data.data());
    return enqueue("broadcast", [&](cudaStream_t s) {
      DSP_NCCL_CHECK(state_->comm,
                     ncclBroadcast(data.data(), data.data(), data.size(), detail::nccl_type<T>(), root, state_->comm, s));
    });
  }

  /// Sends data to rank dst (matched with dst's recv from this rank in issue order; the tag is
  /// ignored, NCCL has none).
  template <class T>
  void send(std::span<const T> data, int dst, int tag = 0) {
    DeviceView d(data, *this);
    send_async(d.span(), dst, tag).wait();
    d.finish();
  }
  template <class T>
  Work send_async(std::span<const T> data, int dst, int /*tag*/ = 0) {
    device_only("send", data.data());
    return enqueue("send", [&](cudaStream_t s) {
      DSP_NCCL_CHECK(state_->comm, ncclSend(data.data(), data.size(), detail::nccl_type<T>(), dst, state_->comm, s));
    });
  }
  /// Receives data from rank src (see send).
  template <class T>
  void recv(std::span<T> data, int src, int tag = 0) {
    DeviceView d(data, *this);
    recv_async(d.span(), src, tag).wait();
    d.finish();
  }
  template <class T>
  Work recv_async(std::span<T> data, int src, int /*tag*/ = 0) {
    device_only("recv", data.data());
    return enqueue("recv", [&](cudaStream_t s) {
      DSP_NCCL_CHECK(state_->comm, ncclRecv(data.data(), data.size(), detail::nccl_type<T>(), src, state_->comm, s));
    });
  }

  /// Sends in's block p (send_counts[p] elements, blocks in rank order) to rank p and receives
  /// rank p's block for this rank into out's block p (recv_counts[p]): grouped point-to-point
  /// (ncclGroupStart/End). Throws CommError when the counts do not have size() entries or do not
  /// add up to the buffers' sizes.
  template <class T>
  void all_to_all_v(std::span<const T> in, std::vector<std::int64_t> send_counts, std::span<T> out,
                    std::vector<std::int64_t> recv_counts) {
    DeviceView i(in, *this);
    DeviceView o(out, *this);
    all_to_all_v_async(i.span(), std::move(send_counts), o.span(), std::move(recv_counts)).wait();
    o.finish();
    i.finish();
  }
  template <class T>
  Work all_to_all_v_async(std::span<const T> in, std::vector<std::int64_t> send_counts, std::span<T> out,
                          std::vector<std::int64_t> recv_counts) {
    const auto total = [](const std::vector<std::int64_t>& c) { return std::accumulate(c.begin(), c.end(), 0LL); };
    DSP_CHECK_AS(CommError,
                 send_counts.size() == std::size_t(size_) && recv_counts.size() == std::size_t(size_) &&
                     total(send_counts) == std::int64_t(in.size()) && total(recv_counts) == std::int64_t(out.size()),
                 "all_to_all_v: counts (", send_counts.size(), " and ", recv_counts.size(), " entries, sums ",
                 total(send_counts), " and ", total(recv_counts), ") do not match ", size_, " ranks and buffers of ",
                 in.size(), " and ", out.size(), " elements");
    device_only("all_to_all_v", in.data(), out.data());
    return enqueue("all_to_all_v", [&](cudaStream_t s) {
      DSP_NCCL_CHECK(state_->comm, ncclGroupStart());
      struct GroupEnd {  // closes the group also when a call inside it throws
        ncclComm_t comm;
        bool done = false;
        ~GroupEnd() {
          if (!done) (void)ncclGroupEnd();
        }
        void end() {
          done = true;
          DSP_NCCL_CHECK(comm, ncclGroupEnd());
        }
      } group{state_->comm};
      std::int64_t sent = 0, received = 0;
      for (int p = 0; p < size_; ++p) {
        if (send_counts[p] > 0)
          DSP_NCCL_CHECK(state_->comm, ncclSend(in.data() + sent, std::size_t(send_counts[p]), detail::nccl_type<T>(), p,
                                         state_->comm, s));
        if (recv_counts[p] > 0)
          DSP_NCCL_CHECK(state_->comm, ncclRecv(out.data() + received, std::size_t(recv_counts[p]), detail::nccl_type<T>(),
                                         p, state_->comm, s));
        sent += send_counts[p];
        received += recv_counts[p];
      }
      group.end();
    });
  }

  /// Blocks the host until every rank arrived (a one-element all_reduce after the compute
  /// stream's work so far, waited for). Throws TimeoutError after DSP_COMM_TIMEOUT_S seconds
  /// (default 300) and CommError on an asynchronous NCCL error, aborting the communicator.
  void barrier() {
    const ncclComm_t comm = checked("barrier");
    backend::DeviceBuffer<std::int32_t> token(state_->stream.backend(), 1, memory::Category::Communication);
    order_after_compute();
    DSP_CUDA_CHECK(cudaMemsetAsync(token.data(), 0, sizeof(std::int32_t), state_->stream.get()));
    DSP_NCCL_CHECK(comm, ncclAllReduce(token.data(), token.data(), 1, ncclInt32, ncclSum, comm, state_->stream.get()));
    backend::Event done(false);
    done.record(state_->stream.backend());
    wait_host("barrier", done);
  }

  /// Collective: ranks with the same colour (>= 0, else CommError) form a new communicator,
  /// ordered by key, then by rank here (ncclCommSplit); it orders against the same compute
  /// stream.
  NcclComm split(int color, int key) {
    const ncclComm_t comm = checked("split");
    DSP_CHECK_AS(CommError, color >= 0, "split: colour must be >= 0, got ", color);
    NcclComm c(backend::Cuda{compute_});
    DSP_NCCL_CHECK(comm, ncclCommSplit(comm, color, key, &c.state_->comm, nullptr));
    DSP_NCCL_CHECK(c.state_->comm, ncclCommUserRank(c.state_->comm, &c.state_->rank));
    DSP_NCCL_CHECK(c.state_->comm, ncclCommCount(c.state_->comm, &c.size_));
    return c;
  }

  /// Aborts this rank's communicator (ncclCommAbort): its operations in flight end instead of
  /// hanging; the peers see errors or time out. The object is empty (valid() false) afterwards.
  void abort() noexcept {
    if (state_) state_->abort();
  }

 private:
  /// The NCCL communicator, shared with the Works of its operations.
  struct State {
    ncclComm_t comm = nullptr;
    int rank = 0;
    backend::Stream stream;  ///< the communication stream
    State() = default;
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    /// Destroys the communicator, or aborts it when an asynchronous error is pending (destroy
    /// would wait for operations that cannot finish).
    ~State() {
      if (!comm) return;
      ncclResult_t r = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &r) != ncclSuccess || (r != ncclSuccess && r != ncclInProgress))
        (void)ncclCommAbort(comm);
      else
        (void)ncclCommDestroy(comm);
    }
    void abort() noexcept {
      if (comm) (void)ncclCommAbort(comm);
      comm = nullptr;
    }
    /// An asynchronous NCCL error aborts the communicator and throws CommError.
    void check_async_error() {
      DSP_CHECK_AS(CommError, comm, "NCCL communicator of rank ", rank, " was aborted");
      ncclResult_t r = ncclSuccess;
      DSP_NCCL_CHECK(comm, ncclCommGetAsyncError(comm, &r));
      if (r == ncclSuccess || r == ncclInProgress) return;
      const std::string message = dsp::detail::concat("NCCL asynchronous error on rank ", rank, ": ",
                                                      ncclGetErrorString(r), " (", ncclGetLastError(comm), ")");
      abort();
      throw CommError(message);
    }
  };

  explicit NcclComm(backend::Cuda compute) : state_(std::make_shared<State>()), compute_(compute.stream) {}

  /// The NCCL communicator; throws CommError naming op when there is none.
  ncclComm_t checked(const char* op) const {
    DSP_CHECK_AS(CommError, valid(), op, ": the communicator is empty (moved-from, aborted or not created)");
    return state_->comm;
  }

  void check_blocks(const char* op, std::size_t whole, std::size_t block) const {
    DSP_CHECK_AS(CommError, whole == block * std::size_t(size_), op, ": ", whole, " elements are not ", size_,
                 " blocks of ", block);
  }

  /// Whether p is host memory (pageable or pinned); null (an empty span) is not.
  static bool host_memory(const void* p) { return p && !backend::device_pointer(p); }
  /// Throws CommError naming op when a buffer is host memory (the asynchronous forms).
  static void device_only(const char* op, const void* a, const void* b = nullptr) {
    DSP_CHECK_AS(CommError, !host_memory(a) && !host_memory(b), "NcclComm ", op,
                 "_async: a buffer is host memory; NCCL reads device memory (the blocking form stages host memory)");
  }

  /// Blocks the host until `done` completed, polling NCCL's asynchronous errors (a peer that
  /// failed: CommError); past default_timeout() (DSP_COMM_TIMEOUT_S) aborts the communicator
  /// and throws TimeoutError naming op.
  void wait_host(const char* op, const backend::Event& done) {
    const auto deadline = std::chrono::steady_clock::now() + default_timeout();
    while (!done.query()) {
      state_->check_async_error();
      if (std::chrono::steady_clock::now() > deadline) {
        state_->abort();
        throw TimeoutError(dsp::detail::concat("NcclComm ", op, ": rank ", rank(), " waited more than ",
                                               std::chrono::duration<double>(default_timeout()).count(),
                                               " s for its peers; communicator aborted"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    state_->check_async_error();
  }

  /// A span as NCCL can take it in a blocking operation: the span itself in device memory, or a
  /// device copy of host memory (Communication) filled on the compute stream; finish(), after
  /// the operation's wait(), copies the copy back (unless T is const) and waits for the
  /// compute stream (wait_host).
  template <class T>
  class DeviceView {
   public:
    DeviceView(std::span<T> s, NcclComm& comm) : host_(s), view_(s), comm_(comm) {
      if (!host_memory(s.data())) return;
      copy_ = backend::DeviceBuffer<std::remove_const_t<T>>(backend::Cuda{comm.compute_}, s.size(),
                                                            memory::Category::Communication);
      DSP_CUDA_CHECK(
          cudaMemcpyAsync(copy_.data(), s.data(), s.size_bytes(), cudaMemcpyHostToDevice, comm.compute_));
      view_ = std::span<T>(copy_.data(), s.size());
    }
    std::span<T> span() const { return view_; }
    void finish() {
      if (!copy_.data()) return;
      if constexpr (!std::is_const_v<T>)
        DSP_CUDA_CHECK(cudaMemcpyAsync(host_.data(), copy_.data(), host_.size_bytes(), cudaMemcpyDeviceToHost,
                                       comm_.compute_));
      backend::Event done(false);
      done.record(backend::Cuda{comm_.compute_});
      comm_.wait_host("a blocking operation on host memory", done);
    }

   private:
    std::span<T> host_, view_;
    NcclComm& comm_;
    backend::DeviceBuffer<std::remove_const_t<T>> copy_;
  };

  /// The communication stream's next work waits for the compute stream's work so far.
  void order_after_compute() {
    backend::Event ready(false);
    ready.record(backend::Cuda{compute_});
    ready.wait(state_->stream.backend());
  }

  /// Enqueues issue(comm stream) after the compute stream's work so far; the Work's wait makes
  /// the compute stream's later work wait for it.
  template <class Issue>
  Work enqueue(const char* op, Issue&& issue) {
    checked(op);
    order_after_compute();
    issue(state_->stream.get());
    auto done = std::make_shared<backend::Event>(false);
    done->record(state_->stream.backend());
    return Work(
        [state = state_, done, compute = compute_] {
          state->check_async_error();
          done->wait(backend::Cuda{compute});
        },
        [state = state_, done] {
          state->check_async_error();
          return done->query();
        },
        op);
  }

  std::shared_ptr<State> state_;
  cudaStream_t compute_ = nullptr;
  int size_ = 0;
};

}  // namespace dsp::comm
