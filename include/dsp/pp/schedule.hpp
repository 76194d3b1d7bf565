#pragma once
// Pipeline schedules as data: for each pipeline rank, the ordered list of what it does
// (forward, backward, and the point-to-point sends/receives between them), for GPipe
// (Huang et al. 2019), 1F1B / PipeDream-Flush (Narayanan et al., "Memory-Efficient
// Pipeline-Parallel DNN Training", ICML 2021; Megatron's forward_backward_pipelining_without_
// interleaving) and interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model
// Training on GPU Clusters Using Megatron-LM", SC'21, section 2.2; Megatron's forward_backward_
// pipelining_with_interleaving). `validate` checks a schedule (hand-made or generated) against
// the semantics of the engine that runs it, deadlock freedom included, before any rank starts.
//
// Engine semantics the schedules are written for (and `validate` simulates):
//  - sends are buffered: they complete at once and never block;
//  - a Recv action only posts the receive; the posted receives of a rank complete in posting
//    order (one receive thread per rank, as ThreadComm), the head once its matching send ran;
//  - a compute action waits for the receive it consumes.
// The generators post each receive one compute action ahead (just before the compute that
// precedes its consumer), so the transfer overlaps that compute; each send directly follows
// the compute that produces it.
#include <algorithm>
#include <cstddef>
#include <deque>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dsp/core/error.hpp"

