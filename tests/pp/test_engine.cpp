// pp::Engine: every schedule moves each micro-batch's activation forward through every stage
// and its gradient back, in the right order; a stage that throws ends every rank with its
// message; 1F1B holds fewer activations than GPipe (measured). The references are closed
// forms of the synthetic stages below, and the schedules' own peak_in_flight.
#include <doctest/doctest.h>

#include <map>
#include <mutex>
#include <stdexcept>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/policy.hpp"
#include "dsp/pp/engine.hpp"
#include "dsp/train/trainer.hpp"
#include "../train/small_model.hpp"

using namespace dsp;

namespace pp_engine_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

// Synthetic stages on boundary tensors [1, 2] = (value, micro-batch): forward on stage s adds
// s + 1 to the value; backward on stage s adds s to the gradient. So the last stage sees
// mb + S(S+1)/2 for micro-batch mb, and stage 0 gets back 1000 mb + S(S-1)/2.
struct Outcome {
  std::map<int, float> final_value, input_grad;  // by micro-batch
  std::map<int, int> last_flags;                 // by stage: backward calls with last == true
  std::map<int, int> last_flag_position_ok;      // by stage: 1 when last == true was its final backward
  std::vector<int> peak_in_flight;               // by pipeline rank
  int wrong = 0;                                 // tensors that arrived for the wrong micro-batch
};

Outcome run_synthetic(const pp::Schedule& schedule) {
  Outcome out;
  out.peak_in_flight.resize(static_cast<std::size_t>(schedule.pipeline_size));
  std::mutex mu;
  const int S = schedule.num_stages();
  comm::launch(schedule.pipeline_size, [&](comm::ThreadComm& world) {
    pp::Engine<comm::ThreadComm> engine(world, schedule, {1, 2});
    std::map<int, int> backwards_seen, last_seen_at;  // by stage
    pp::Engine<comm::ThreadComm>::Hooks hooks;
    hooks.forward = [&](int mb, int s, Tensor in) {
      if (s == 0) in = Tensor({1, 2}, {float(mb), float(mb)});
      std::lock_guard lk(mu);
      if (in[1] != float(mb)) ++out.wrong;
      in[0] += float(s + 1);
      if (s == S - 1) out.final_value[mb] = in[0];
      return in;
    };
    hooks.backward = [&](int mb, int s, Tensor dy, bool last) {
      if (s == S - 1) dy = Tensor({1, 2}, {1000.0f * float(mb), float(mb)});
      std::lock_guard lk(mu);
      if (dy[1] != float(mb)) ++out.wrong;
      dy[0] += float(s);
      ++backwards_seen[s];
      if (last) {
        ++out.last_flags[s];
        last_seen_at[s] = backwards_seen[s];
      }
      if (s == 0) out.input_grad[mb] = dy[0];
      return dy;
    };
    const auto stats = engine.run(hooks);
    std::lock_guard lk(mu);
    out.peak_in_flight[static_cast<std::size_t>(world.rank())] = stats.peak_in_flight;
    for (auto [s, at] : last_seen_at) out.last_flag_position_ok[s] = at == backwards_seen[s] ? 1 : 0;
  });
  return out;
}

}  // namespace

