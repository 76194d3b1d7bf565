// The overlap of data-parallel gradient reduction with backward, as the trace shows it: at
// DP=2 with --overlap-grad-reduce, bucket all-reduces run on the DP communicator's worker
// track while the same rank's backward span is still open; without overlap none starts
// before backward ended.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/core/trace.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/trainer.hpp"
#include "small_model.hpp"

using namespace dsp;

namespace train_trace_overlap_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

struct Overlap {
  int backward_spans = 0;      // "backward" spans, all ranks and steps
  int bucket_reductions = 0;   // "all_reduce" spans on a worker track (not "main")
  int overlapped = 0;          // backward spans during which such an all-reduce of the same rank started
};

// Trains the small model with 4 layers (much backward left after the first bucket starts) at
// TP=1, DP=2 for 3 steps, every step traced, and counts the overlap in the recorded events.
Overlap traced_run(bool overlap) {
  auto config = test::small_model();
  config.num_layers = 4;
  const auto& data = test::shakespeare(config.seq_length);
  train::TrainConfig tc;
  tc.micro_batch_size = 2;
  tc.global_batch_size = 4;  // one micro-batch per DP rank: every backward is a last micro-batch
  tc.train_iters = 3;
  // 2 KiB buckets: several buckets, the first ready early in backward (the output layer's)
  tc.ddp = {.bucket_size_bytes = 2048, .overlap_grad_reduce = overlap};
  trace::clear();
  comm::launch(2, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = 1});
    train::Trainer<P> trainer(config, tc, mesh, data);
    trace::start();
    for (int s = 0; s < 3; ++s) trainer.train_step();
    trace::stop();
  });
  const auto evs = trace::events();
  trace::clear();
  Overlap out;
  for (const auto& e : evs) out.bucket_reductions += e.name == "all_reduce" && e.track != "main";
  for (const auto& b : evs) {
    if (b.name != "backward") continue;
    ++out.backward_spans;
    out.overlapped += std::any_of(evs.begin(), evs.end(), [&](const trace::Event& a) {
      return a.name == "all_reduce" && a.track != "main" && a.rank == b.rank && a.begin_us >= b.begin_us &&
             a.begin_us < b.end_us;
    });
  }
  return out;
}

}  // namespace

TEST_CASE("the trace of a DP=2 run shows bucket all-reduces running during backward, only with overlap") {
  // At least one overlapped backward in one of up to 5 runs: a backward of this model takes
  // well under a millisecond, and on a busy machine (CI's build beside the tests) a rank's worker
  // can be descheduled until every backward of a run has ended (seen once, with a build running).
  // Without overlap no run may show one.
  Overlap on;
  for (int run = 0; run < 5 && on.overlapped == 0; ++run) {
    on = traced_run(true);
    REQUIRE(on.backward_spans == 2 * 3);       // 2 ranks x 3 steps
    REQUIRE(on.bucket_reductions >= 2 * 3 * 4);  // several buckets per rank and step
  }
  CHECK(on.overlapped >= 1);

  const Overlap off = traced_run(false);
  CHECK(off.backward_spans == 2 * 3);
  CHECK(off.bucket_reductions == on.bucket_reductions);  // the same buckets, reduced after backward
  CHECK(off.overlapped == 0);
}

}  // namespace train_trace_overlap_test
