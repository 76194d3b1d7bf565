#pragma once
// Timeline: spans of compute, communication and idle time per rank and thread, written as a
// Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing).
//
// Format: the Trace Event Format (Google, "Trace Event Format", docs.google.com/document/d/
// 1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU): a JSON object whose "traceEvents" holds
// complete events (ph "X", ts and dur in microseconds) and metadata events (ph "M") that name
// the processes ("rank N") and threads ("main", "comm", "p2p").
//
// Model: ranks are threads of one process, so every thread says which rank it works for
// (set_thread_rank; a communicator's worker thread takes over the rank of the thread that
// created it). In the trace a rank is a process (pid = rank) and each thread a track (tid).
// Recording is off by default and is switched on per rank: start() on a rank's thread records
// that rank's spans, on all its threads, until stop() on that rank. A Span costs one relaxed
// atomic load while no rank records; while some rank records, a Span takes a mutex twice.
// Spans are meant to be coarse (a layer, a collective: a few hundred per step).
//
// Processes: each process records its own ranks' events. write_chrome_trace(world, path)
// gathers every process's events on rank 0 into one file (under MPI one rank per process).
// Times are steady_clock readings (Linux: CLOCK_MONOTONIC, one clock for every process of a
// node), so events of ranks on one node line up; ranks on different nodes are not aligned.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/core/error.hpp"

namespace dsp::trace {

/// What a span's time was spent on; the event's "cat" in the trace.
enum class Kind { Compute, Comm, Idle };

/// "compute", "comm" or "idle".
inline const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Compute: return "compute";
    case Kind::Comm: return "comm";
    case Kind::Idle: return "idle";
  }
  return "?";
}

/// A small integer argument of a span (e.g. {"bytes", 4096}); key must be a string literal.
struct Arg {
  const char* key;
  std::int64_t value;
};

/// One recorded span. Times are std::chrono::steady_clock readings in microseconds (since the
/// clock's epoch: on Linux the boot, the same in every process of a node).
struct Event {
  std::string name;
  Kind kind = Kind::Compute;
  int rank = 0;           ///< pid in the trace
  int tid = 0;            ///< thread id in the trace, unique per (thread, set_thread_rank call)
  std::string track;      ///< thread name in the trace: "main", "comm", "p2p", ...
  double begin_us = 0.0;
  double end_us = 0.0;
  std::vector<Arg> args;
};