namespace dsp::pp {

/// A schedule that breaks one of the rules of `validate` (a ConfigError: it is caught before
/// any work starts).
class ScheduleError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

/// What one pipeline rank does, in order.
enum class Op { Forward, Backward, SendActivation, RecvActivation, SendGrad, RecvGrad };

/// One action of a rank. `stage` is the virtual stage in [0, num_stages) the action belongs to;
/// for communication it is this rank's own stage: SendActivation(mb, s) sends the output of
/// Forward(mb, s) to stage s+1, RecvActivation(mb, s) receives the input of Forward(mb, s) from
/// stage s-1, SendGrad(mb, s) sends the input gradient of Backward(mb, s) to stage s-1,
/// RecvGrad(mb, s) receives the output gradient Backward(mb, s) needs from stage s+1.
struct Action {
  Op op;
  int micro_batch;
  int stage;
  bool operator==(const Action&) const = default;
};

/// A whole pipeline schedule: `ranks[r]` is the action list of pipeline rank r.
struct Schedule {
  std::string name;          ///< "gpipe", "1f1b", "interleaved" (or anything, for hand-made ones)
  int pipeline_size = 1;     ///< p: pipeline ranks
  int virtual_size = 1;      ///< v: model chunks per rank (1 except interleaved)
  int micro_batches = 1;     ///< m: micro-batches per optimizer step
  std::vector<std::vector<Action>> ranks;
  /// S = p * v virtual stages.
  int num_stages() const { return pipeline_size * virtual_size; }
  /// Virtual stage s lives on rank s % p as model chunk s / p (Megatron's interleaved layout).
  int rank_of(int stage) const { return stage % pipeline_size; }
  /// The model chunk (0..v-1) of rank_of(stage) that runs virtual stage `stage`.
  int chunk_of(int stage) const { return stage / pipeline_size; }
};

/// Text name of an action for messages: "forward(mb 3, stage 1)", "recv_grad(mb 0, stage 2)".
inline std::string to_string(const Action& a) {
  static constexpr const char* names[] = {"forward",  "backward",  "send_activation",
                                          "recv_activation", "send_grad", "recv_grad"};
  return dsp::detail::concat(names[static_cast<int>(a.op)], "(mb ", a.micro_batch, ", stage ", a.stage, ")");
}

namespace detail {

inline bool is_compute(Op op) { return op == Op::Forward || op == Op::Backward; }
inline bool is_send(Op op) { return op == Op::SendActivation || op == Op::SendGrad; }

/// The receive compute action `a` consumes (none on the first stage's forward and the last
/// stage's backward). S: number of virtual stages.
inline std::optional<Action> needed_recv(const Action& a, int S) {
  if (a.op == Op::Forward && a.stage > 0) return Action{Op::RecvActivation, a.micro_batch, a.stage};
  if (a.op == Op::Backward && a.stage < S - 1) return Action{Op::RecvGrad, a.micro_batch, a.stage};
  return std::nullopt;
}
/// The send that follows compute action `a` (none on the last stage's forward, stage 0's backward).
inline std::optional<Action> produced_send(const Action& a, int S) {
  if (a.op == Op::Forward && a.stage < S - 1) return Action{Op::SendActivation, a.micro_batch, a.stage};
  if (a.op == Op::Backward && a.stage > 0) return Action{Op::SendGrad, a.micro_batch, a.stage};
  return std::nullopt;
}
/// The matching action on the peer of a communication action (send <-> receive).
inline Action peer_of(const Action& a) {
  switch (a.op) {
    case Op::SendActivation: return {Op::RecvActivation, a.micro_batch, a.stage + 1};
    case Op::RecvActivation: return {Op::SendActivation, a.micro_batch, a.stage - 1};
    case Op::SendGrad: return {Op::RecvGrad, a.micro_batch, a.stage - 1};
    default: return {Op::SendGrad, a.micro_batch, a.stage + 1};  // RecvGrad
  }
}
/// Dense index of an in-range action: ((op * m) + mb) * S + stage, in [0, 6 m S).
inline std::size_t key(const Action& a, int m, int S) {
  return (static_cast<std::size_t>(a.op) * static_cast<std::size_t>(m) + static_cast<std::size_t>(a.micro_batch)) *
             static_cast<std::size_t>(S) + static_cast<std::size_t>(a.stage);
}

/// Builds a schedule from each rank's compute order, adding the communication: the receive of
/// the k-th compute goes just before the (k-1)-th compute (k = 0: at the start), each send
/// right after its compute.
inline Schedule assemble(std::string name, int p, int v, int m, const std::vector<std::vector<Action>>& compute) {
  Schedule s{std::move(name), p, v, m, {}};
  const int S = s.num_stages();
  for (const auto& c : compute) {
    auto& out = s.ranks.emplace_back();
    if (!c.empty())
      if (auto r = needed_recv(c[0], S)) out.push_back(*r);
    for (std::size_t k = 0; k < c.size(); ++k) {
      if (k + 1 < c.size())
        if (auto r = needed_recv(c[k + 1], S)) out.push_back(*r);
      out.push_back(c[k]);
      if (auto snd = produced_send(c[k], S)) out.push_back(*snd);
    }
  }
  return s;
}

/// Result of running a (rules 1-5 valid) schedule under the engine semantics, forward taking
/// `forward_cost` time units and backward `backward_cost`, communication free.
struct Simulation {
  std::vector<std::vector<int>> start;  ///< [rank][action index]: start time of a compute, else -1
  int makespan = 0;                     ///< time the last compute ends
  std::string deadlock;                 ///< empty when every rank ran to the end
};

inline Simulation simulate(const Schedule& s, int forward_cost = 1, int backward_cost = 2) {
  const int p = s.pipeline_size, m = s.micro_batches, S = s.num_stages();
  Simulation sim;
  std::vector<int> time(static_cast<std::size_t>(6 * m * S), -1);  // send: sent at; recv: completed at
  struct Rank {
    std::size_t pc = 0;
    int clock = 0, last_recv = 0;
    std::deque<std::pair<Action, int>> posted;  // (receive, time posted)
  };
  std::vector<Rank> st(static_cast<std::size_t>(p));
  for (const auto& list : s.ranks) sim.start.emplace_back(list.size(), -1);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      auto& R = st[static_cast<std::size_t>(r)];
      const auto& list = s.ranks[static_cast<std::size_t>(r)];
      for (;;) {
        while (!R.posted.empty()) {  // FIFO: only the head can complete
          const auto [recv, posted_at] = R.posted.front();
          const int sent = time[key(peer_of(recv), m, S)];
          if (sent < 0) break;
          R.last_recv = std::max({R.last_recv, sent, posted_at});
          time[key(recv, m, S)] = R.last_recv;
          R.posted.pop_front();
          progress = true;
        }
        if (R.pc == list.size()) break;
        const Action& a = list[R.pc];
        if (is_compute(a.op)) {
          int ready = R.clock;
          if (auto need = needed_recv(a, S)) {
            const int t = time[key(*need, m, S)];
            if (t < 0) break;  // waits for its receive
            ready = std::max(ready, t);
          }
          sim.start[static_cast<std::size_t>(r)][R.pc] = ready;
          R.clock = ready + (a.op == Op::Forward ? forward_cost : backward_cost);
          sim.makespan = std::max(sim.makespan, R.clock);
        } else if (is_send(a.op)) {
          time[key(a, m, S)] = R.clock;
        } else {
          R.posted.emplace_back(a, R.clock);
        }
        ++R.pc;
        progress = true;
      }
    }
  }
  std::ostringstream os;
  for (int r = 0; r < p; ++r) {
    const auto& R = st[static_cast<std::size_t>(r)];
    const auto& list = s.ranks[static_cast<std::size_t>(r)];
    if (R.pc == list.size()) continue;
    const Action& a = list[R.pc];
    os << (os.tellp() > 0 ? "; " : "") << "rank " << r << " waits at action " << R.pc << " (" << to_string(a)
       << ") for " << to_string(*needed_recv(a, s.num_stages()));
    if (!R.posted.empty()) {
      const Action head = R.posted.front().first, send = peer_of(head);
      os << ", its first pending receive " << to_string(head) << " waiting for " << to_string(send) << " from rank "
         << s.rank_of(send.stage);
    }
  }
  sim.deadlock = os.str();
  return sim;
}

}  // namespace detail

