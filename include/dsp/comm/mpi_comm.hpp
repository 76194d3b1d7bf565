#pragma once
// MpiComm: the Communicator over MPI, one rank per process (written against OpenMPI 4.1 from
// Debian; MPI-3 calls only). Start the program with mpiexec and enter it through
// comm::mpi_launch (dsp/comm/mpi_launch.hpp), which initialises MPI.
//
// Who calls what (as ThreadComm): every collective must be called by all ranks of the
// communicator in the same order with matching sizes; the blocking forms block the calling
// host thread until this rank's part is complete; the result is on every rank unless stated
// otherwise. The `*_async` forms are MPI nonblocking operations (MPI_Iallreduce, ...): they
// return a Work at once and may be mixed with blocking calls (MPI orders collectives by issue).
//
// Where it differs from ThreadComm (all because of MPI):
//  - Reduction order is MPI's choice (OpenMPI picks an algorithm by size), so with more than
//    two ranks fp32 sums may differ from ThreadComm's in the last bits.
//  - Sizes that disagree between ranks are not detected by all_reduce, reduce_scatter,
//    all_gather and broadcast (checking would cost a second collective per call); OpenMPI
//    usually fails with MPI_ERR_TRUNCATE, but it is undefined. all_to_all_v exchanges the
//    counts first and throws CommError on every rank, as ThreadComm does.
//  - No collective timeout: a rank that dies ends the job through mpiexec; a rank that hangs
//    holds up its peers (bound a job with `mpiexec --timeout SECONDS`).
//  - Asynchronous operations progress only while this process is inside MPI (Work::wait,
//    Work::completed, or any other MPI call, blocking collectives on other communicators
//    included); there is no progress thread.
//  - split_async splits at once (MPI-3 has no nonblocking split) and returns a complete Work.
//  - A Work dropped before completion: the operation still completes (MpiRuntime waits for it
//    before MPI_Finalize), but its post-processing (the bf16/fp16 write-back, the receive size
//    check) does not run; call wait().
// Threads: MPI runs at MPI_THREAD_FUNNELED (MpiRuntime), so call MpiComm and wait on its Work
// only from the thread that initialised MPI.
// 16-bit floats (bf16, fp16): MPI has no such types. Reductions widen into an fp32 scratch
// buffer, reduce it with MPI_FLOAT and round once to the 16-bit type (as ThreadComm: fp32
// accumulation); the other operations move them as raw 2-byte elements.
// Sizes: MPI counts are int. An operation whose count (elements; bytes for element types that
// are not 1, 2, 4 or 8 bytes wide) or whole buffer exceeds INT_MAX throws CommError.
// Errors: every communicator has MPI_ERRORS_RETURN; a failing MPI call throws CommError with
// MPI_Error_string's text (DSP_MPI_CHECK).
// Trace (dsp/core/trace.hpp): every call is a comm span on the calling thread named as
// ThreadComm's ("all_reduce", ..., "send", "recv", "split"; args {"bytes": payload bytes}).
// A blocking call's span covers the whole operation. With no progress thread, an `*_async`
// operation advances only inside MPI calls, so its time shows where MPI spends it: the span
// of the issuing call, and the idle span "wait:<op>" of a Work::wait that blocks.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // the C API only (no MPI C++ bindings library to link)
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "dsp/comm/reduce_op.hpp"
#include "dsp/comm/work.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/trace.hpp"

namespace dsp::comm::detail {

/// "MPI_Xxx failed: <MPI_Error_string of code>", naming the function of the call text.
inline std::string mpi_error_message(std::string_view call, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  const std::string_view function = call.substr(0, call.find('('));
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS)
    return ::dsp::detail::concat(function, " failed with MPI error code ", code);
  return ::dsp::detail::concat(function, " failed: ", std::string_view(text, static_cast<std::size_t>(len)));
}

}  // namespace dsp::comm::detail

