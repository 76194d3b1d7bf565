// DynamicLossScaler against sequences traced by hand from Megatron-LM's DynamicGradScaler
// rules (hysteresis restored only on growth; clamps at min and max), its config checks, the
// overflow check and the all-rank agreement on it, and the checkpoint state round trip.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/comm/launch.hpp"
#include "dsp/precision/loss_scaler.hpp"

using namespace dsp;

namespace precision_loss_scaler_test {
using precision::DynamicLossScaler;
using precision::LossScalerConfig;

namespace {

// One update and the state expected after it.
struct Step {
  bool found_inf;
  float scale;
  std::int64_t growth_tracker;
  int hysteresis_tracker;
  std::int64_t skipped_steps;
};

void run_steps(DynamicLossScaler& s, const std::vector<Step>& steps) {
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const Step& e = steps[i];
    s.update(e.found_inf);
    INFO("step ", i + 1, " found_inf=", e.found_inf);
    CHECK(s.scale() == e.scale);
    CHECK(s.inv_scale() == 1.0f / e.scale);  // powers of 2: exact
    CHECK(s.growth_tracker() == e.growth_tracker);
    CHECK(s.hysteresis_tracker() == e.hysteresis_tracker);
    CHECK(s.skipped_steps() == e.skipped_steps);
  }
}

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

}  // namespace

TEST_CASE("defaults: 2^16 initial, [1, 2^24], x2 / x0.5, window 1000, hysteresis 2") {
  const LossScalerConfig c;
  CHECK(c.initial_scale == 65536.0f);
  CHECK(c.min_scale == 1.0f);
  CHECK(c.max_scale == 16777216.0f);
  CHECK(c.growth_factor == 2.0f);
  CHECK(c.backoff_factor == 0.5f);
  CHECK(c.growth_interval == 1000);
  CHECK(c.hysteresis == 2);
  CHECK_NOTHROW(c.validate());
  const DynamicLossScaler s(c);
  CHECK(s.scale() == 65536.0f);
  CHECK(s.inv_scale() == 1.0f / 65536.0f);
  CHECK(s.growth_tracker() == 0);
  CHECK(s.hysteresis_tracker() == 2);
  CHECK(s.skipped_steps() == 0);
}

TEST_CASE("hand-traced scales: growth, hysteresis kept across clean steps, backoff to min") {
  // initial 8, x2 every 3 clean steps, x0.5 once hysteresis (2) is used up, min 1, max 32.
  DynamicLossScaler s({.initial_scale = 8, .min_scale = 1, .max_scale = 32, .growth_factor = 2,
                       .backoff_factor = 0.5f, .growth_interval = 3, .hysteresis = 2});
  REQUIRE(s.scale() == 8.0f);
  REQUIRE(s.hysteresis_tracker() == 2);
  const bool F = false, T = true;
  run_steps(s, {
                   // found_inf, scale, growth_tracker, hysteresis_tracker, skipped
                   {F, 8, 1, 2, 0},
                   {F, 8, 2, 2, 0},
                   {F, 16, 0, 2, 0},  // 3rd clean step: grow, hysteresis restored
                   {T, 16, 0, 1, 1},  // first overflow absorbed by hysteresis
                   {T, 8, 0, 0, 2},   // second: back off
                   {F, 8, 1, 0, 2},   // clean steps do not restore hysteresis...
                   {F, 8, 2, 0, 2},
                   {T, 4, 0, -1, 3},  // ...so this lone overflow backs off at once, resets growth
                   {F, 4, 1, -1, 3},
                   {F, 4, 2, -1, 3},
                   {F, 8, 0, 2, 3},   // growth restores hysteresis to 2
                   {T, 8, 0, 1, 4},
                   {F, 8, 1, 1, 4},
                   {T, 4, 0, 0, 5},   // not in a row, still the second overflow since growth
                   {T, 2, 0, -1, 6},
                   {T, 1, 0, -2, 7},
                   {T, 1, 0, -3, 8},  // 0.5 clamped to min 1
               });
}

