// pp/schedule: the GPipe, 1F1B and interleaved 1F1B generators against hand-written orders,
// and the validator against hand-broken schedules (each rule, deadlock by simulation).
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "dsp/pp/schedule.hpp"

namespace pp_schedule_test {

using dsp::ConfigError;
using dsp::pp::Action;
using dsp::pp::Op;
using dsp::pp::Schedule;

namespace {

// The compute actions of one rank as "F<mb>.<stage>" / "B<mb>.<stage>", in order.
std::vector<std::string> compute_order(const Schedule& s, int rank) {
  std::vector<std::string> out;
  for (const Action& a : s.ranks[static_cast<std::size_t>(rank)])
    if (a.op == Op::Forward || a.op == Op::Backward)
      out.push_back((a.op == Op::Forward ? "F" : "B") + std::to_string(a.micro_batch) + "." + std::to_string(a.stage));
  return out;
}

std::vector<std::string> split(const std::string& words) {
  std::vector<std::string> out;
  std::string w;
  for (char c : words + " ") {
    if (c != ' ') w += c;
    else if (!w.empty()) out.push_back(std::move(w)), w.clear();
  }
  return out;
}

// Every (mb, stage) forwarded once and backwarded once over all ranks, on the rank owning it.
void check_each_once(const Schedule& s) {
  for (int mb = 0; mb < s.micro_batches; ++mb)
    for (int st = 0; st < s.num_stages(); ++st)
      for (Op op : {Op::Forward, Op::Backward}) {
        int count = 0;
        for (int r = 0; r < s.pipeline_size; ++r)
          count += static_cast<int>(std::count(s.ranks[static_cast<std::size_t>(r)].begin(),
                                               s.ranks[static_cast<std::size_t>(r)].end(), Action{op, mb, st}));
        const auto& own = s.ranks[static_cast<std::size_t>(st % s.pipeline_size)];
        INFO(s.name, " p=", s.pipeline_size, " v=", s.virtual_size, " m=", s.micro_batches, " mb=", mb, " stage=", st);
        CHECK(count == 1);
        CHECK(std::find(own.begin(), own.end(), Action{op, mb, st}) != own.end());
      }
}

// Removes the first occurrence of `a` from rank r's list.
void erase(Schedule& s, int r, const Action& a) {
  auto& list = s.ranks[static_cast<std::size_t>(r)];
  auto it = std::find(list.begin(), list.end(), a);
  REQUIRE(it != list.end());
  list.erase(it);
}

}  // namespace

TEST_CASE("schedule: every generator gives a valid schedule over a grid of (p, v, m)") {
  for (int p = 1; p <= 4; ++p)
    for (int m = 1; m <= 16; ++m) {
      CAPTURE(p);
      CAPTURE(m);
      for (const char* name : {"gpipe", "1f1b"}) {
        const Schedule s = dsp::pp::make_schedule(name, p, 1, m);
        CHECK(s.name == name);
        CHECK(s.num_stages() == p);
        CHECK_NOTHROW(dsp::pp::validate(s));
        check_each_once(s);
      }
      if (p < 2 || m % p != 0) continue;
      for (int v = 2; v <= 3; ++v) {
        CAPTURE(v);
        const Schedule s = dsp::pp::make_schedule("interleaved", p, v, m);
        CHECK(s.num_stages() == p * v);
        CHECK_NOTHROW(dsp::pp::validate(s));
        check_each_once(s);
      }
    }
}

TEST_CASE("schedule: 1F1B on p=4, m=8 follows the hand-written order") {
  const Schedule s = dsp::pp::one_f_one_b(4, 8);
  // rank 0: warmup p - 1 = 3 forwards, 5 steady (forward, backward) pairs, 3 cooldown backwards
  CHECK(compute_order(s, 0) ==
        split("F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 F6.0 B3.0 F7.0 B4.0 B5.0 B6.0 B7.0"));
  // rank 3 (last): no warmup, alternates from the start
  CHECK(compute_order(s, 3) ==
        split("F0.3 B0.3 F1.3 B1.3 F2.3 B2.3 F3.3 B3.3 F4.3 B4.3 F5.3 B5.3 F6.3 B6.3 F7.3 B7.3"));
  CHECK(compute_order(s, 1) ==
        split("F0.1 F1.1 F2.1 B0.1 F3.1 B1.1 F4.1 B2.1 F5.1 B3.1 F6.1 B4.1 F7.1 B5.1 B6.1 B7.1"));
}

TEST_CASE("schedule: receives are posted one compute ahead, sends follow their compute") {
  const Schedule s = dsp::pp::one_f_one_b(2, 2);
  // rank 0: F0 F1 B0 B1 (warmup 1); rank 1: F0 B0 F1 B1
  CHECK(s.ranks[0] == std::vector<Action>{{Op::Forward, 0, 0},
                                          {Op::SendActivation, 0, 0},
                                          {Op::RecvGrad, 0, 0},  // for B0, posted before F1
                                          {Op::Forward, 1, 0},
                                          {Op::SendActivation, 1, 0},
                                          {Op::RecvGrad, 1, 0},  // for B1, posted before B0
                                          {Op::Backward, 0, 0},
                                          {Op::Backward, 1, 0}});
  CHECK(s.ranks[1] == std::vector<Action>{{Op::RecvActivation, 0, 1},  // for F0, at the start
                                          {Op::Forward, 0, 1},
                                          {Op::RecvActivation, 1, 1},  // for F1, posted before B0
                                          {Op::Backward, 0, 1},
                                          {Op::SendGrad, 0, 1},
                                          {Op::Forward, 1, 1},
                                          {Op::Backward, 1, 1},
                                          {Op::SendGrad, 1, 1}});
}

TEST_CASE("schedule: interleaved p=2, v=2, m=4 follows the hand-derived order") {
  const Schedule s = dsp::pp::interleaved_1f1b(2, 2, 4);
  // total = m v = 8 steps of each kind; stage = chunk * p + r.
  // forward step k: chunk (k/2)%2, mb (k/4)*2 + k%2
  //   k: 0    1    2    3    4    5    6    7
  //      F0.0 F1.0 F0.2 F1.2 F2.0 F3.0 F2.2 F3.2      (rank 0)
  // backward step k: chunk 1 - (k/2)%2, same mb
  //      B0.2 B1.2 B0.0 B1.0 B2.2 B3.2 B2.0 B3.0      (rank 0)
  // rank 0: warmup = (2-0-1)*2 + (2-1)*2 = 4 forwards (k 0..3), then pairs (F k+4, B k) for
  // k 0..3, then backwards k 4..7.
  CHECK(compute_order(s, 0) ==
        split("F0.0 F1.0 F0.2 F1.2 F2.0 B0.2 F3.0 B1.2 F2.2 B0.0 F3.2 B1.0 B2.2 B3.2 B2.0 B3.0"));
  // rank 1: warmup = 0 + 2 = 2, pairs (F k+2, B k) for k 0..5, then backwards 6, 7.
  CHECK(compute_order(s, 1) ==
        split("F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 F2.1 B0.1 F3.1 B1.1 F2.3 B2.3 F3.3 B3.3 B2.1 B3.1"));
  CHECK(s.rank_of(3) == 1);
  CHECK(s.chunk_of(3) == 1);
  CHECK(s.chunk_of(1) == 0);
}

TEST_CASE("schedule: peak_in_flight") {
  for (int p = 1; p <= 4; ++p)
    for (int m = 1; m <= 8; ++m) {
      const Schedule g = dsp::pp::gpipe(p, m), f = dsp::pp::one_f_one_b(p, m);
      for (int r = 0; r < p; ++r) {
        CHECK(dsp::pp::peak_in_flight(g, r) == m);
        CHECK(dsp::pp::peak_in_flight(f, r) == std::min(p - r, m));
      }
    }
  CHECK(dsp::pp::peak_in_flight(dsp::pp::one_f_one_b(4, 16), 0) == 4);
  CHECK(dsp::pp::peak_in_flight(dsp::pp::one_f_one_b(4, 16), 0) < dsp::pp::peak_in_flight(dsp::pp::gpipe(4, 16), 0));
  // interleaved rank 0 of p=2 v=2 m=4: the 4 warmup forwards, then +1 -1 pairs, peak 5
  CHECK(dsp::pp::peak_in_flight(dsp::pp::interleaved_1f1b(2, 2, 4), 0) == 5);
  CHECK_THROWS_AS(dsp::pp::peak_in_flight(dsp::pp::gpipe(2, 2), 2), ConfigError);
}

TEST_CASE("schedule: theoretical bubble fraction") {
  CHECK(dsp::pp::theoretical_bubble_fraction(dsp::pp::one_f_one_b(4, 8)) == doctest::Approx(3.0 / 11.0));
  CHECK(dsp::pp::theoretical_bubble_fraction(dsp::pp::gpipe(4, 8)) == doctest::Approx(3.0 / 11.0));
  CHECK(dsp::pp::theoretical_bubble_fraction(dsp::pp::interleaved_1f1b(4, 2, 8)) == doctest::Approx(1.5 / 9.5));
  CHECK(dsp::pp::theoretical_bubble_fraction(dsp::pp::gpipe(1, 5)) == 0.0);
}

TEST_CASE("schedule: validate rejects a backward before its forward") {
  Schedule s = dsp::pp::gpipe(1, 2);
  s.ranks[0] = {{Op::Backward, 0, 0}, {Op::Forward, 0, 0}, {Op::Forward, 1, 0}, {Op::Backward, 1, 0}};
  CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("rank 0, action 0 (backward(mb 0, stage 0)) comes before"),
                       ConfigError);
  CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("forward(mb 0, stage 0)"), dsp::pp::ScheduleError);
}