/// Checks that `s` can run on the engine. Throws ScheduleError (a ConfigError) with a sentence
/// naming the rank, action index and action at fault when any rule fails:
///  1. p, v, m >= 1, one action list per rank, every stage in [0, S) and micro-batch in [0, m),
///     every action on the rank that owns its stage (rank_of), no action twice;
///  2. every send has its receive on the peer and vice versa (none to a stage that does not
///     exist, none to the sending rank itself);
///  3. each (mb, stage) has one Forward and one Backward, the Forward first;
///  4. each compute's receive comes before it and its send after it, on its rank;
///  5. per channel (src rank, dst rank, activation|gradient) the sends, in src's order, match
///     the receives, in dst's posting order, element for element (messages match in order);
///  6. no deadlock: simulated with buffered sends and FIFO completion of posted receives.
inline void validate(const Schedule& s) {
  const int p = s.pipeline_size, v = s.virtual_size, m = s.micro_batches;
  auto fail = [&](const auto&... parts) {
    throw ScheduleError(dsp::detail::concat("schedule '", s.name, "' (p=", p, " v=", v, " m=", m, "): ", parts...));
  };
  if (p < 1 || v < 1 || m < 1) fail("p, v and m must be at least 1");
  if (s.ranks.size() != static_cast<std::size_t>(p)) fail("has ", s.ranks.size(), " action lists for ", p, " ranks");
  const int S = s.num_stages();
  auto list = [&](int r) -> const std::vector<Action>& { return s.ranks[static_cast<std::size_t>(r)]; };
  auto at = [&](int r, std::size_t i) {
    return dsp::detail::concat("rank ", r, ", action ", i, " (", to_string(list(r)[i]), ")");
  };
  // Rule 1. where[key] = (rank, index) of each action.
  std::vector<std::pair<int, std::size_t>> where(static_cast<std::size_t>(6 * m * S), {-1, 0});
  for (int r = 0; r < p; ++r)
    for (std::size_t i = 0; i < list(r).size(); ++i) {
      const Action& a = list(r)[i];
      if (a.stage < 0 || a.stage >= S) fail(at(r, i), ": stage out of range [0, ", S, ")");
      if (a.micro_batch < 0 || a.micro_batch >= m) fail(at(r, i), ": micro-batch out of range [0, ", m, ")");
      if (s.rank_of(a.stage) != r) fail(at(r, i), ": stage ", a.stage, " runs on rank ", s.rank_of(a.stage));
      auto& w = where[detail::key(a, m, S)];
      if (w.first >= 0) fail(at(r, i), " repeats action ", w.second);
      w = {r, i};
    }
  // Rule 2.
  for (int r = 0; r < p; ++r)
    for (std::size_t i = 0; i < list(r).size(); ++i) {
      const Action& a = list(r)[i];
      if (detail::is_compute(a.op)) continue;
      const Action peer = detail::peer_of(a);
      if (peer.stage < 0 || peer.stage >= S)
        fail(at(r, i), ": stage ", a.stage, " has no ", peer.stage < 0 ? "previous" : "next", " stage");
      if (s.rank_of(peer.stage) == r) fail(at(r, i), ": its peer stage ", peer.stage, " is on the same rank");
      if (where[detail::key(peer, m, S)].first < 0)
        fail(at(r, i), " has no matching ", to_string(peer), " on rank ", s.rank_of(peer.stage), " (unmatched ",
             detail::is_send(a.op) ? "send" : "receive", ")");
    }
  // Rule 3.
  for (int mb = 0; mb < m; ++mb)
    for (int st = 0; st < S; ++st) {
      const Action f{Op::Forward, mb, st}, b{Op::Backward, mb, st};
      const auto wf = where[detail::key(f, m, S)], wb = where[detail::key(b, m, S)];
      if (wf.first < 0) fail(to_string(f), " is missing (stage ", st, " runs on rank ", s.rank_of(st), ")");
      if (wb.first < 0) fail(to_string(b), " is missing (stage ", st, " runs on rank ", s.rank_of(st), ")");
      if (wb.second < wf.second)
        fail(at(wb.first, wb.second), " comes before its ", to_string(f), " (action ", wf.second, ")");
    }
  // Rule 4.
  for (int r = 0; r < p; ++r)
    for (std::size_t i = 0; i < list(r).size(); ++i) {
      const Action& a = list(r)[i];
      if (auto need = detail::needed_recv(a, S)) {
        const auto w = where[detail::key(*need, m, S)];
        if (w.first < 0) fail(at(r, i), " needs ", to_string(*need), " before it, which is missing");
        if (w.second > i)
          fail(at(r, i), " needs ", to_string(*need), " before it, but it is posted after (action ", w.second, ")");
      }
      if (auto snd = detail::produced_send(a, S)) {
        const auto w = where[detail::key(*snd, m, S)];
        if (w.first < 0) fail(at(r, i), " must be followed by ", to_string(*snd), ", which is missing");
        if (w.second < i)
          fail(at(r, i), " must be followed by ", to_string(*snd), ", but it comes before (action ", w.second, ")");
      }
    }
  // Rule 5. channel (src, dst, is_grad) -> action indices in list order, sends and receives.
  using Channel = std::tuple<int, int, bool>;
  std::map<Channel, std::vector<std::size_t>> sends, recvs;
  for (int r = 0; r < p; ++r)
    for (std::size_t i = 0; i < list(r).size(); ++i) {
      const Action& a = list(r)[i];
      if (detail::is_compute(a.op)) continue;
      const int peer = s.rank_of(detail::peer_of(a).stage);
      const bool grad = a.op == Op::SendGrad || a.op == Op::RecvGrad;
      if (detail::is_send(a.op)) sends[{r, peer, grad}].push_back(i);
      else recvs[{peer, r, grad}].push_back(i);
    }
  for (const auto& [ch, sent] : sends) {
    const auto& [src, dst, grad] = ch;
    const auto& got = recvs[ch];  // same length: rule 2 pairs every send with one receive
    for (std::size_t j = 0; j < sent.size(); ++j) {
      const Action& a = list(src)[sent[j]];
      const Action& b = list(dst)[got[j]];
      if (detail::peer_of(a) != b)
        fail("channel rank ", src, " -> rank ", dst, grad ? " (gradients)" : " (activations)", ": message ", j, " is ",
             at(src, sent[j]), " but receive ", j, " posted on it is ", at(dst, got[j]),
             " (messages on a channel match in order)");
    }
  }
  // Rule 6.
  const auto sim = detail::simulate(s);
  if (!sim.deadlock.empty()) fail("deadlock: ", sim.deadlock);
}