TEST_CASE("hand-traced clamps at max and min with non-power-of-2 factors") {
  // initial 12, x3 after every clean step (interval 1), hysteresis 1, min 10, max 32.
  DynamicLossScaler s({.initial_scale = 12, .min_scale = 10, .max_scale = 32, .growth_factor = 3,
                       .backoff_factor = 0.5f, .growth_interval = 1, .hysteresis = 1});
  const bool F = false, T = true;
  const std::vector<Step> steps{
      {F, 32, 0, 1, 0},   // 36 clamped to 32
      {F, 32, 0, 1, 0},   // stays at max
      {T, 16, 0, 0, 1},   // hysteresis 1: the first overflow backs off
      {T, 10, 0, -1, 2},  // 8 clamped to min 10
      {T, 10, 0, -2, 3},
      {F, 30, 0, 1, 3},   // 10 x 3, below max
      {F, 32, 0, 1, 3},   // 90 clamped to 32
  };
  for (std::size_t i = 0; i < steps.size(); ++i) {
    s.update(steps[i].found_inf);
    INFO("step ", i + 1);
    CHECK(s.scale() == steps[i].scale);
    CHECK(s.growth_tracker() == steps[i].growth_tracker);
    CHECK(s.hysteresis_tracker() == steps[i].hysteresis_tracker);
    CHECK(s.skipped_steps() == steps[i].skipped_steps);
  }
}

TEST_CASE("validate names the flag and the value") {
  using doctest::Contains;
  auto with = [](auto edit) {
    LossScalerConfig c{.initial_scale = 8, .min_scale = 1, .max_scale = 32};
    edit(c);
    return c;
  };
  CHECK_NOTHROW(with([](auto&) {}).validate());
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.initial_scale = 0; }).validate(),
                       Contains("--initial-loss-scale must be finite and > 0, got 0"), ConfigError);
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.initial_scale = -4; }).validate(), Contains("--initial-loss-scale"),
                       ConfigError);
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.initial_scale = kInf; }).validate(),
                       Contains("--initial-loss-scale must be finite"), ConfigError);
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.initial_scale = kNaN; }).validate(),
                       Contains("--initial-loss-scale must be finite"), ConfigError);
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.min_scale = 0; }).validate(),
                       Contains("--min-loss-scale must be > 0, got 0"), ConfigError);
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.min_scale = 64; }).validate(),
                       Contains("--min-loss-scale (64) must be <= --max-loss-scale (32)"), ConfigError);
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.max_scale = kInf; }).validate(), Contains("--max-loss-scale"),
                       ConfigError);
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.initial_scale = 64; }).validate(),
                       Contains("--initial-loss-scale (64) must be in [--min-loss-scale, --max-loss-scale] = [1, 32]"),
                       ConfigError);
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.initial_scale = 0.5f; }).validate(),
                       Contains("--initial-loss-scale (0.5) must be in"), ConfigError);
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.growth_factor = 1; }).validate(),
                       Contains("--loss-scale-growth-factor must be > 1, got 1"), ConfigError);
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.backoff_factor = 1; }).validate(),
                       Contains("--loss-scale-backoff-factor must be in (0, 1), got 1"), ConfigError);
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.backoff_factor = 0; }).validate(),
                       Contains("--loss-scale-backoff-factor must be in (0, 1), got 0"), ConfigError);
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.growth_interval = 0; }).validate(),
                       Contains("--loss-scale-window must be >= 1 step, got 0"), ConfigError);
  CHECK_THROWS_WITH_AS(with([](auto& c) { c.hysteresis = 0; }).validate(), Contains("--hysteresis must be >= 1, got 0"),
                       ConfigError);
  // the constructor validates
  CHECK_THROWS_WITH_AS(DynamicLossScaler(with([](auto& c) { c.hysteresis = -1; })), Contains("--hysteresis"),
                       ConfigError);
}

