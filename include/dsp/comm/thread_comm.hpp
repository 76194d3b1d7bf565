#pragma once
// ThreadComm: ranks are threads of one process sharing memory (the embedded default
// communicator). Collectives meet at a barrier (detail/group.hpp: yield, then sleep) that also
// exchanges buffer pointers, and then ranks read (and for all_reduce write) each other's
// buffers directly. Two algorithms per collective:
//  - eager, for messages up to Group::kStagingBytes (8 KiB): each rank copies its input into
//    its staging buffer before the barrier and reads the peers' staging buffers after it; as no
//    rank touches a peer's own buffer, one barrier is the whole synchronisation (small
//    collectives are all latency);
//  - direct, for larger ones: all_reduce is the traffic-optimal two-shot algorithm with the
//    all-gather fused in, chunk by chunk: a chunk is read from all n buffers, reduced and written
//    into every buffer (each buffer read once and written once: 2 n size bytes, the
//    memory-bandwidth minimum); rank r owns 1/n of the chunks, and ranks that finish early
//    take over the rest of slower ranks' (work stealing); then a second barrier.
//    reduce_scatter reduces this rank's block straight into `out`; all_gather copies the
//    peers' blocks (pull; large outputs with non-temporal stores, detail/streaming_copy.hpp).
// The reduction order over ranks is fixed (rank 0, 1, ..., n-1, accumulating bf16/fp16 in fp32
// and rounding once), so every rank gets bit-identical results whatever the path.
//
// Who calls what (CUB style): every collective must be called by all ranks of the
// communicator in the same order with matching sizes; it blocks the calling host thread
// until this rank's part is complete; the result is on every rank unless stated otherwise.
// The `*_async` forms return a Work at once and run on this rank's communication thread
// (collectives in issue order, so sync and async calls can be mixed; receives on a thread of
// their own; sends are buffered and complete at once).
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dsp/comm/detail/group.hpp"
#include "dsp/comm/detail/streaming_copy.hpp"
#include "dsp/comm/detail/worker.hpp"
#include "dsp/comm/reduce_op.hpp"
#include "dsp/comm/work.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/trace.hpp"

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
///
/// Every collective starts with post(): the rank writes its Slot (and, on the eager path, a copy
/// of its input into its staging buffer) for barrier instance `gen`, meets every rank, and
/// checks the op codes and arguments. Slots and staging buffers of instance gen are read only
/// before this rank arrives at instance gen + 1 (see Group::slot), and peers' payload buffers
/// only before the collective's last barrier, after which the caller owns them again.
// Element types as the collectives check them: every rank must pass the same one.
template <class T>
constexpr std::int64_t type_code() {
  if constexpr (std::is_same_v<T, float>) return 1;
  else if constexpr (std::is_same_v<T, double>) return 2;
  else if constexpr (std::is_same_v<T, bf16>) return 3;
  else if constexpr (std::is_same_v<T, fp16>) return 4;
  else if constexpr (std::is_same_v<T, std::int32_t>) return 5;
  else if constexpr (std::is_same_v<T, std::int64_t>) return 6;
  else return 100 + static_cast<std::int64_t>(sizeof(T));  // other types: told apart by size only
}
inline std::string type_name(std::int64_t code) {
  static const char* names[] = {"?", "float", "double", "bf16", "fp16", "int32", "int64"};
  return code >= 0 && code <= 6 ? names[code] : ::dsp::detail::concat(code - 100, "-byte type");
}

struct Endpoint {
  std::shared_ptr<Group> group;
  int rank = 0;

  template <class T>
  using Acc = decltype(to_accum(T{}));

  void sync(const char* op) const { group->arrive_and_wait(rank, op); }
  // The last barrier of a collective in which peers read or write this rank's buffers: waits
  // out an abort for Group::kAbortGrace so that no rank returns (and frees its buffer) while
  // peers still use it.
  void sync_closing(const char* op) const { group->arrive_and_wait(rank, op, Group::kAbortGrace); }
  int size() const { return group->size; }

