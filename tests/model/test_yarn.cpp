// YaRN frequencies, attention factor and MLA softmax scale (model/yarn.hpp) and the interleaved
// RoPE op (backend/host/rope_interleaved.hpp) against transformers 5.25 (tests/fixtures/mla,
// tools/write_mla_fixture.py): ROPE_INIT_FUNCTIONS["yarn"], yarn_apply_mscale and DeepseekV2's
// apply_rotary_emb (complex multiplication of interleaved pairs).
//
// Tolerances: transformers computes inv_freq in fp32 (relative rounding ~6e-8; 1e-6 allowed),
// the factors in Python doubles (1e-12). The rotation: transformers forms the angle
// position * inv_freq in fp32, so at position p its angle is off by up to ~p * inv_freq * 2^-24
// radians (163839 rad at the last position: ~1e-2); we compute it in fp64. The test allows
// 1e-5 + 2 |x| factor * p * inv_freq[0] * 2^-24 per element, i.e. 1e-5 up to position ~30.
#include <doctest/doctest.h>

#include <cmath>

#include "dsp/backend/host.hpp"
#include "dsp/backend/host/rope_interleaved.hpp"
#include "dsp/model/config.hpp"
#include "dsp/model/yarn.hpp"
#include "mla_fixture.hpp"

using namespace dsp;

namespace model_yarn_test {

namespace {
model::RopeScaling scaling(const nlohmann::json& p) {
  return {.type = p.at("rope_type").get<std::string>(),
          .factor = p.at("factor").get<double>(),
          .original_max_position_embeddings = p.at("original_max_position_embeddings").get<std::int64_t>(),
          .beta_fast = p.at("beta_fast").get<double>(),
          .beta_slow = p.at("beta_slow").get<double>(),
          .mscale = p.at("mscale").get<double>(),
          .mscale_all_dim = p.at("mscale_all_dim").get<double>()};
}
}  // namespace

TEST_CASE("YaRN inverse frequencies, attention factor and softmax scale equal transformers'") {
  const auto& f = test::mla_fixture().at("rope");
  const auto s = scaling(f.at("rope_parameters"));
  const auto dim = f.at("dim").get<std::int64_t>();
  const model::RopeFrequencies freq = model::rope_frequencies(dim, f.at("rope_parameters").at("rope_theta").get<double>(), s);
  const auto expected = f.at("inv_freq").get<std::vector<double>>();
  REQUIRE(freq.inv_freq.size() == expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    CAPTURE(i);
    CHECK(std::abs(freq.inv_freq[i] - expected[i]) <= 1e-6 * expected[i]);
  }
  // the ramp is non-trivial here: pair 0 extrapolates, pair 3 interpolates, pair 2 is between
  CHECK(freq.inv_freq[0] == doctest::Approx(1.0));
  CHECK(freq.inv_freq[3] == doctest::Approx(std::pow(10000.0, -0.75) / 40.0));
  CHECK(std::abs(freq.attention_factor - f.at("attention_factor").get<double>()) < 1e-12);
  CHECK(freq.attention_factor != doctest::Approx(1.0));  // mscale != mscale_all_dim
  CHECK(std::abs(model::mla_softmax_scale(16, s) - f.at("softmax_scale_qk16").get<double>()) < 1e-12);
  // plain RoPE: theta^(-2i/dim), factor 1, scale 1/sqrt(qk)
  const model::RopeFrequencies plain = model::rope_frequencies(8, 10000.0, {});
  CHECK(plain.inv_freq[2] == doctest::Approx(0.01));
  CHECK(plain.attention_factor == 1.0);
  CHECK(model::mla_softmax_scale(16, {}) == 0.25);
  // DeepSeek-V3's configuration: factor 40, mscale = mscale_all_dim = 1 -> attention factor 1,
  // softmax scale (0.1 ln 40 + 1)^2 / sqrt(192)
  const model::RopeScaling v3{.type = "yarn", .factor = 40, .original_max_position_embeddings = 4096,
                              .beta_fast = 32, .beta_slow = 1, .mscale = 1, .mscale_all_dim = 1};
  CHECK(model::rope_frequencies(64, 10000.0, v3).attention_factor == 1.0);
  const double m = 0.1 * std::log(40.0) + 1.0;
  CHECK(model::mla_softmax_scale(192, v3) == doctest::Approx(m * m / std::sqrt(192.0)).epsilon(1e-12));
}

TEST_CASE("RoPE on interleaved pairs with the YaRN factor equals transformers' DeepseekV2 apply_rotary_emb") {
  const auto& f = test::mla_fixture().at("rope");
  const auto dim = f.at("dim").get<std::int64_t>(), heads = f.at("heads").get<std::int64_t>();
  const auto positions = f.at("positions").get<std::vector<std::int32_t>>();
  const auto tokens = static_cast<std::int64_t>(positions.size());
  const auto inv_freq = f.at("inv_freq").get<std::vector<double>>();
  const double factor = f.at("attention_factor").get<double>();
  const Tensor x = test::fixture_tensor(f.at("x"), {tokens, heads, dim});
  const Tensor y = test::fixture_tensor(f.at("y"), {tokens, heads, dim});
  Tensor r = x;
  backend::rope_interleaved_forward(backend::Host{}, {r.data(), tokens, heads, dim, heads * dim, dim}, positions.data(),
                                    inv_freq.data(), factor);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double tol = 1e-5 + 2.0 * 4.0 * factor * positions[t] * inv_freq[0] * std::ldexp(1.0, -24);
    for (std::int64_t i = 0; i < heads * dim; ++i) {
      CAPTURE(t);
      CAPTURE(i);
      CHECK(std::abs(r[t * heads * dim + i] - y[t * heads * dim + i]) <= tol);
    }
  }
  // backward is the transpose: <R x, g> = <x, R^T g>, and R^T R = factor^2
  Tensor g = y, back = y;
  backend::rope_interleaved_backward(backend::Host{}, {back.data(), tokens, heads, dim, heads * dim, dim},
                                     positions.data(), inv_freq.data(), factor);
  double lhs = 0, rhs = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    lhs += double(r[i]) * g[i];
    rhs += double(x[i]) * back[i];
  }
  CHECK(lhs == doctest::Approx(rhs).epsilon(1e-5));
}