TEST_CASE("schedule: validate rejects unmatched sends and receives") {
  {
    Schedule s = dsp::pp::gpipe(2, 2);
    erase(s, 0, {Op::SendActivation, 1, 0});
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s),
                         doctest::Contains("recv_activation(mb 1, stage 1)) has no matching send_activation(mb 1, stage 0) "
                                           "on rank 0 (unmatched receive)"),
                         ConfigError);
  }
  {
    Schedule s = dsp::pp::gpipe(2, 2);
    erase(s, 1, {Op::RecvActivation, 0, 1});
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("send_activation(mb 0, stage 0)) has no matching"),
                         ConfigError);
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("unmatched send"), ConfigError);
  }
  {
    Schedule s = dsp::pp::gpipe(2, 2);  // an extra send from the last stage
    s.ranks[1].push_back({Op::SendActivation, 1, 1});
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("stage 1 has no next stage"), ConfigError);
  }
  {
    Schedule s = dsp::pp::gpipe(2, 2);  // a duplicated send
    s.ranks[0].push_back({Op::SendActivation, 1, 0});
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("repeats action"), ConfigError);
  }
}

TEST_CASE("schedule: validate rejects misplaced actions") {
  {
    Schedule s = dsp::pp::gpipe(2, 2);  // stage 1 belongs to rank 1
    s.ranks[0].push_back({Op::Forward, 0, 1});
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("stage 1 runs on rank 1"), ConfigError);
  }
  {
    Schedule s = dsp::pp::gpipe(2, 2);
    s.ranks[0][0].micro_batch = 2;
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("micro-batch out of range"), ConfigError);
  }
  {
    Schedule s = dsp::pp::gpipe(2, 1);  // rank 1: recv_activation, forward, backward, send_grad
    std::swap(s.ranks[1][0], s.ranks[1][1]);
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("needs recv_activation(mb 0, stage 1) before it"),
                         ConfigError);
  }
  {
    Schedule s = dsp::pp::gpipe(2, 1);
    std::swap(s.ranks[1][2], s.ranks[1][3]);  // send_grad before its backward
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("must be followed by send_grad(mb 0, stage 1)"),
                         ConfigError);
  }
  {
    Schedule s = dsp::pp::gpipe(2, 2);
    erase(s, 1, {Op::Backward, 1, 1});
    erase(s, 1, {Op::SendGrad, 1, 1});
    erase(s, 0, {Op::RecvGrad, 1, 0});
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("backward(mb 1, stage 1) is missing"), ConfigError);
  }
}