  const Slot& slot(std::uint64_t gen, int q) const { return group->slot(gen, q); }
  // Peer q's payload buffer. Collectives that write into peers' buffers (all_reduce) post
  // mutable spans, hence the const_cast in mutable_peer.
  template <class T>
  const T* peer(std::uint64_t gen, int q) const { return static_cast<const T*>(slot(gen, q).ptr); }
  template <class T>
  T* mutable_peer(std::uint64_t gen, int q) const { return const_cast<T*>(peer<T>(gen, q)); }
  template <class T>
  const T* staged(std::uint64_t gen, int q) const { return reinterpret_cast<const T*>(group->staging(gen, q)); }

  // Publishes ptr, op and args (and copies `stage` into this rank's staging buffer), meets every
  // rank, and checks that all ranks entered the same collective and, when same_args, with the
  // same arguments. Every rank runs the same checks on the same data, so either all throw
  // CommError or none does. Returns the barrier instance whose slots hold the posted data.
  // No allocation on the way.
  std::uint64_t post(OpCode op, const void* ptr, std::array<std::int64_t, 3> args, bool same_args = true,
                     std::span<const std::byte> stage = {}) {
    const std::uint64_t gen = group->generation();
    Slot& mine = group->slot(gen, rank);
    mine.ptr = ptr;
    mine.op = static_cast<std::int64_t>(op);
    std::copy(args.begin(), args.end(), mine.arg);
    if (!stage.empty()) std::memcpy(group->staging(gen, rank), stage.data(), stage.size());
    const char* name = op_name(static_cast<std::int64_t>(op));
    sync(name);
    const Slot& s0 = slot(gen, 0);
    for (int q = 1; q < size(); ++q) {
      const Slot& sq = slot(gen, q);
      if (sq.op != s0.op) fail(name, ::dsp::detail::concat("collective mismatch: rank 0 called ", op_name(s0.op), ", rank ", q,
                                                           " called ", op_name(sq.op)));
      if (same_args && sq.arg[2] != s0.arg[2])
        fail(name, ::dsp::detail::concat(name, ": ranks disagree on the element type (rank 0: ", type_name(s0.arg[2]),
                                         ", rank ", q, ": ", type_name(sq.arg[2]), ")"));
      if (same_args && !std::equal(sq.arg, sq.arg + 2, s0.arg))
        fail(name, ::dsp::detail::concat(name, ": ranks disagree on size/arguments (rank 0: ", s0.arg[0], ", rank ", q,
                                         ": ", sq.arg[0], ")"));
    }
    return gen;
  }
  // Every rank has compared before anyone throws (a rank must not post the next slot set while
  // a peer still reads this one).
  [[noreturn]] void fail(const char* name, const std::string& msg) {
    sync(name);
    throw CommError(msg);
  }

  void barrier_impl() { post(OpCode::Barrier, nullptr, {}); }

  /// Largest unit of work of the direct all_reduce. Small enough that a rank which ran out of
  /// work finds chunks to take over from a slower (descheduled, or sharing a core) peer; large
  /// enough that claiming one (an atomic add, ~0.1 us) costs ~1% of reducing it (4 sources of
  /// 64 KiB at ~40 GB/s: ~10 us).
  static constexpr std::size_t kChunkBytes = std::size_t{64} << 10;

  // Elements per chunk of an n-element direct all_reduce: kChunkBytes, or a 1/p share when that
  // is smaller (so that every rank has work), in whole 64-byte lines counted from the start of
  // each buffer, so that two ranks write the same cache line of a buffer only where the buffer
  // itself is not 64-byte aligned. The same on every rank (it depends on n and p only).
  template <class T>
  std::int64_t chunk_elements(std::int64_t n) const {
    constexpr std::int64_t line = sizeof(T) < 64 ? 64 / static_cast<std::int64_t>(sizeof(T)) : 1;
    constexpr std::int64_t most = std::max<std::int64_t>(line, static_cast<std::int64_t>(kChunkBytes / sizeof(T)));
    const std::int64_t share = (n + size() - 1) / size();
    return std::min(most, (share + line - 1) / line * line);
  }