/// Runs an MPI call; throws dsp::CommError("MPI_Xxx failed: <MPI's error text>") unless it
/// returned MPI_SUCCESS. Needs MPI_ERRORS_RETURN on the communicator (MpiComm sets it).
#define DSP_MPI_CHECK(call)                                                                    \
  do {                                                                                         \
    const int dsp_mpi_rc_ = (call);                                                            \
    if (dsp_mpi_rc_ != MPI_SUCCESS)                                                            \
      throw ::dsp::CommError(::dsp::comm::detail::mpi_error_message(#call, dsp_mpi_rc_));      \
  } while (0)

namespace dsp::comm {

namespace detail {

inline bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

/// An element count as MPI's int; throws CommError when it exceeds INT_MAX.
inline int mpi_count(std::size_t n, const char* op) {
  DSP_CHECK_AS(CommError, n <= static_cast<std::size_t>(INT_MAX), op, ": ", n,
               " elements exceed MPI's int count limit ", INT_MAX, "; split the operation");
  return static_cast<int>(n);
}

/// How elements of T travel when they are only moved: a fixed-width MPI type for 1, 2, 4 and
/// 8-byte T (`per_element` 1), otherwise MPI_BYTE with `per_element` = sizeof(T).
struct RawType {
  MPI_Datatype type;
  std::size_t per_element;
};
template <class T>
RawType raw_type() {
  static_assert(std::is_trivially_copyable_v<T>, "MpiComm moves elements as bytes: T must be trivially copyable");
  if constexpr (sizeof(T) == 1) return {MPI_BYTE, 1};
  else if constexpr (sizeof(T) == 2) return {MPI_UINT16_T, 1};
  else if constexpr (sizeof(T) == 4) return {MPI_UINT32_T, 1};
  else if constexpr (sizeof(T) == 8) return {MPI_UINT64_T, 1};
  else return {MPI_BYTE, sizeof(T)};
}

/// 16-bit floats that reductions accumulate in fp32 (bf16, fp16: to_accum gives float).
template <class T>
concept HalfFloat = !std::same_as<T, float> && requires(T v) {
  { to_accum(v) } -> std::same_as<float>;
};
/// Types MPI reduces natively.
template <class T>
concept MpiReducible = std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, std::int32_t> ||
                       std::same_as<T, std::int64_t>;

template <MpiReducible T>
MPI_Datatype reduce_type() {
  if constexpr (std::same_as<T, float>) return MPI_FLOAT;
  else if constexpr (std::same_as<T, double>) return MPI_DOUBLE;
  else if constexpr (std::same_as<T, std::int32_t>) return MPI_INT32_T;
  else return MPI_INT64_T;
}
inline MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return MPI_SUM;
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
  }
  throw CommError("unknown ReduceOp");
}

template <class T>
std::vector<float> widen(std::span<const T> x) {
  std::vector<float> out(x.size());
  std::transform(x.begin(), x.end(), out.begin(), [](T v) { return to_accum(v); });
  return out;
}
template <class T>
void narrow(const std::vector<float>& acc, std::span<T> out) {
  std::transform(acc.begin(), acc.end(), out.begin(), [](float v) { return from_accum<T>(v); });
}

template <class T>
bool overlaps(std::span<const T> a, std::span<const T> b) {
  if (a.empty() || b.empty()) return false;
  const std::less<const T*> lt;
  return lt(a.data(), b.data() + b.size()) && lt(b.data(), a.data() + a.size());
}

/// Requests nobody waits for any more (dropped Works, buffered sends), each with the buffers
/// it reads or writes, which live until it completed. One per process; used only from the
/// thread that initialised MPI (MPI_THREAD_FUNNELED).
class Inflight {
 public:
  static Inflight& get() {
    static Inflight inflight;
    return inflight;
  }
  /// Takes over `request` and `keep` until the request completed.
  void adopt(MPI_Request request, std::shared_ptr<void> keep) {
    requests_.push_back(request);
    keeps_.push_back(std::move(keep));
    reap();
  }
  /// Releases the buffers of completed requests; never blocks. A request that failed is
  /// reported by the next drain().
  void reap() noexcept {
    for (std::size_t i = 0; i < requests_.size();) {
      int done = 0;
      const int rc = MPI_Test(&requests_[i], &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS && error_.empty()) error_ = mpi_error_message("MPI_Test", rc);
      if (done || rc != MPI_SUCCESS) {
        requests_[i] = requests_.back();
        requests_.pop_back();
        keeps_[i] = std::move(keeps_.back());
        keeps_.pop_back();
      } else {
        ++i;
      }
    }
  }
  /// Waits for every adopted request (as MPI_Finalize requires); throws CommError for the
  /// first one that failed.
  void drain() {
    const int rc = MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
    requests_.clear();
    keeps_.clear();
    if (rc != MPI_SUCCESS && error_.empty()) error_ = mpi_error_message("MPI_Waitall", rc);
    if (!error_.empty()) throw CommError(std::exchange(error_, {}));
  }
  /// Adopted requests not yet seen complete.
  std::size_t size() const { return requests_.size(); }

 private:
  std::vector<MPI_Request> requests_;
  std::vector<std::shared_ptr<void>> keeps_;
  std::string error_;
};

/// One nonblocking MPI operation behind a Work: its request, the buffers it uses, and what
/// to do once it completed. Destroyed while still pending (the Work was dropped), it hands
/// the request and buffers to Inflight.
struct PendingOp {
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Status status{};
  std::shared_ptr<void> keep;
  std::function<void(const MPI_Status&)> finish;

  PendingOp() = default;
  PendingOp(const PendingOp&) = delete;
  PendingOp& operator=(const PendingOp&) = delete;
  ~PendingOp() {
    if (request != MPI_REQUEST_NULL && !mpi_finalized()) Inflight::get().adopt(request, std::move(keep));
  }
};

/// The Work of `op`; name: the API call (a string literal) that names its wait's trace span.
inline Work make_work(std::shared_ptr<PendingOp> op, const char* name) {
  return Work(
      [op] {
        if (op->request != MPI_REQUEST_NULL) DSP_MPI_CHECK(MPI_Wait(&op->request, &op->status));
        if (op->finish) op->finish(op->status);
      },
      [op] {
        int done = 0;
        DSP_MPI_CHECK(MPI_Test(&op->request, &done, &op->status));
        return done != 0;
      },
      name);
}

/// A Work that already completed with the current exception.
inline Work failed_work() {
  auto state = std::make_shared<Work::State>();
  state->finish(std::current_exception());
  return Work(state);
}

}  // namespace detail

class MpiComm {
 public:
  /// An empty communicator (valid() is false): a target for split_async, or moved-from.
  MpiComm() = default;
  MpiComm(MpiComm&& o) noexcept
      : comm_(std::exchange(o.comm_, MPI_COMM_NULL)),
        owned_(std::exchange(o.owned_, false)),
        rank_(std::exchange(o.rank_, 0)),
        size_(std::exchange(o.size_, 0)) {}
  MpiComm& operator=(MpiComm&& o) noexcept {
    if (this != &o) {
      release();
      comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
      owned_ = std::exchange(o.owned_, false);
      rank_ = std::exchange(o.rank_, 0);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;
  /// Frees a communicator made by split (MPI_Comm_free); MPI_COMM_WORLD is never freed.
  ~MpiComm() { release(); }

  /// MPI_COMM_WORLD (not owned), switched to MPI_ERRORS_RETURN. MPI must be initialised
  /// (comm::MpiRuntime or mpi_launch); throws CommError otherwise.
  static MpiComm world() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    DSP_CHECK_AS(CommError, initialized && !detail::mpi_finalized(), "MpiComm::world: MPI is not initialised");
    return MpiComm(MPI_COMM_WORLD, /*owned=*/false);
  }

  /// This rank's index in [0, size()).
  int rank() const { return rank_; }
  /// Number of ranks in this communicator.
  int size() const { return size_; }
  bool valid() const { return comm_ != MPI_COMM_NULL; }
  /// The MPI communicator, for calls dsp does not wrap; stays owned by this object.
  MPI_Comm native() const { return comm_; }

  /// In-place element-wise reduction of `data` over all ranks; every rank gets the result.
  /// float, double, int32_t, int64_t natively; bf16/fp16 accumulated in fp32 and rounded once.
  /// Throws CommError when MPI fails or data.size() > INT_MAX.
  template <class T>
  void all_reduce(std::span<T> data, ReduceOp op = ReduceOp::Sum) {
    check_reducible<T>();
    require_valid();
    const auto traced = trace_span("all_reduce", data.size_bytes());
    const int n = detail::mpi_count(data.size(), "all_reduce");
    if constexpr (detail::HalfFloat<T>) {
      auto acc = detail::widen(std::span<const T>(data));
      DSP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, acc.data(), n, MPI_FLOAT, detail::mpi_op(op), comm_));
      detail::narrow(acc, data);
    } else {
      DSP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data.data(), n, detail::reduce_type<T>(), detail::mpi_op(op), comm_));
    }
  }
  /// As all_reduce (MPI_Iallreduce); errors are rethrown by the Work.
  template <class T>
  Work all_reduce_async(std::span<T> data, ReduceOp op = ReduceOp::Sum) {
    check_reducible<T>();
    require_valid();
    const auto traced = trace_span("all_reduce", data.size_bytes());
    try {
      const int n = detail::mpi_count(data.size(), "all_reduce");
      auto p = std::make_shared<detail::PendingOp>();
      if constexpr (detail::HalfFloat<T>) {
        auto acc = std::make_shared<std::vector<float>>(detail::widen(std::span<const T>(data)));
        p->keep = acc;
        DSP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, acc->data(), n, MPI_FLOAT, detail::mpi_op(op), comm_, &p->request));
        p->finish = [acc, data](const MPI_Status&) { detail::narrow(*acc, data); };
      } else {
        DSP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data.data(), n, detail::reduce_type<T>(), detail::mpi_op(op), comm_,
                                     &p->request));
      }
      return detail::make_work(std::move(p), "all_reduce");
    } catch (...) {
      return detail::failed_work();
    }
  }

  /// out[i] = reduce over ranks q of in_q[rank*out.size() + i]; in.size() == size()*out.size()
  /// (CommError otherwise, or when that exceeds INT_MAX). `out` may overlap `in`.
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::Sum) {
    const auto traced = trace_span("reduce_scatter", in.size_bytes());
    post_reduce_scatter(in, out, op, nullptr);
  }
  /// As reduce_scatter (MPI_Ireduce_scatter_block); errors are rethrown by the Work.
  template <class T>
  Work reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::Sum) {
    check_reducible<T>();
    require_valid();
    const auto traced = trace_span("reduce_scatter", in.size_bytes());
    try {
      auto p = std::make_shared<detail::PendingOp>();
      post_reduce_scatter(in, out, op, p.get());
      return detail::make_work(std::move(p), "reduce_scatter");
    } catch (...) {
      return detail::failed_work();
    }
  }

  /// out[q*in.size() + i] = in_q[i]; out.size() == size()*in.size() (CommError otherwise, or
  /// when that exceeds INT_MAX). `in` may alias its own block of `out` (or overlap it anyhow).
  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    const auto traced = trace_span("all_gather", out.size_bytes());
    post_all_gather(in, out, nullptr);
  }
  /// As all_gather (MPI_Iallgather); errors are rethrown by the Work.
  template <class T>
  Work all_gather_async(std::span<const T> in, std::span<T> out) {
    require_valid();
    const auto traced = trace_span("all_gather", out.size_bytes());
    try {
      auto p = std::make_shared<detail::PendingOp>();
      post_all_gather(in, out, p.get());
      return detail::make_work(std::move(p), "all_gather");
    } catch (...) {
      return detail::failed_work();
    }
  }

  /// Copies root's `data` into every other rank's `data`. CommError for a root outside
  /// [0, size()).
  template <class T>
  void broadcast(std::span<T> data, int root) {
    const auto traced = trace_span("broadcast", data.size_bytes());
    post_broadcast(data, root, nullptr);
  }
  /// As broadcast (MPI_Ibcast); errors are rethrown by the Work.
  template <class T>
  Work broadcast_async(std::span<T> data, int root) {
    require_valid();
    const auto traced = trace_span("broadcast", data.size_bytes());
    try {
      auto p = std::make_shared<detail::PendingOp>();
      post_broadcast(data, root, p.get());
      return detail::make_work(std::move(p), "broadcast");
    } catch (...) {
      return detail::failed_work();
    }
  }

  /// Sends data to rank dst. Buffered as ThreadComm's: copies the data, posts MPI_Isend on the
  /// copy and returns at once, so it never waits for the receiver (the copy is freed once MPI
  /// completed the send; MpiRuntime waits for unfinished sends before MPI_Finalize, so every
  /// send must be received). Matched, in order, by recv(src = rank(), tag) on dst.
  /// CommError for dst == rank() or outside [0, size()), or a tag outside [0, MPI_TAG_UB].
  template <class T>
  void send(std::span<const T> data, int dst, int tag = 0) {
    require_valid();
    DSP_CHECK_AS(CommError, dst >= 0 && dst < size_ && dst != rank_, "send: bad destination rank ", dst);
    check_tag(tag, "send");
    const auto traced = trace_span("send", data.size_bytes());
    const auto raw = detail::raw_type<T>();
    const int n = detail::mpi_count(data.size() * raw.per_element, "send");
    auto copy = std::make_shared<std::vector<T>>(data.begin(), data.end());
    MPI_Request request = MPI_REQUEST_NULL;
    DSP_MPI_CHECK(MPI_Isend(copy->data(), n, raw.type, dst, tag, comm_, &request));
    detail::Inflight::get().adopt(request, std::move(copy));
  }
  /// As send; the returned Work is already complete (it carries send's error, if any).
  template <class T>
  Work send_async(std::span<const T> data, int dst, int tag = 0) {
    try {
      send(data, dst, tag);
      return Work();
    } catch (...) {
      return detail::failed_work();
    }
  }
  /// Receives exactly data.size() elements from rank src; CommError when the sizes differ
  /// (a longer message fails with MPI_ERR_TRUNCATE). Receives from one source and tag match
  /// sends in order and are independent of collectives.
  template <class T>
  void recv(std::span<T> data, int src, int tag = 0) {
    require_valid();
    check_peer(src, tag);
    const auto traced = trace_span("recv", data.size_bytes());
    const auto raw = detail::raw_type<T>();
    const int n = detail::mpi_count(data.size() * raw.per_element, "recv");
    MPI_Status status;
    DSP_MPI_CHECK(MPI_Recv(data.data(), n, raw.type, src, tag, comm_, &status));
    check_received(status, raw.type, n, src);
  }
  /// As recv (MPI_Irecv); errors are rethrown by the Work.
  template <class T>
  Work recv_async(std::span<T> data, int src, int tag = 0) {
    require_valid();
    const auto traced = trace_span("recv", data.size_bytes());
    try {
      check_peer(src, tag);
      const auto raw = detail::raw_type<T>();
      const int n = detail::mpi_count(data.size() * raw.per_element, "recv");
      auto p = std::make_shared<detail::PendingOp>();
      DSP_MPI_CHECK(MPI_Irecv(data.data(), n, raw.type, src, tag, comm_, &p->request));
      p->finish = [type = raw.type, n, src](const MPI_Status& s) { check_received(s, type, n, src); };
      return detail::make_work(std::move(p), "recv");
    } catch (...) {
      return detail::failed_work();
    }
  }

  /// Personalised exchange: this rank sends send_counts[q] elements (consecutive in `in`, in
  /// rank order) to rank q and receives recv_counts[q] elements from rank q into `out` (in
  /// rank order). Zero counts are allowed. The counts are exchanged first (MPI_Alltoall plus a
  /// one-int MPI_Allreduce), so a peer's send count that does not match this rank's recv count
  /// throws the same CommError on every rank. CommError also for counts or offsets > INT_MAX.
  template <class T>
  void all_to_all_v(std::span<const T> in, std::vector<std::int64_t> send_counts, std::span<T> out,
                    std::vector<std::int64_t> recv_counts) {
    require_valid();
    const auto traced = trace_span("all_to_all_v", in.size_bytes());
    const auto raw = detail::raw_type<T>();
    auto c = exchange_counts(in.size(), send_counts, out.size(), recv_counts, raw.per_element);
    DSP_MPI_CHECK(MPI_Alltoallv(in.data(), c.send_counts.data(), c.send_displs.data(), raw.type, out.data(),
                                c.recv_counts.data(), c.recv_displs.data(), raw.type, comm_));
  }
  /// As all_to_all_v: the count exchange blocks, the data moves with MPI_Ialltoallv. Errors
  /// are rethrown by the Work.
  template <class T>
  Work all_to_all_v_async(std::span<const T> in, std::vector<std::int64_t> send_counts, std::span<T> out,
                          std::vector<std::int64_t> recv_counts) {
    require_valid();
    const auto traced = trace_span("all_to_all_v", in.size_bytes());
    try {
      const auto raw = detail::raw_type<T>();
      auto c = std::make_shared<IntCounts>(
          exchange_counts(in.size(), send_counts, out.size(), recv_counts, raw.per_element));
      auto p = std::make_shared<detail::PendingOp>();
      p->keep = c;  // MPI reads the count arrays until completion
      DSP_MPI_CHECK(MPI_Ialltoallv(in.data(), c->send_counts.data(), c->send_displs.data(), raw.type, out.data(),
                                   c->recv_counts.data(), c->recv_displs.data(), raw.type, comm_, &p->request));
      return detail::make_work(std::move(p), "all_to_all_v");
    } catch (...) {
      return detail::failed_work();
    }
  }

  /// Returns when every rank called barrier.
  void barrier() {
    require_valid();
    const auto traced = trace_span("barrier", 0);
    DSP_MPI_CHECK(MPI_Barrier(comm_));
  }
  /// As barrier (MPI_Ibarrier).
  Work barrier_async() {
    require_valid();
    const auto traced = trace_span("barrier", 0);
    try {
      auto p = std::make_shared<detail::PendingOp>();
      DSP_MPI_CHECK(MPI_Ibarrier(comm_, &p->request));
      return detail::make_work(std::move(p), "barrier");
    } catch (...) {
      return detail::failed_work();
    }
  }

  /// Collective: ranks with the same colour (>= 0, else CommError) form a new communicator,
  /// ordered by (key, old rank) (MPI_Comm_split). The result owns it and frees it when
  /// destroyed.
  MpiComm split(int color, int key) {
    require_valid();
    DSP_CHECK_AS(CommError, color >= 0, "split: colour must be >= 0, got ", color);
    const auto traced = trace_span("split", 0);
    MPI_Comm c = MPI_COMM_NULL;
    DSP_MPI_CHECK(MPI_Comm_split(comm_, color, key, &c));
    return MpiComm(c, /*owned=*/true);
  }
  /// As split, done at once (MPI-3 has no nonblocking split): `out` is assigned before this
  /// returns and the Work is complete (it carries the split's error, if any).
  Work split_async(int color, int key, MpiComm& out) {
    DSP_CHECK_AS(CommError, color >= 0, "split: colour must be >= 0, got ", color);
    try {
      out = split(color, key);
      return Work();
    } catch (...) {
      return detail::failed_work();
    }
  }

 private:
  MpiComm(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
    DSP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    DSP_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    DSP_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }
  void release() noexcept {
    if (owned_ && comm_ != MPI_COMM_NULL && !detail::mpi_finalized()) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
    owned_ = false;
  }
  void require_valid() const { DSP_CHECK_AS(CommError, valid(), "use of an empty MpiComm"); }
  // The comm trace span of one call on the calling thread; bytes: its payload.
  static trace::Span trace_span(const char* op, std::size_t bytes) {
    return trace::Span(op, trace::Kind::Comm, {{"bytes", static_cast<std::int64_t>(bytes)}});
  }

  template <class T>
  static constexpr void check_reducible() {
    static_assert(detail::MpiReducible<T> || detail::HalfFloat<T>,
                  "MpiComm reduces float, double, int32_t and int64_t, and bf16/fp16 in fp32");
  }
  static void check_tag(int tag, const char* op) {
    int* tag_ub = nullptr;
    int found = 0;
    DSP_MPI_CHECK(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found));
    DSP_CHECK_AS(CommError, tag >= 0 && (!found || tag <= *tag_ub), op, ": tag ", tag, " outside [0, ",
                 found ? *tag_ub : INT_MAX, "]");
  }
  void check_peer(int src, int tag) const {
    DSP_CHECK_AS(CommError, src >= 0 && src < size_ && src != rank_, "recv: bad source rank ", src);
    check_tag(tag, "recv");
  }
  static void check_received(const MPI_Status& status, MPI_Datatype type, int expected, int src) {
    int got = 0;
    DSP_MPI_CHECK(MPI_Get_count(&status, type, &got));
    DSP_CHECK_AS(CommError, got == expected, "recv: rank ", src, " sent ", got, " elements, expected ", expected);
  }

  // Blocking when p is null, else posts the nonblocking form into p.
  template <class T>
  void post_reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op, detail::PendingOp* p) {
    check_reducible<T>();
    require_valid();
    DSP_CHECK_AS(CommError, in.size() == out.size() * static_cast<std::size_t>(size_), "reduce_scatter: input has ",
                 in.size(), " elements, expected ", size_, " x ", out.size());
    detail::mpi_count(in.size(), "reduce_scatter");
    const int n = detail::mpi_count(out.size(), "reduce_scatter");
    const MPI_Op mop = detail::mpi_op(op);
    if constexpr (detail::HalfFloat<T>) {
      auto acc = std::make_shared<std::pair<std::vector<float>, std::vector<float>>>(detail::widen(in),
                                                                                     std::vector<float>(out.size()));
      if (!p) {
        DSP_MPI_CHECK(MPI_Reduce_scatter_block(acc->first.data(), acc->second.data(), n, MPI_FLOAT, mop, comm_));
        return detail::narrow(acc->second, out);
      }
      p->keep = acc;
      DSP_MPI_CHECK(MPI_Ireduce_scatter_block(acc->first.data(), acc->second.data(), n, MPI_FLOAT, mop, comm_, &p->request));
      p->finish = [acc, out](const MPI_Status&) { detail::narrow(acc->second, out); };
    } else {
      const T* send = in.data();
      std::shared_ptr<std::vector<T>> copy;  // MPI forbids overlapping send and receive buffers
      if (detail::overlaps(in, std::span<const T>(out))) {
        copy = std::make_shared<std::vector<T>>(in.begin(), in.end());
        send = copy->data();
      }
      const MPI_Datatype type = detail::reduce_type<T>();
      if (!p) {
        DSP_MPI_CHECK(MPI_Reduce_scatter_block(send, out.data(), n, type, mop, comm_));
        return;
      }
      p->keep = copy;
      DSP_MPI_CHECK(MPI_Ireduce_scatter_block(send, out.data(), n, type, mop, comm_, &p->request));
    }
  }

  template <class T>
  void post_all_gather(std::span<const T> in, std::span<T> out, detail::PendingOp* p) {
    require_valid();
    DSP_CHECK_AS(CommError, out.size() == in.size() * static_cast<std::size_t>(size_), "all_gather: output has ",
                 out.size(), " elements, expected ", size_, " x ", in.size());
    const auto raw = detail::raw_type<T>();
    detail::mpi_count(out.size() * raw.per_element, "all_gather");
    const int n = detail::mpi_count(in.size() * raw.per_element, "all_gather");
    const void* send = in.data();
    std::shared_ptr<std::vector<T>> copy;
    if (!in.empty() && in.data() == out.data() + in.size() * static_cast<std::size_t>(rank_)) {
      send = MPI_IN_PLACE;  // already in its block
    } else if (detail::overlaps(in, std::span<const T>(out))) {
      copy = std::make_shared<std::vector<T>>(in.begin(), in.end());
      send = copy->data();
    }
    if (!p) {
      DSP_MPI_CHECK(MPI_Allgather(send, n, raw.type, out.data(), n, raw.type, comm_));
      return;
    }
    p->keep = copy;
    DSP_MPI_CHECK(MPI_Iallgather(send, n, raw.type, out.data(), n, raw.type, comm_, &p->request));
  }

  template <class T>
  void post_broadcast(std::span<T> data, int root, detail::PendingOp* p) {
    require_valid();
    DSP_CHECK_AS(CommError, root >= 0 && root < size_, "broadcast: root ", root, " outside [0, ", size_, ")");
    const auto raw = detail::raw_type<T>();
    const int n = detail::mpi_count(data.size() * raw.per_element, "broadcast");
    if (!p) {
      DSP_MPI_CHECK(MPI_Bcast(data.data(), n, raw.type, root, comm_));
      return;
    }
    DSP_MPI_CHECK(MPI_Ibcast(data.data(), n, raw.type, root, comm_, &p->request));
  }

  struct IntCounts {
    std::vector<int> send_counts, send_displs, recv_counts, recv_displs;
  };
  // Local checks, then the count exchange; returns MPI's int counts and displacements (in
  // raw elements) or throws CommError, on every rank when the ranks' counts disagree.
  IntCounts exchange_counts(std::size_t in_size, const std::vector<std::int64_t>& send_counts, std::size_t out_size,
                            const std::vector<std::int64_t>& recv_counts, std::size_t per_element) {
    const int p = size_;
    DSP_CHECK_AS(CommError, static_cast<int>(send_counts.size()) == p && static_cast<int>(recv_counts.size()) == p,
                 "all_to_all_v: counts must have one entry per rank (", p, ")");
    auto negative = [](std::int64_t n) { return n < 0; };
    DSP_CHECK_AS(CommError, std::none_of(send_counts.begin(), send_counts.end(), negative) &&
                                std::none_of(recv_counts.begin(), recv_counts.end(), negative),
                 "all_to_all_v: negative count");
    DSP_CHECK_AS(CommError, std::accumulate(send_counts.begin(), send_counts.end(), std::int64_t{0}) ==
                                static_cast<std::int64_t>(in_size),
                 "all_to_all_v: send counts do not sum to the input size ", in_size);
    DSP_CHECK_AS(CommError, std::accumulate(recv_counts.begin(), recv_counts.end(), std::int64_t{0}) ==
                                static_cast<std::int64_t>(out_size),
                 "all_to_all_v: recv counts do not sum to the output size ", out_size);
    std::vector<std::int64_t> incoming(static_cast<std::size_t>(p));  // incoming[q]: what rank q sends here
    DSP_MPI_CHECK(MPI_Alltoall(send_counts.data(), 1, MPI_INT64_T, incoming.data(), 1, MPI_INT64_T, comm_));
    int finder = INT_MAX;  // lowest rank that sees a mismatch
    std::int64_t found[4] = {0, 0, 0, 0};  // src, dst, sent, expected
    for (int q = 0; q < p; ++q)
      if (incoming[static_cast<std::size_t>(q)] != recv_counts[static_cast<std::size_t>(q)]) {
        finder = rank_;
        found[0] = q;
        found[1] = rank_;
        found[2] = incoming[static_cast<std::size_t>(q)];
        found[3] = recv_counts[static_cast<std::size_t>(q)];
        break;
      }
    DSP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &finder, 1, MPI_INT, MPI_MIN, comm_));
    if (finder != INT_MAX) {
      DSP_MPI_CHECK(MPI_Bcast(found, 4, MPI_INT64_T, finder, comm_));
      throw CommError(::dsp::detail::concat("all_to_all_v: rank ", found[0], " sends ", found[2], " elements to rank ",
                                            found[1], ", which expects ", found[3]));
    }
    IntCounts c;
    auto to_int = [&](const std::vector<std::int64_t>& counts, std::vector<int>& out, std::vector<int>& displs) {
      std::size_t offset = 0;
      for (std::int64_t n : counts) {
        displs.push_back(detail::mpi_count(offset * per_element, "all_to_all_v"));
        out.push_back(detail::mpi_count(static_cast<std::size_t>(n) * per_element, "all_to_all_v"));
        offset += static_cast<std::size_t>(n);
      }
    };
    to_int(send_counts, c.send_counts, c.send_displs);
    to_int(recv_counts, c.recv_counts, c.recv_displs);
    return c;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  bool owned_ = false;
  int rank_ = 0;
  int size_ = 0;
};

}  // namespace dsp::comm