TEST_CASE("schedule: validate rejects receives posted out of channel order") {
  Schedule s = dsp::pp::gpipe(2, 2);
  // rank 1 posts recv_activation mb 0, mb 1 up front (one ahead): swap them
  REQUIRE(s.ranks[1][0] == Action{Op::RecvActivation, 0, 1});
  REQUIRE(s.ranks[1][1] == Action{Op::RecvActivation, 1, 1});
  std::swap(s.ranks[1][0], s.ranks[1][1]);
  CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("channel rank 0 -> rank 1 (activations): message 0"),
                       ConfigError);
}

TEST_CASE("schedule: validate finds deadlocks by simulation") {
  {
    // rank 0 waits for the gradient of mb 0 before it sends the activation rank 1 waits for
    Schedule s{"hand-made", 2, 1, 1, {}};
    s.ranks = {{{Op::RecvGrad, 0, 0}, {Op::Forward, 0, 0}, {Op::Backward, 0, 0}, {Op::SendActivation, 0, 0}},
               {{Op::RecvActivation, 0, 1}, {Op::Forward, 0, 1}, {Op::Backward, 0, 1}, {Op::SendGrad, 0, 1}}};
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("deadlock"), ConfigError);
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s),
                         doctest::Contains("rank 0 waits at action 2 (backward(mb 0, stage 0)) for recv_grad(mb 0, stage 0)"),
                         ConfigError);
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s),
                         doctest::Contains("rank 1 waits at action 1 (forward(mb 0, stage 1))"), ConfigError);
  }
  {
    // Receives complete in posting order: p=3, m=1, rank 1 posts the gradient receive (from
    // rank 2, which first needs rank 1's activation) ahead of the activation receive.
    Schedule s = dsp::pp::one_f_one_b(3, 1);
    REQUIRE(s.ranks[1][0] == Action{Op::RecvActivation, 0, 1});
    REQUIRE(s.ranks[1][1] == Action{Op::RecvGrad, 0, 1});
    CHECK_NOTHROW(dsp::pp::validate(s));
    std::swap(s.ranks[1][0], s.ranks[1][1]);
    CHECK_THROWS_WITH_AS(dsp::pp::validate(s), doctest::Contains("its first pending receive recv_grad(mb 0, stage 1)"),
                         ConfigError);
  }
}