  /// Work stealing over `chunks` chunks shared by p ranks: owner q's chunks are
  /// [chunks q / p, chunks (q+1) / p), claimed in order through its counter claimed(q) (zero at
  /// the start). Rank `rank` claims its own chunks, then what is left of ranks rank+1, rank+2,
  /// ... (mod p), calling process(chunk) for each chunk it claimed. Called once by every rank,
  /// concurrently, each chunk is processed exactly once, whichever ranks run and when.
  template <class Counter, class Process>
  static void claim_chunks(int rank, int p, std::int64_t chunks, Counter claimed, Process process) {
    for (int i = 0; i < p; ++i) {
      const int owner = (rank + i) % p;
      const std::int64_t first = chunks * owner / p, count = chunks * (owner + 1) / p - first;
      std::atomic<std::int64_t>& counter = claimed(owner);
      for (std::int64_t c; (c = counter.fetch_add(1, std::memory_order_relaxed)) < count;) process(first + c);
    }
  }

  // Calls f(i) for i in [0, len): in groups of kLanes with a constant trip count, then one by
  // one for the rest. GCC -O2 (vectoriser cost model "very cheap") vectorises only loops whose
  // trip count is known to be a multiple of the vector width, so this is what makes the
  // reduction loops below SIMD at -O2 too (checked with -fopt-info-vec; -O3 vectorises either).
  static constexpr std::int64_t kLanes = 16;
  template <class F>
  static void for_lanes(std::int64_t len, F f) {
    std::int64_t i = 0;
    for (; i + kLanes <= len; i += kLanes)
      for (std::int64_t j = 0; j < kLanes; ++j) f(i + j);
    for (; i < len; ++i) f(i);
  }

  /// Bytes of the accumulator block of the reduction kernel: a block of each of 4 sources plus
  /// the accumulator fit a 48 KiB L1. Measured (2 and 4 sources, in L2): 2x faster than groups
  /// of 16 elements, whose per-group loop overhead dominated.
  static constexpr std::size_t kBlockBytes = 8192;