/// GPipe (Huang et al. 2019): rank r (stage r of S = p) runs Forward(0..m-1), then
/// Backward(0..m-1). Throws ConfigError when p < 1 or m < 1.
inline Schedule gpipe(int p, int m) {
  DSP_CHECK_AS(ConfigError, p >= 1 && m >= 1, "gpipe needs p >= 1 and m >= 1, got p=", p, " m=", m);
  std::vector<std::vector<Action>> c(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    for (int mb = 0; mb < m; ++mb) c[static_cast<std::size_t>(r)].push_back({Op::Forward, mb, r});
    for (int mb = 0; mb < m; ++mb) c[static_cast<std::size_t>(r)].push_back({Op::Backward, mb, r});
  }
  return detail::assemble("gpipe", p, 1, m, c);
}

/// 1F1B, PipeDream-Flush (Narayanan et al. 2021; Megatron's non-interleaved schedule): rank r
/// runs warmup = min(p - r - 1, m) forwards, then m - warmup (forward, backward) pairs, then
/// the warmup backwards; micro-batches in order. Throws ConfigError when p < 1 or m < 1.
inline Schedule one_f_one_b(int p, int m) {
  DSP_CHECK_AS(ConfigError, p >= 1 && m >= 1, "1f1b needs p >= 1 and m >= 1, got p=", p, " m=", m);
  std::vector<std::vector<Action>> c(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& out = c[static_cast<std::size_t>(r)];
    const int warmup = std::min(p - r - 1, m);
    for (int mb = 0; mb < warmup; ++mb) out.push_back({Op::Forward, mb, r});
    for (int k = 0; k < m - warmup; ++k) {
      out.push_back({Op::Forward, k + warmup, r});
      out.push_back({Op::Backward, k, r});
    }
    for (int mb = m - warmup; mb < m; ++mb) out.push_back({Op::Backward, mb, r});
  }
  return detail::assemble("1f1b", p, 1, m, c);
}