TEST_CASE("schedule: make_schedule rejects bad names and sizes") {
  CHECK_THROWS_WITH_AS(dsp::pp::make_schedule("zero-bubble", 2, 1, 4), doctest::Contains("gpipe, 1f1b, interleaved"),
                       ConfigError);
  CHECK_THROWS_WITH_AS(dsp::pp::make_schedule("interleaved", 4, 2, 6), doctest::Contains("m=6"), ConfigError);
  CHECK_THROWS_WITH_AS(dsp::pp::make_schedule("interleaved", 4, 2, 6), doctest::Contains("p=4"), ConfigError);
  CHECK_THROWS_WITH_AS(dsp::pp::make_schedule("1f1b", 4, 2, 8), doctest::Contains("v=2"), ConfigError);
  CHECK_THROWS_AS(dsp::pp::make_schedule("gpipe", 2, 3, 8), ConfigError);
  CHECK_THROWS_AS(dsp::pp::make_schedule("interleaved", 1, 2, 4), ConfigError);
  CHECK_THROWS_AS(dsp::pp::make_schedule("interleaved", 2, 1, 4), ConfigError);
  CHECK_THROWS_AS(dsp::pp::make_schedule("gpipe", 0, 1, 4), ConfigError);
  CHECK_THROWS_AS(dsp::pp::make_schedule("1f1b", 2, 1, 0), ConfigError);
}

TEST_CASE("schedule: to_string and to_table") {
  CHECK(dsp::pp::to_string({Op::Forward, 3, 1}) == "forward(mb 3, stage 1)");
  CHECK(dsp::pp::to_string({Op::SendActivation, 3, 1}) == "send_activation(mb 3, stage 1)");
  CHECK(dsp::pp::to_string({Op::RecvGrad, 0, 2}) == "recv_grad(mb 0, stage 2)");
  // forward 1 step, backward 2 ("B<mb>.<stage> ----"), free communication: the GPipe bubble
  // is (p - 1) / (m + p - 1) = 1/3 of the 9 steps.
  CHECK(dsp::pp::to_table(dsp::pp::gpipe(2, 2)) ==
        "gpipe: p=2 v=1 m=2, 9 steps, idle 33.3% (theory 33.3%)\n"
        "rank 0 | F0.0 F1.0                B0.0 ---- B1.0 ----\n"
        "rank 1 |      F0.1 F1.1 B0.1 ---- B1.1 ----\n");
  const std::string t = dsp::pp::to_table(dsp::pp::interleaved_1f1b(2, 2, 4));
  CHECK(t.rfind("interleaved: p=2 v=2 m=4,", 0) == 0);
  CHECK(t.find("rank 0 | F0.0 ") != std::string::npos);
  CHECK(t.find("rank 1 |") != std::string::npos);
  Schedule bad = dsp::pp::gpipe(2, 2);
  bad.ranks.pop_back();
  CHECK_THROWS_AS(dsp::pp::to_table(bad), ConfigError);
}

}  // namespace pp_schedule_test
