// DataSampler: every DP rank gets the same number of micro-batches, no window twice in an
// epoch, the global batch is the same for every DP size, the state resumes exactly, and
// without shuffling the windows come in order.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <vector>

#include "dsp/dp/data_sampler.hpp"

namespace dp_data_sampler_test {

using dsp::dp::DataSampler;

TEST_CASE("an epoch hands out distinct windows, the same number to every DP rank") {
  const std::int64_t windows = 103, micro = 2, global = 12;  // 103 = 8 global batches + 7 left over
  for (int dp : {1, 2, 3, 6}) {
    CAPTURE(dp);
    std::vector<DataSampler> ranks;
    for (int r = 0; r < dp; ++r) ranks.emplace_back(windows, micro, global, dp, r, 42);
    std::set<std::int64_t> seen;
    for (int step = 0; step < 8; ++step)  // one epoch: 8 x 12 = 96 windows
      for (auto& s : ranks) {
        const auto mbs = s.next_global_batch();
        CHECK(static_cast<std::int64_t>(mbs.size()) == global / (micro * dp));
        for (const auto& mb : mbs) {
          CHECK(static_cast<std::int64_t>(mb.size()) == micro);
          for (auto w : mb) CHECK(seen.insert(w).second);  // never twice in the epoch
        }
      }
    CHECK(seen.size() == 96);
    CHECK(ranks[0].state().epoch == 0);
    ranks[0].next_global_batch();  // the 7 left over are dropped: a new epoch starts
    CHECK(ranks[0].state().epoch == 1);
  }
}

TEST_CASE("the global batch is the same set of windows for every DP size") {
  auto global_batch = [](int dp) {
    std::set<std::int64_t> all;
    for (int r = 0; r < dp; ++r) {
      DataSampler s(50, 2, 8, dp, r, 7);
      s.next_global_batch();
      for (const auto& mb : s.next_global_batch()) all.insert(mb.begin(), mb.end());
    }
    return all;
  };
  CHECK(global_batch(1) == global_batch(2));
  CHECK(global_batch(1) == global_batch(4));
  CHECK(global_batch(1).size() == 8);
}

TEST_CASE("restoring the state continues the same sequence") {
  DataSampler a(40, 1, 4, 1, 0, 3), b(40, 1, 4, 1, 0, 3);
  for (int i = 0; i < 13; ++i) a.next_global_batch();  // crosses an epoch boundary (10 per epoch)
  b.set_state(a.state());
  for (int i = 0; i < 5; ++i) CHECK(a.next_global_batch() == b.next_global_batch());
}

TEST_CASE("without shuffling the windows are read in order, as Megatron's sampler reads them") {
  // 26 windows, global batch 8 = micro 2 x DP 2 x 2 steps: epochs of 3 batches (2 windows dropped)
  for (int r = 0; r < 2; ++r) {
    DataSampler s(26, 2, 8, 2, r, 99, /*shuffle=*/false);
    for (std::int64_t epoch = 0; epoch < 2; ++epoch)
      for (std::int64_t b = 0; b < 3; ++b) {
        const auto mbs = s.next_global_batch();
        REQUIRE(mbs.size() == 2);
        for (std::int64_t m = 0; m < 2; ++m) {  // Megatron: rank r takes [r * micro, (r + 1) * micro) of each chunk
          const std::int64_t first = b * 8 + (m * 2 + r) * 2;
          CHECK(mbs[static_cast<std::size_t>(m)] == std::vector<std::int64_t>{first, first + 1});
        }
      }
  }
}

}  // namespace dp_data_sampler_test