namespace detail {
/// True while at least one rank records; the only thing a disabled Span reads.
inline std::atomic<bool> any_recording{false};
inline std::atomic<int> next_tid{1};

struct ThreadIdentity {
  int rank = 0;
  std::string track = "main";
  int tid = 0;  // 0: not assigned yet
};
inline thread_local ThreadIdentity identity;

inline int thread_tid() {
  if (identity.tid == 0) identity.tid = next_tid.fetch_add(1, std::memory_order_relaxed);
  return identity.tid;
}

struct Recorder {
  std::mutex mu;
  std::vector<int> recording_ranks;  // ranks between start() and stop()
  std::vector<Event> events;
  bool records(int rank) const {
    return std::find(recording_ranks.begin(), recording_ranks.end(), rank) != recording_ranks.end();
  }
};
inline Recorder& recorder() {
  static Recorder r;
  return r;
}

/// steady_clock's reading in microseconds.
inline double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace detail

/// Says that the calling thread works for `rank` (the trace's pid; use the global rank) on a
/// track named `track` (the trace's thread name). Starts a new track id, so a thread that
/// changes rank never mixes its spans with the old rank's.
inline void set_thread_rank(int rank, std::string track = "main") {
  detail::identity = {rank, std::move(track), detail::next_tid.fetch_add(1, std::memory_order_relaxed)};
}
/// The calling thread's rank (0 unless set_thread_rank said otherwise).
inline int thread_rank() { return detail::identity.rank; }

/// True while some rank records (one relaxed atomic load).
inline bool enabled() { return detail::any_recording.load(std::memory_order_relaxed); }

/// Starts recording the calling thread's rank (its own and its communication threads' spans).
/// Does nothing when that rank already records.
inline void start() {
  auto& r = detail::recorder();
  std::lock_guard lk(r.mu);
  if (!r.records(thread_rank())) r.recording_ranks.push_back(thread_rank());
  detail::any_recording.store(true, std::memory_order_relaxed);
}
/// Stops recording the calling thread's rank; spans of that rank still open are dropped.
/// Does nothing when that rank does not record.
inline void stop() {
  auto& r = detail::recorder();
  std::lock_guard lk(r.mu);
  std::erase(r.recording_ranks, thread_rank());
  detail::any_recording.store(!r.recording_ranks.empty(), std::memory_order_relaxed);
}

/// A copy of the events recorded so far, in the order they ended.
inline std::vector<Event> events() {
  auto& r = detail::recorder();
  std::lock_guard lk(r.mu);
  return r.events;
}
/// Drops the events recorded so far (recording ranks keep recording).
inline void clear() {
  auto& r = detail::recorder();
  std::lock_guard lk(r.mu);
  r.events.clear();
}

/// RAII span: records [construction, destruction) of the calling thread as one event when
/// the thread's rank records at construction and still does at destruction; otherwise it
/// records nothing. Nest spans by scope (a thread's spans must nest for the trace viewers).
class Span {
 public:
  /// name: what runs (the API call, "layers.3.forward"); args: small integers (e.g. bytes).
  Span(std::string_view name, Kind kind, std::initializer_list<Arg> args = {}) {
    if (enabled()) begin(name, kind, args);
  }
  ~Span() {
    if (active_) end();
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  void begin(std::string_view name, Kind kind, std::initializer_list<Arg> args) {
    const double t = detail::now_us();
    {
      auto& r = detail::recorder();
      std::lock_guard lk(r.mu);
      if (!r.records(thread_rank())) return;
    }
    active_ = true;
    event_ = {std::string(name), kind, thread_rank(), detail::thread_tid(), detail::identity.track, t, t,
              std::vector<Arg>(args)};
  }
  void end() {
    event_.end_us = detail::now_us();
    auto& r = detail::recorder();
    std::lock_guard lk(r.mu);
    if (r.records(event_.rank)) r.events.push_back(std::move(event_));
  }

  bool active_ = false;
  Event event_;
};

/// `evs` as a Chrome trace: {"traceEvents": [...], "displayTimeUnit": "ms"} with one complete
/// event (ph "X") per span (name, cat = kind_name, ts, dur in microseconds, pid = rank, tid,
/// args) sorted by start time, and metadata events (ph "M") naming each process "rank N" and
/// each thread by its track, ordered main, comm, p2p. ts counts from the earliest start among
/// `evs`; times are rounded to nanoseconds.
inline nlohmann::json chrome_trace(std::vector<Event> evs) {
  std::stable_sort(evs.begin(), evs.end(), [](const Event& a, const Event& b) {
    return std::tie(a.begin_us, b.end_us) < std::tie(b.begin_us, a.end_us);  // parents before children
  });
  auto out = nlohmann::json::array();
  std::map<int, std::map<int, std::string>> threads;  // rank -> tid -> track
  for (const auto& e : evs) threads[e.rank][e.tid] = e.track;
  for (const auto& [rank, tids] : threads) {
    out.push_back(
        {{"ph", "M"}, {"name", "process_name"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
    out.push_back({{"ph", "M"}, {"name", "process_sort_index"}, {"pid", rank}, {"args", {{"sort_index", rank}}}});
    for (const auto& [tid, track] : tids) {
      const int order = track == "main" ? 0 : track == "comm" ? 1 : track == "p2p" ? 2 : 3;
      out.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", rank}, {"tid", tid}, {"args", {{"name", track}}}});
      out.push_back(
          {{"ph", "M"}, {"name", "thread_sort_index"}, {"pid", rank}, {"tid", tid}, {"args", {{"sort_index", order}}}});
    }
  }
  const double origin_us = evs.empty() ? 0.0 : evs.front().begin_us;  // sorted: the earliest start
  for (const auto& e : evs) {
    auto args = nlohmann::json::object();
    for (const auto& a : e.args) args[a.key] = a.value;
    const long long begin_ns = std::llround((e.begin_us - origin_us) * 1e3);
    const long long end_ns = std::llround((e.end_us - origin_us) * 1e3);
    out.push_back({{"ph", "X"}, {"name", e.name}, {"cat", kind_name(e.kind)},
                   {"ts", static_cast<double>(begin_ns) / 1e3}, {"dur", static_cast<double>(end_ns - begin_ns) / 1e3},
                   {"pid", e.rank}, {"tid", e.tid}, {"args", std::move(args)}});
  }
  return {{"traceEvents", std::move(out)}, {"displayTimeUnit", "ms"}};
}
/// The events recorded in this process as a Chrome trace (chrome_trace(events())).
inline nlohmann::json chrome_trace() { return chrome_trace(events()); }

namespace detail {
/// Writes `trace` to `path` (replacing it); InputError naming the path when that fails.
inline void write_json(const nlohmann::json& trace, const std::string& path) {
  const std::string text = trace.dump();
  std::ofstream f(path, std::ios::trunc);
  DSP_CHECK_AS(InputError, f.good(), "cannot write trace file '", path, "'");
  f << text << '\n';
  f.flush();
  DSP_CHECK_AS(InputError, f.good(), "cannot write trace file '", path, "'");
}

/// A copy of `key` that lives as long as the process (the Arg keys of received events).
inline const char* intern(const std::string& key) {
  static std::mutex mu;
  static std::set<std::string> keys;
  std::lock_guard lk(mu);
  return keys.insert(key).first->c_str();
}

/// Events as bytes (CBOR of [name, kind, rank, tid, track, begin_us, end_us, [[key, value]...]]
/// per event), and back.
inline std::vector<std::uint8_t> serialize(const std::vector<Event>& evs) {
  auto j = nlohmann::json::array();
  for (const auto& e : evs) {
    auto args = nlohmann::json::array();
    for (const auto& a : e.args) args.push_back({a.key, a.value});
    j.push_back({e.name, static_cast<int>(e.kind), e.rank, e.tid, e.track, e.begin_us, e.end_us, std::move(args)});
  }
  return nlohmann::json::to_cbor(j);
}
inline std::vector<Event> deserialize(const std::vector<std::uint8_t>& bytes) {
  std::vector<Event> evs;
  for (const auto& j : nlohmann::json::from_cbor(bytes)) {
    Event e{j[0].get<std::string>(), static_cast<Kind>(j[1].get<int>()), j[2].get<int>(), j[3].get<int>(),
            j[4].get<std::string>(), j[5].get<double>(), j[6].get<double>(), {}};
    for (const auto& a : j[7]) e.args.push_back({intern(a[0].get<std::string>()), a[1].get<std::int64_t>()});
    evs.push_back(std::move(e));
  }
  return evs;
}

/// A random number fixed for the life of this process: ranks with equal tokens share a
/// process, and so its recorder.
inline std::int64_t process_token() {
  static const std::int64_t token = [] {
    std::random_device rd;
    return static_cast<std::int64_t>((static_cast<std::uint64_t>(rd()) << 32) | rd());
  }();
  return token;
}

/// Message tag of write_chrome_trace's transfers (below MPI's smallest allowed tag bound, 32767).
inline constexpr int kGatherTag = 29810;
}  // namespace detail

/// Writes chrome_trace() (this process's events) to `path`, replacing it. Throws InputError
/// naming the path when the file cannot be opened or written.
inline void write_chrome_trace(const std::string& path) { detail::write_json(chrome_trace(), path); }

/// Collective over `world` (call it on every rank): rank 0 writes one Chrome trace of every
/// rank's events to `path` (chrome_trace's format); the other ranks write nothing.
/// Ranks that are threads of one process (comm::ThreadComm) share that process's recorder,
/// so events are gathered per process: the lowest rank of each process other than rank 0's
/// sends its process's events (events(), serialised; length first) to rank 0 with send/recv
/// of int64 and uint8 elements on tag detail::kGatherTag; ranks in rank 0's process send
/// nothing. No event appears twice, and with ThreadComm nothing moves but one all_gather of
/// an int64 per rank. Under MPI (one rank per process) every rank but 0 sends its own events.
/// Times line up for processes on one node (see the header comment).
/// Call it after each rank's spans of interest have ended (e.g. after stop() on every rank);
/// a rank that still records may add the spans of this call's own communication.
/// Comm: a communicator (comm::ThreadComm, comm::MpiComm). Throws InputError on rank 0 when
/// the file cannot be written; the communicator's errors (CommError: e.g. more than INT_MAX
/// bytes of events from one process under MPI) on the ranks involved.
template <class Comm>
void write_chrome_trace(Comm& world, const std::string& path) {
  const std::int64_t token = detail::process_token();
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(world.size()));
  world.all_gather(std::span<const std::int64_t>(&token, 1), std::span<std::int64_t>(tokens));
  const auto sends = [&](int r) {  // r is the lowest rank of its process, which is not rank 0's
    const auto mine = tokens.begin() + r;
    return *mine != tokens[0] && std::find(tokens.begin(), mine, *mine) == mine;
  };
  if (world.rank() != 0) {
    if (!sends(world.rank())) return;
    const auto bytes = detail::serialize(events());
    const auto size = static_cast<std::int64_t>(bytes.size());
    world.send(std::span<const std::int64_t>(&size, 1), 0, detail::kGatherTag);
    world.send(std::span<const std::uint8_t>(bytes), 0, detail::kGatherTag);
    return;
  }
  std::vector<Event> all = events();
  for (int r = 1; r < world.size(); ++r) {
    if (!sends(r)) continue;
    std::int64_t size = 0;
    world.recv(std::span<std::int64_t>(&size, 1), r, detail::kGatherTag);
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
    world.recv(std::span<std::uint8_t>(bytes), r, detail::kGatherTag);
    auto evs = detail::deserialize(bytes);
    all.insert(all.end(), std::make_move_iterator(evs.begin()), std::make_move_iterator(evs.end()));
  }
  detail::write_json(chrome_trace(std::move(all)), path);
}

}  // namespace dsp::trace