TEST_CASE("pipeline engine: every schedule carries each micro-batch through every stage and back") {
  for (const auto& schedule : {pp::gpipe(3, 5), pp::one_f_one_b(3, 5), pp::one_f_one_b(4, 2), pp::interleaved_1f1b(2, 2, 4),
                               pp::interleaved_1f1b(3, 2, 6), pp::one_f_one_b(1, 3)}) {
    CAPTURE(schedule.name);
    CAPTURE(schedule.pipeline_size);
    CAPTURE(schedule.micro_batches);
    const int S = schedule.num_stages(), m = schedule.micro_batches;
    const Outcome o = run_synthetic(schedule);
    CHECK(o.wrong == 0);
    REQUIRE(o.final_value.size() == static_cast<std::size_t>(m));
    REQUIRE(o.input_grad.size() == static_cast<std::size_t>(m));
    for (int mb = 0; mb < m; ++mb) {
      CHECK(o.final_value.at(mb) == float(mb + S * (S + 1) / 2));
      CHECK(o.input_grad.at(mb) == 1000.0f * float(mb) + float(S * (S - 1) / 2));
    }
    for (int s = 0; s < S; ++s) {
      CHECK(o.last_flags.at(s) == 1);
      CHECK(o.last_flag_position_ok.at(s) == 1);
    }
    for (int r = 0; r < schedule.pipeline_size; ++r) CHECK(o.peak_in_flight[static_cast<std::size_t>(r)] == pp::peak_in_flight(schedule, r));
  }
}

TEST_CASE("pipeline engine: a stage that throws mid-schedule ends every rank with its message") {
  // Rank 2 of 4 fails in its forward of micro-batch 3; the others are blocked in receives
  // that now never complete: the abort must end them (no hang) and launch rethrows rank 2's error.
  CHECK_THROWS_WITH_AS(comm::launch(4,
                                    [](comm::ThreadComm& world) {
                                      pp::Engine<comm::ThreadComm> engine(world, pp::one_f_one_b(4, 8), {1, 2});
                                      pp::Engine<comm::ThreadComm>::Hooks hooks;
                                      hooks.forward = [&](int mb, int s, Tensor in) {
                                        if (s == 2 && mb == 3) throw InputError("stage 2 failed on micro-batch 3");
                                        return s == 0 ? Tensor({1, 2}) : in;
                                      };
                                      hooks.backward = [](int, int, Tensor dy, bool) { return dy.empty() ? Tensor({1, 2}) : dy; };
                                      engine.run(hooks);
                                    }),
                       "stage 2 failed on micro-batch 3", InputError);
}

TEST_CASE("pipeline engine: refuses a schedule for another pipeline size") {
  comm::launch(2, [](comm::ThreadComm& world) {
    CHECK_THROWS_WITH_AS(pp::Engine<comm::ThreadComm>(world, pp::one_f_one_b(4, 4), {1, 2}),
                         "schedule for 4 pipeline ranks run on a pipeline group of 2", ConfigError);
  });
}

TEST_CASE("pipeline engine: 1F1B holds fewer activations than GPipe at p=4, m=16 (measured bytes)") {
  auto config = test::small_model(true);
  config.num_layers = 4;
  const auto& data = test::shakespeare(config.seq_length);
  std::map<std::string, std::vector<std::int64_t>> bytes;  // schedule -> per pipeline rank
  std::map<std::string, std::vector<int>> in_flight;
  for (const std::string name : {"gpipe", "1f1b"}) {
    train::TrainConfig tc;
    tc.micro_batch_size = 1;
    tc.global_batch_size = 16;  // m = 16 micro-batches
    tc.pipeline.schedule = name;
    bytes[name].resize(4);
    in_flight[name].resize(4);
    std::mutex mu;
    comm::launch(4, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.pipeline = 4});
      train::Trainer<P> trainer(config, tc, mesh, data);
      const auto r = trainer.train_step();
      std::lock_guard lk(mu);
      bytes[name][static_cast<std::size_t>(mesh.pp_rank())] = r.peak_activation_bytes;
      in_flight[name][static_cast<std::size_t>(mesh.pp_rank())] = r.peak_in_flight;
    });
  }
  CHECK(in_flight["gpipe"] == std::vector<int>{16, 16, 16, 16});
  CHECK(in_flight["1f1b"] == std::vector<int>{4, 3, 2, 1});
  // Stage 0 of GPipe stashes 16 micro-batches, of 1F1B 4: well under half the bytes.
  for (std::size_t r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(bytes["1f1b"][r] > 0);
    CHECK(2 * bytes["1f1b"][r] < bytes["gpipe"][r]);
  }
}

}  // namespace pp_engine_test