  // dst[d][i] = reduction over src[0..nsrc)[i], left to right (rank order), for every d < ndst
  // and i in [0, count). Block by block: all sources of a block are read into a local
  // accumulator (two sources per pass: fewer passes, same order) before any destination of it
  // is written, so a destination may be one of the sources (the in-place all_reduce and
  // reduce_scatter). The result is rounded to T once per element (bf16/fp16 accumulate in fp32)
  // and then copied (memcpy) to each destination, so all destinations are bit-identical. The
  // accumulator is a local array, so it aliases no source and the loops need no run-time alias
  // checks.
  template <class T, class Combine>
  static void reduce_blocks(const T* const* src, int nsrc, T* const* dst, int ndst, std::int64_t count,
                            Combine combine) {
    using A = Acc<T>;
    constexpr std::int64_t block = static_cast<std::int64_t>(kBlockBytes / sizeof(A));
    alignas(64) A acc[block];
    // The narrowed block of a 16-bit T (bf16, fp16: a uint16_t bit pattern each); raw bits, as
    // T[] would zero-fill on every call and its struct stores keep GCC from vectorising.
    alignas(64) std::uint16_t narrow[std::is_same_v<T, A> ? 1 : block];
    for (std::int64_t off = 0; off < count; off += block) {
      const std::int64_t len = std::min(block, count - off);
      const T* s0 = src[0] + off;
      if (nsrc == 1) {
        for_lanes(len, [&](std::int64_t i) { acc[i] = to_accum(s0[i]); });
      } else {
        const T* s1 = src[1] + off;
        for_lanes(len, [&](std::int64_t i) { acc[i] = combine(to_accum(s0[i]), to_accum(s1[i])); });
      }
      int q = 2;
      for (; q + 1 < nsrc; q += 2) {
        const T* a = src[q] + off;
        const T* b = src[q + 1] + off;
        for_lanes(len, [&](std::int64_t i) { acc[i] = combine(combine(acc[i], to_accum(a[i])), to_accum(b[i])); });
      }
      if (q < nsrc) {
        const T* a = src[q] + off;
        for_lanes(len, [&](std::int64_t i) { acc[i] = combine(acc[i], to_accum(a[i])); });
      }
      const void* result = acc;
      if constexpr (!std::is_same_v<T, A>) {
        static_assert(sizeof(T) == sizeof(std::uint16_t) && std::is_trivially_copyable_v<T>);
        for_lanes(len, [&](std::int64_t i) { narrow[i] = T::from_float(acc[i]); });  // = from_accum<T>
        result = narrow;
      }
      for (int d = 0; d < ndst; ++d) std::memcpy(dst[d] + off, result, static_cast<std::size_t>(len) * sizeof(T));
    }
  }
  template <class T>
  static void reduce(const T* const* src, int nsrc, T* const* dst, int ndst, std::int64_t count, ReduceOp op) {
    using A = Acc<T>;
    switch (op) {
      case ReduceOp::Sum: return reduce_blocks(src, nsrc, dst, ndst, count, [](A x, A y) { return x + y; });
      case ReduceOp::Max: return reduce_blocks(src, nsrc, dst, ndst, count, [](A x, A y) { return std::max(x, y); });
      case ReduceOp::Min: return reduce_blocks(src, nsrc, dst, ndst, count, [](A x, A y) { return std::min(x, y); });
    }
  }

  // Up to this many ranks the pointer arrays of the reduction live on the stack.
  static constexpr int kStackRanks = 16;
  // Pointer array of `size()` entries without a heap allocation for up to kStackRanks ranks.
  template <class P>
  struct PtrArray {
    explicit PtrArray(int n) : heap(n > kStackRanks ? static_cast<std::size_t>(n) : 0) {}
    P* data() { return heap.empty() ? local : heap.data(); }
    P local[kStackRanks] = {};
    std::vector<P> heap;
  };

  // all_reduce. Two algorithms, both reducing in rank order 0, 1, ..., n-1 so that every rank
  // gets bit-identical results:
  //  - eager (data.size_bytes() <= Group::kStagingBytes): post copies the input into this rank's
  //    staging buffer; after the one barrier every rank reduces the whole message from the n
  //    staging buffers into its own `data` (the "one-shot" algorithm of shared-memory
  //    all-reduces, e.g. vLLM's custom_all_reduce). No rank reads a peer's `data`, so there is
  //    no second barrier.
  //  - direct (larger): the buffer is cut into chunks (chunk_elements()); whoever processes a
  //    chunk reads it from all n buffers, reduces and writes the result into that chunk of every
  //    rank's buffer, block by block; a second barrier ends it. This is the "two-shot" algorithm
  //    (reduce-scatter, then all-gather) with the all-gather fused into the reduction: each
  //    buffer is read once and written once (2 n size bytes in all, the minimum; the lines
  //    written were just read, so the writes need no extra reads for ownership). Rank r owns
  //    a contiguous 1/n of the chunks and claims them in order from its counter
  //    (Group::claimed); a rank done with its own claims the rest of the next ranks' (r+1, r+2,
  //    ...; claim_chunks). When every rank runs, each does mostly its own share (the static
  //    split, with its cache locality across calls); when one is slow, because it shares a
  //    core (4 ranks on 2 cores) or was descheduled, the others finish its share instead of
  //    waiting for it. Which rank reduces a chunk does not change the result (the order over
  //    ranks is fixed).
  template <class T>
  void all_reduce_impl(std::span<T> data, ReduceOp op) {
    const auto n = static_cast<std::int64_t>(data.size());
    const int p = size();
    const bool eager = data.size_bytes() <= Group::kStagingBytes;
    // This rank's work counter for the coming barrier instance, published by post's barrier.
    if (!eager) group->claimed(group->generation(), rank).store(0, std::memory_order_relaxed);
    const auto gen = post(OpCode::AllReduce, data.data(), {n, static_cast<std::int64_t>(op), type_code<T>()}, true,
                          eager && p > 1 ? std::as_bytes(data) : std::span<const std::byte>{});
    if (p == 1) return;
    PtrArray<const T*> src(p);
    if (eager) {
      for (int q = 0; q < p; ++q) src.data()[q] = staged<T>(gen, q);
      T* dst = data.data();
      reduce(src.data(), p, &dst, 1, n, op);
      return;
    }
    PtrArray<T*> dst(p);
    const std::int64_t per_chunk = chunk_elements<T>(n), chunks = (n + per_chunk - 1) / per_chunk;
    claim_chunks(rank, p, chunks, [&](int owner) -> std::atomic<std::int64_t>& { return group->claimed(gen, owner); },
                 [&](std::int64_t chunk) {
                   const std::int64_t b = chunk * per_chunk, e = std::min(n, b + per_chunk);
                   for (int q = 0; q < p; ++q) {
                     dst.data()[q] = mutable_peer<T>(gen, q) + b;
                     src.data()[q] = dst.data()[q];
                   }
                   reduce(src.data(), p, dst.data(), p, e - b, op);
                 });
    sync_closing("all_reduce");
  }