TEST_CASE("has_inf_or_nan finds +inf, -inf and NaN anywhere, not large finite values") {
  const float big = std::numeric_limits<float>::max();
  std::vector<float> v{0.0f, -1.0f, big, -big, 65504.0f * 65536.0f, std::numeric_limits<float>::denorm_min()};
  CHECK_FALSE(precision::has_inf_or_nan(v));
  CHECK_FALSE(precision::has_inf_or_nan(std::span<const float>{}));
  for (float bad : {kInf, -kInf, kNaN, big * 2.0f})
    for (std::size_t at : {std::size_t{0}, std::size_t{3}, v.size() - 1}) {
      auto w = v;
      w[at] = bad;
      INFO("value ", bad, " at ", at);
      CHECK(precision::has_inf_or_nan(w));
    }
}

TEST_CASE("any_rank: one rank's overflow is seen by all four, none by none") {
  for (int flagged : {-1, 0, 2, 3}) {
    std::array<int, 4> seen{-1, -1, -1, -1};
    comm::launch(4, [&](comm::ThreadComm& world) {
      seen[static_cast<std::size_t>(world.rank())] = precision::any_rank(world, world.rank() == flagged);
    });
    INFO("flagged rank ", flagged);
    for (int r = 0; r < 4; ++r) CHECK(seen[static_cast<std::size_t>(r)] == (flagged >= 0 ? 1 : 0));
  }
}

TEST_CASE("any_rank over two orthogonal groups in turn makes the whole world agree") {
  // Ranks {0,1} {2,3} (say TP), then {0,2} {1,3} (say DP); only rank 2 overflows.
  std::array<int, 4> after_first{-1, -1, -1, -1}, after_both{-1, -1, -1, -1};
  comm::launch(4, [&](comm::ThreadComm& world) {
    const int r = world.rank();
    auto tp = world.split(r / 2, r);
    auto dp = world.split(r % 2, r);
    const bool a = precision::any_rank(tp, r == 2);
    after_first[static_cast<std::size_t>(r)] = a;
    after_both[static_cast<std::size_t>(r)] = precision::any_rank(dp, a);
  });
  CHECK(after_first == std::array<int, 4>{0, 0, 1, 1});
  CHECK(after_both == std::array<int, 4>{1, 1, 1, 1});
}

TEST_CASE("state round trip through json resumes the same sequence") {
  const LossScalerConfig c{.initial_scale = 8, .min_scale = 1, .max_scale = 32, .growth_interval = 3};
  const std::vector<bool> before{false, false, false, true, false, true, false, false};
  const std::vector<bool> after{true, false, false, false, true, true, true, false};
  DynamicLossScaler a(c);
  for (bool f : before) a.update(f);
  // 8 -> 16 (growth), T absorbed (h 1), F, T backs off to 8 (h 0, skipped 2), F F: g 2
  REQUIRE(a.scale() == 8.0f);
  REQUIRE(a.growth_tracker() == 2);
  REQUIRE(a.hysteresis_tracker() == 0);
  REQUIRE(a.skipped_steps() == 2);

  const nlohmann::json j = a.state();
  CHECK(j.at("scale").get<float>() == 8.0f);
  CHECK(j.at("growth_tracker").get<std::int64_t>() == 2);
  CHECK(j.at("hysteresis_tracker").get<int>() == 0);
  CHECK(j.at("skipped_steps").get<std::int64_t>() == 2);
  const auto restored = nlohmann::json::parse(j.dump()).get<DynamicLossScaler::State>();

  DynamicLossScaler b(c);
  b.set_state(restored);
  for (bool f : after) {
    a.update(f);
    b.update(f);
    CHECK(b.scale() == a.scale());
    CHECK(b.growth_tracker() == a.growth_tracker());
    CHECK(b.hysteresis_tracker() == a.hysteresis_tracker());
    CHECK(b.skipped_steps() == a.skipped_steps());
  }
  CHECK(b.skipped_steps() == 6);

  using doctest::Contains;
  CHECK_THROWS_WITH_AS(b.set_state({.scale = 0}), Contains("scale must be finite and > 0"), CheckpointError);
  CHECK_THROWS_WITH_AS(b.set_state({.scale = kNaN}), Contains("scale"), CheckpointError);
  CHECK_THROWS_WITH_AS(b.set_state({.scale = 4, .growth_tracker = -1}), Contains("growth_tracker"), CheckpointError);
}

}  // namespace precision_loss_scaler_test
