// Bad configurations fail before any work with a message that names the numbers.
#include <doctest/doctest.h>

#include <cmath>
#include <initializer_list>
#include <string>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/policy.hpp"
#include "dsp/model/causal_lm.hpp"
#include "dsp/train/trainer.hpp"
#include "small_model.hpp"

using namespace dsp;

namespace train_bad_input_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {
model::ModelConfig config() {
  return {.vocab_size = 256, .hidden_size = 48, .num_layers = 1, .num_attention_heads = 6, .num_query_groups = 3,
          .ffn_hidden_size = 96, .seq_length = 16};
}

// Runs body on `world` ranks and returns the ConfigError's message (empty if none).
template <class Body>
std::string config_error(int world, Body body) {
  try {
    comm::launch(world, body);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return {};
}

// Builds a model at (world, tp) and returns the error message (empty if none).
std::string build(const model::ModelConfig& c, int world, int tp) {
  return config_error(world, [&](comm::ThreadComm& w) {
    DeviceMesh mesh(w, ParallelLayout{.tensor = tp});
    model::CausalLM<P> m(c, mesh, 1);
  });
}
}  // namespace

TEST_CASE("a layout that does not divide the world size names both numbers") {
  CHECK(build(config(), 3, 2) == "world size 3 is not divisible by tensor-model-parallel-size x "
                                 "pipeline-model-parallel-size = 2 x 1 = 2");
}

TEST_CASE("model sizes that do not divide by TP name the size and the TP degree") {
  CHECK(build(config(), 3, 3) == "");  // 48 hidden, 6 heads, 3 groups, 96 ffn all divide by 3
  auto c = config();
  c.hidden_size = 50;  // not divisible by 6 heads
  CHECK(build(c, 1, 1) == "hidden size (50) is not divisible by number of attention heads (6)");
  c = config();
  c.hidden_size = 12;  // 6 heads of 2; TP 8
  c.num_query_groups = 6;
  CHECK(build(c, 8, 8) == "hidden size (12) is not divisible by tensor-model-parallel-size (8)");
  c = config();
  c.ffn_hidden_size = 98;
  CHECK(build(c, 3, 3) == "ffn hidden size (98) is not divisible by tensor-model-parallel-size (3)");
  c = config();
  c.num_attention_heads = 12;  // head dim 4; 3 query groups on TP 2: neither divides the other
  CHECK(build(c, 2, 2) == "number of query groups (3) and tensor-model-parallel-size (2) must divide one another (K/V heads are split, or replicated when fewer than TP)");
}

TEST_CASE("heads not divisible by TP") {
  auto c = config();
  c.num_query_groups = 6;
  CHECK(build(c, 4, 4) == "number of attention heads (6) is not divisible by tensor-model-parallel-size (4)");
}

TEST_CASE("a missing data file is an InputError naming the file") {
  CHECK_THROWS_WITH_AS(train::TokenDataset::from_file("/nonexistent/corpus.txt", 16),
                       "data file '/nonexistent/corpus.txt' cannot be opened (missing?)", InputError);
}

TEST_CASE("a global batch that micro-batch x DP does not divide, or a DP size below 1, names the numbers") {
  CHECK_THROWS_WITH_AS(dp::DataSampler(100, 3, 8, 2, 0, 1),
                       "global batch size (8) is not divisible by micro batch size x data-parallel size = 3 x 2 = 6",
                       ConfigError);
  CHECK_THROWS_WITH_AS(dp::DataSampler(100, 2, 8, 0, 0, 1),
                       "data-parallel rank 0 of size 0: the size must be >= 1 and the rank in [0, size)", ConfigError);
  CHECK_THROWS_AS(dp::DataSampler(100, 2, 8, 2, 2, 1), ConfigError);
}

TEST_CASE("a TrainConfig value out of its range names the flag and the value, before any work") {
  const auto& data = test::shakespeare(config().seq_length);
  // The Trainer's error for tc, or empty when it builds.
  const auto trainer_error = [&](const train::TrainConfig& tc) {
    return config_error(1, [&](comm::ThreadComm& w) {
      DeviceMesh mesh(w, ParallelLayout{});
      train::Trainer<P> trainer(config(), tc, mesh, data);
    });
  };
  train::TrainConfig good;
  good.micro_batch_size = 2;
  good.global_batch_size = 4;
  good.train_iters = 3;
  CHECK(trainer_error(good) == "");
  struct Case {
    void (*change)(train::TrainConfig&);
    std::string message;
  };
  for (const Case& c : std::initializer_list<Case>{
           {[](train::TrainConfig& t) { t.micro_batch_size = 0; }, "--micro-batch-size must be >= 1, got 0"},
           {[](train::TrainConfig& t) { t.train_iters = -3; }, "--train-iters must be >= 1, got -3"},
           {[](train::TrainConfig& t) { t.eval_iters = 0; }, "--eval-iters must be >= 1, got 0"},
           {[](train::TrainConfig& t) { t.lr_warmup_iters = -1; }, "--lr-warmup-iters must be >= 0, got -1"},
           {[](train::TrainConfig& t) { t.lr = -1.0f; }, "--lr must be >= 0, got -1"},
           {[](train::TrainConfig& t) { t.clip_grad = std::nanf(""); }, "--clip-grad must be >= 0, got nan"},
           {[](train::TrainConfig& t) { t.adam.beta2 = 1.0f; }, "--adam-beta2 must be in [0, 1), got 1"},
           {[](train::TrainConfig& t) { t.adam.eps = 0.0f; }, "--adam-eps must be > 0, got 0"},
       }) {
    train::TrainConfig tc = good;
    c.change(tc);
    CHECK(trainer_error(tc) == c.message);
  }
}

}  // namespace train_bad_input_test