  // True when [a, a + na) and [b, b + nb) share an element.
  template <class T>
  static bool overlaps(const T* a, std::size_t na, const T* b, std::size_t nb) {
    return na > 0 && nb > 0 && std::less<const T*>{}(a, b + nb) && std::less<const T*>{}(b, a + na);
  }

  // reduce_scatter: rank r reduces block r of all inputs (rank order) straight into `out`.
  // In place (out == in + r x out.size()) is fine, as block by block every source is read before
  // `out` is written; any other overlap of out and in is rejected (peers read the rest of `in`
  // concurrently). Eager when the input fits the staging buffer (one barrier, as all_reduce);
  // otherwise peers read `in` directly and a second barrier keeps `in` alive until they are done.
  template <class T>
  void reduce_scatter_impl(std::span<const T> in, std::span<T> out, ReduceOp op) {
    const auto n = static_cast<std::int64_t>(out.size());
    const int p = size();
    DSP_CHECK_AS(CommError, static_cast<std::int64_t>(in.size()) == n * p, "reduce_scatter: input has ", in.size(),
                 " elements, expected ", p, " x ", n);
    DSP_CHECK_AS(CommError, out.data() == in.data() + n * rank || !overlaps<T>(in.data(), in.size(), out.data(), out.size()),
                 "reduce_scatter: the output overlaps the input other than as this rank's block (in + rank x count)");
    const bool eager = in.size_bytes() <= Group::kStagingBytes;
    const auto gen = post(OpCode::ReduceScatter, in.data(), {n, static_cast<std::int64_t>(op), type_code<T>()}, true,
                          eager ? std::as_bytes(in) : std::span<const std::byte>{});
    PtrArray<const T*> src(p);
    for (int q = 0; q < p; ++q) src.data()[q] = (eager ? staged<T>(gen, q) : peer<T>(gen, q)) + n * rank;
    T* dst = out.data();
    reduce(src.data(), p, &dst, 1, n, op);
    if (!eager) sync_closing("reduce_scatter");
  }

  /// A direct all_gather whose output is at least this large writes it with non-temporal
  /// stores (streaming_copy): no read for ownership of lines that would not stay in the caches.
  /// Measured on the development machine ("machine B" of benchmarks/RESULTS.md: AMD EPYC,
  /// 32 MiB L3; bench_collectives, 2 and 4 ranks): streaming made 64 MiB and 256 MiB outputs
  /// 1.2-2x faster, 1-4 MiB 1.5-3x slower (their output stays in the L2/L3 between calls) and
  /// 16 MiB either; hence 32 MiB.
  static constexpr std::size_t kStreamingBytes = std::size_t{32} << 20;