/// Interleaved 1F1B (Narayanan et al., SC'21, section 2.2; Megatron's forward_backward_
/// pipelining_with_interleaving): rank r holds v chunks, virtual stages r, r + p, ...,
/// r + (v-1) p. Each rank runs m v forward and m v backward steps; step k is micro-batch
/// (k / (p v)) p + k % p on chunk (k / p) % v (forward) or v - 1 - (k / p) % v (backward).
/// warmup = min(2 (p - r - 1) + (v - 1) p, m v) forwards, then (forward k + warmup, backward k)
/// pairs, then the remaining backwards. Throws ConfigError unless p >= 2, v >= 2, m >= 1 and
/// m % p == 0 (Megatron's requirement: micro-batches go through the chunks in groups of p).
inline Schedule interleaved_1f1b(int p, int v, int m) {
  DSP_CHECK_AS(ConfigError, p >= 2 && v >= 2, "interleaved 1F1B needs p >= 2 and v >= 2, got p=", p, " v=", v);
  DSP_CHECK_AS(ConfigError, m >= 1 && m % p == 0, "interleaved 1F1B needs the number of micro-batches (m=", m,
               ") to be a positive multiple of the pipeline size (p=", p, ")");
  const int total = m * v;
  auto step = [&](int k, bool forward, int r) {
    const int chunk = forward ? (k / p) % v : v - 1 - (k / p) % v;
    return Action{forward ? Op::Forward : Op::Backward, (k / (p * v)) * p + k % p, chunk * p + r};
  };
  std::vector<std::vector<Action>> c(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& out = c[static_cast<std::size_t>(r)];
    const int warmup = std::min((p - r - 1) * 2 + (v - 1) * p, total);
    for (int k = 0; k < warmup; ++k) out.push_back(step(k, true, r));
    for (int k = 0; k < total - warmup; ++k) {
      out.push_back(step(k + warmup, true, r));
      out.push_back(step(k, false, r));
    }
    for (int k = total - warmup; k < total; ++k) out.push_back(step(k, false, r));
  }
  return detail::assemble("interleaved", p, v, m, c);
}

/// The schedule called `name`: "gpipe" | "1f1b" | "interleaved"; v is the number of chunks per
/// rank and must be 1 except for "interleaved". Throws ConfigError for an unknown name (listing
/// the choices), v != 1 with gpipe/1f1b, and whatever the generator rejects.
inline Schedule make_schedule(const std::string& name, int p, int v, int m) {
  if (name == "interleaved") return interleaved_1f1b(p, v, m);
  DSP_CHECK_AS(ConfigError, name == "gpipe" || name == "1f1b", "unknown pipeline schedule '", name,
               "' (choices: gpipe, 1f1b, interleaved)");
  DSP_CHECK_AS(ConfigError, v == 1, "the ", name, " schedule runs one model chunk per rank (v=1), got v=", v,
               "; use 'interleaved' for v > 1");
  return name == "gpipe" ? gpipe(p, m) : one_f_one_b(p, m);
}