TEST_CASE("rope_scaling round-trips through config.json and is read from rope_parameters") {
  model::ModelConfig c;
  c.kv_lora_rank = 16;
  c.qk_nope_head_dim = 8;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 12;
  c.q_lora_rank = 0;
  c.rope_scaling = {.type = "yarn", .factor = 40, .original_max_position_embeddings = 4096, .beta_fast = 32,
                    .beta_slow = 1, .mscale = 0.707, .mscale_all_dim = 0.707};
  const nlohmann::json j = c.to_hf_json();
  CHECK(j.at("q_lora_rank").is_null());
  CHECK(model::ModelConfig::from_hf_json(j) == c);
  // transformers 5: rope_theta and the scaling under rope_parameters with rope_type
  nlohmann::json t5 = j;
  t5.erase("rope_scaling");
  t5.erase("rope_theta");
  t5["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 40.0},
                           {"original_max_position_embeddings", 4096}, {"beta_fast", 32}, {"beta_slow", 1},
                           {"mscale", 0.707}, {"mscale_all_dim", 0.707}};
  CHECK(model::ModelConfig::from_hf_json(t5) == c);
  t5["rope_parameters"]["rope_type"] = "longrope";
  CHECK_THROWS_AS(model::ModelConfig::from_hf_json(t5), ConfigError);
  c.rope_scaling.beta_slow = 64;
  CHECK_THROWS_AS(c.validate(1), ConfigError);
}

}  // namespace model_yarn_test