  // all_gather: every rank copies the n blocks into its own `out` (pull), with non-temporal
  // stores from kStreamingBytes of output. In place (in == out + r x in.size()) skips this
  // rank's own block; any other overlap is rejected.
  // Eager (one barrier, from the staging buffers) when `in` fits the staging buffer.
  template <class T>
  void all_gather_impl(std::span<const T> in, std::span<T> out) {
    const auto n = static_cast<std::int64_t>(in.size());
    const int p = size();
    DSP_CHECK_AS(CommError, static_cast<std::int64_t>(out.size()) == n * p, "all_gather: output has ", out.size(),
                 " elements, expected ", p, " x ", n);
    const bool in_place = in.data() == out.data() + n * rank;
    DSP_CHECK_AS(CommError, in_place || !overlaps<T>(in.data(), in.size(), out.data(), out.size()),
                 "all_gather: the input overlaps the output other than as this rank's block (out + rank x count)");
    const bool eager = in.size_bytes() <= Group::kStagingBytes;
    const auto gen = post(OpCode::AllGather, in.data(), {n, 0, type_code<T>()}, true,
                          eager && p > 1 ? std::as_bytes(in) : std::span<const std::byte>{});
    const auto bytes = static_cast<std::size_t>(in.size_bytes());
    const bool stream = !eager && out.size_bytes() >= kStreamingBytes;
    for (int q = 0; q < p; ++q) {
      if (q == rank && in_place) continue;
      const T* from = q == rank ? in.data() : eager ? staged<T>(gen, q) : peer<T>(gen, q);
      if (bytes == 0) continue;
      if (stream) streaming_copy(out.data() + n * q, from, bytes);
      else std::memcpy(out.data() + n * q, from, bytes);
    }
    if (!eager) sync_closing("all_gather");
  }

  template <class T>
  void broadcast_impl(std::span<T> data, int root) {
    DSP_CHECK_AS(CommError, root >= 0 && root < size(), "broadcast: root ", root, " outside [0, ", size(), ")");
    const auto gen = post(OpCode::Broadcast, data.data(), {static_cast<std::int64_t>(data.size()), root, type_code<T>()});
    if (rank != root) std::copy(peer<T>(gen, root), peer<T>(gen, root) + data.size(), data.data());
    sync_closing("broadcast");
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
    // The count vectors stay alive until the closing barrier, so peers read them in place.
    Slot& mine = group->slot(group->generation(), rank);
    mine.send_counts = send_counts.data();
    mine.recv_counts = recv_counts.data();
    const auto gen = post(OpCode::AllToAllV, in.data(), {0, 0, type_code<T>()}, /*same_args=*/false);
    for (int q = 1; q < p; ++q)
      if (slot(gen, q).arg[2] != slot(gen, 0).arg[2])
        fail("all_to_all_v", ::dsp::detail::concat("all_to_all_v: ranks disagree on the element type (rank 0: ",
                                                   type_name(slot(gen, 0).arg[2]), ", rank ", q, ": ", type_name(slot(gen, q).arg[2]), ")"));
    // Every rank checks the whole count matrix, so either all ranks throw or none does.
    for (int src = 0; src < p; ++src)
      for (int dst = 0; dst < p; ++dst) {
        const std::int64_t sent = slot(gen, src).send_counts[dst], expected = slot(gen, dst).recv_counts[src];
        if (sent != expected)
          fail("all_to_all_v", ::dsp::detail::concat("all_to_all_v: rank ", src, " sends ", sent, " elements to rank ",
                                                     dst, ", which expects ", expected));
      }
    std::int64_t out_off = 0;
    for (int q = 0; q < p; ++q) {
      const std::int64_t* sc = slot(gen, q).send_counts;  // rank q's send counts
      const std::int64_t in_off = std::accumulate(sc, sc + rank, std::int64_t{0});
      std::copy(peer<T>(gen, q) + in_off, peer<T>(gen, q) + in_off + sc[rank], out.data() + out_off);
      out_off += recv_counts[static_cast<std::size_t>(q)];
    }
    sync_closing("all_to_all_v");
  }