/// Idealised bubble fraction (idle time / total time) with uniform stages:
/// (p - 1) / (v m + p - 1). For GPipe and 1F1B (v = 1) the bubble is (p - 1)(t_f + t_b) against
/// m (t_f + t_b) of work (Narayanan et al. 2021); interleaving divides the bubble by v,
/// t_pb = (p - 1)/v (t_f + t_b) (Narayanan et al., SC'21, section 2.2), so the fraction is
/// ((p - 1)/v) / (m + (p - 1)/v).
inline double theoretical_bubble_fraction(const Schedule& s) {
  const double p = s.pipeline_size, v = s.virtual_size, m = s.micro_batches;
  return (p - 1) / (v * m + p - 1);
}

/// Most (micro-batch, chunk) pairs rank `rank` holds forwarded but not yet backwarded at any
/// point of its action list: the activation-stash depth (m for GPipe, min(p - r, m) for 1F1B).
/// Throws ConfigError when rank is not in [0, ranks.size()).
inline int peak_in_flight(const Schedule& s, int rank) {
  DSP_CHECK_AS(ConfigError, rank >= 0 && static_cast<std::size_t>(rank) < s.ranks.size(), "rank ", rank,
               " is not a pipeline rank of schedule '", s.name, "' (", s.ranks.size(), " ranks)");
  int now = 0, peak = 0;
  for (const Action& a : s.ranks[static_cast<std::size_t>(rank)]) {
    if (a.op == Op::Forward) peak = std::max(peak, ++now);
    if (a.op == Op::Backward) --now;
  }
  return peak;
}

/// A time line of a simulated run: a header line "<name>: p=.. v=.. m=.., T steps, idle x%
/// (theory y%)", then one row per rank, one column per time step; a forward takes 1 step and
/// shows as "F<mb>.<stage>", a backward takes 2 and shows as "B<mb>.<stage>" followed by a
/// "----" cell; blank cells are idle; communication is free and not shown. Cells are padded to
/// the widest label. Throws ScheduleError when `s` does not validate.
inline std::string to_table(const Schedule& s) {
  validate(s);
  const auto sim = detail::simulate(s);
  const int T = sim.makespan, p = s.pipeline_size;
  std::vector<std::vector<std::string>> cells(static_cast<std::size_t>(p),
                                              std::vector<std::string>(static_cast<std::size_t>(T)));
  std::size_t width = 1;
  long busy = 0;
  for (std::size_t r = 0; r < cells.size(); ++r)
    for (std::size_t i = 0; i < s.ranks[r].size(); ++i) {
      const Action& a = s.ranks[r][i];
      if (!detail::is_compute(a.op)) continue;
      const auto t = static_cast<std::size_t>(sim.start[r][i]);
      auto& row = cells[r];
      row[t] = dsp::detail::concat(a.op == Op::Forward ? "F" : "B", a.micro_batch, ".", a.stage);
      width = std::max(width, row[t].size());
      if (a.op == Op::Backward) row[t + 1] = "-";  // widened below
      busy += a.op == Op::Forward ? 1 : 2;
    }
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << s.name << ": p=" << p << " v=" << s.virtual_size << " m=" << s.micro_batches << ", " << T << " steps, idle "
     << 100.0 * (1.0 - static_cast<double>(busy) / (static_cast<double>(p) * T)) << "% (theory "
     << 100.0 * theoretical_bubble_fraction(s) << "%)\n";
  for (int r = 0; r < p; ++r) {
    std::string line = dsp::detail::concat("rank ", r, " |");
    for (const auto& c : cells[static_cast<std::size_t>(r)]) {
      line += ' ';
      if (c == "-") line.append(width, '-');
      else line.append(c).append(width - c.size(), ' ');
    }
    line.erase(line.find_last_not_of(' ') + 1);
    os << line << "\n";
  }
  return os.str();
}

}  // namespace dsp::pp