  Endpoint split_impl(int color, int key) {
    const auto gen = post(OpCode::Split, nullptr, {color, key, 0}, /*same_args=*/false);
    std::vector<int> members;  // old ranks with my colour, ordered by (key, old rank)
    for (int q = 0; q < size(); ++q)
      if (slot(gen, q).arg[0] == color) members.push_back(q);
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return slot(gen, a).arg[1] < slot(gen, b).arg[1]; });
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
  /// bf16 and fp16 are accumulated in fp32 and rounded once; ranks are combined in rank order,
  /// so every rank gets bit-identical results. Throws CommError when the ranks' sizes or
  /// operators differ.
  template <class T>
  void all_reduce(std::span<T> data, ReduceOp op = ReduceOp::Sum) {
    run("all_reduce", data.size_bytes(), [&] { ep_.all_reduce_impl(data, op); });
  }
  template <class T>
  Work all_reduce_async(std::span<T> data, ReduceOp op = ReduceOp::Sum) {
    return submit("all_reduce", data.size_bytes(), [=, ep = ep_]() mutable { ep.all_reduce_impl(data, op); });
  }

  /// out[i] = reduce over ranks q of in_q[rank*out.size() + i]; in.size() == size()*out.size().
  /// `out` is either disjoint from `in` or exactly this rank's block of it (in-place, as
  /// NCCL); any other overlap, or a size mismatch, throws CommError.
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::Sum) {
    run("reduce_scatter", in.size_bytes(), [&] { ep_.reduce_scatter_impl(in, out, op); });
  }
  template <class T>
  Work reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::Sum) {
    return submit("reduce_scatter", in.size_bytes(), [=, ep = ep_]() mutable { ep.reduce_scatter_impl(in, out, op); });
  }

  /// out[q*in.size() + i] = in_q[i]; out.size() == size()*in.size(). `in` is either disjoint
  /// from `out` or exactly this rank's block of it (in-place); any other overlap, or a size
  /// mismatch, throws CommError.
  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    run("all_gather", out.size_bytes(), [&] { ep_.all_gather_impl(in, out); });
  }
  template <class T>
  Work all_gather_async(std::span<const T> in, std::span<T> out) {
    return submit("all_gather", out.size_bytes(), [=, ep = ep_]() mutable { ep.all_gather_impl(in, out); });
  }

  /// Copies root's `data` into every other rank's `data`.
  template <class T>
  void broadcast(std::span<T> data, int root) {
    run("broadcast", data.size_bytes(), [&] { ep_.broadcast_impl(data, root); });
  }
  template <class T>
  Work broadcast_async(std::span<T> data, int root) {
    return submit("broadcast", data.size_bytes(), [=, ep = ep_]() mutable { ep.broadcast_impl(data, root); });
  }

  /// Sends data to rank dst. Buffered: copies and returns at once, so it never waits for the
  /// receiver and is never queued behind this rank's pending operations. Matched, in order,
  /// by recv(src = rank(), tag) on dst.
  template <class T>
  void send(std::span<const T> data, int dst, int tag = 0) {
    require_valid();
    trace::Span span("send", trace::Kind::Comm, {{"bytes", static_cast<std::int64_t>(data.size_bytes())}});
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
      return submit("recv", data.size_bytes(), [=, ep = ep_]() mutable { ep.recv_impl(data, src, tag); }, true).wait();
    trace::Span span("recv", trace::Kind::Comm, {{"bytes", static_cast<std::int64_t>(data.size_bytes())}});
    ep_.recv_impl(data, src, tag);
  }
  template <class T>
  Work recv_async(std::span<T> data, int src, int tag = 0) {
    return submit("recv", data.size_bytes(), [=, ep = ep_]() mutable { ep.recv_impl(data, src, tag); }, true);
  }

  /// Personalised exchange: this rank sends send_counts[q] elements (consecutive in `in`, in
  /// rank order) to rank q and receives recv_counts[q] elements from rank q into `out` (in
  /// rank order). Zero counts are allowed. Throws CommError when a peer's send count does
  /// not match this rank's recv count.
  template <class T>
  void all_to_all_v(std::span<const T> in, std::vector<std::int64_t> send_counts, std::span<T> out,
                    std::vector<std::int64_t> recv_counts) {
    run("all_to_all_v", in.size_bytes(),
        [&] { ep_.all_to_all_v_impl(in, send_counts, out, recv_counts); });
  }
  template <class T>
  Work all_to_all_v_async(std::span<const T> in, std::vector<std::int64_t> send_counts, std::span<T> out,
                          std::vector<std::int64_t> recv_counts) {
    return submit("all_to_all_v", in.size_bytes(),
                  [=, ep = ep_]() mutable { ep.all_to_all_v_impl(in, send_counts, out, recv_counts); });
  }

  /// Returns when every rank called barrier.
  void barrier() {
    run("barrier", 0, [&] { ep_.barrier_impl(); });
  }
  Work barrier_async() {
    return submit("barrier", 0, [ep = ep_]() mutable { ep.barrier_impl(); });
  }

  /// Collective: ranks with the same colour (>= 0) form a new communicator, ordered by
  /// (key, old rank) as MPI_Comm_split.
  ThreadComm split(int color, int key) {
    DSP_CHECK_AS(CommError, color >= 0, "split: colour must be >= 0, got ", color);
    ThreadComm result;
    run("split", 0, [&] {
      auto e = ep_.split_impl(color, key);
      result = ThreadComm(std::move(e.group), e.rank);
    });
    return result;
  }
  /// As split; `out` is assigned when the returned Work completes (keep it alive until then).
  Work split_async(int color, int key, ThreadComm& out) {
    DSP_CHECK_AS(CommError, color >= 0, "split: colour must be >= 0, got ", color);
    return submit("split", 0, [=, &out, ep = ep_]() mutable {
      auto e = ep.split_impl(color, key);
      out = ThreadComm(std::move(e.group), e.rank);
    });
  }

 private:
  void require_valid() const { DSP_CHECK_AS(CommError, ep_.group != nullptr, "use of an empty ThreadComm"); }

  // Runs fn on the calling thread, or after the queued async work when there is some (and
  // waits for it, so fn may capture by reference). name (the API call) and bytes label its
  // trace span. A template, so the synchronous path neither allocates a std::function nor
  // copies the group's shared_ptr (an atomic on a cache line every rank shares).
  template <class Fn>
  void run(const char* name, std::size_t bytes, Fn&& fn) {
    require_valid();
    if (worker_ && worker_->pending() > 0) return submit(name, bytes, std::function<void()>(fn)).wait();
    trace::Span span(name, trace::Kind::Comm, {{"bytes", static_cast<std::int64_t>(bytes)}});
    fn();
  }
  // Queues fn on the collectives' worker, or on the receives' worker when p2p.
  Work submit(const char* name, std::size_t bytes, std::function<void()> fn, bool p2p = false) {
    require_valid();
    auto& worker = p2p ? p2p_worker_ : worker_;
    if (!worker) worker = std::make_shared<detail::Worker>(ep_.group->universe, ep_.rank, p2p ? "p2p" : "comm");
    return worker->submit(name, static_cast<std::int64_t>(bytes), std::move(fn));
  }
  detail::Endpoint ep_;
  std::shared_ptr<detail::Worker> worker_;      // collectives, in issue order
  std::shared_ptr<detail::Worker> p2p_worker_;  // receives, in issue order
};

}  // namespace dsp::comm
