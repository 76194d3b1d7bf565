// Consumer of the installed package: trains the same small model for 3 steps on tiny
// Shakespeare (argv[1]) at TP1 and at TP2 x DP2 and checks that the losses agree to 1e-5
// relative (only the order of the tensor- and data-parallel sums differs; tests/train's
// layout-invariance test holds every layout to the same bound) and that training lowers the
// loss. Exit status 0 when both hold.
#include <dsp/dsp.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

using P = dsp::Policy<dsp::backend::Host, dsp::comm::ThreadComm>;

namespace {

std::vector<double> train(const dsp::train::TokenDataset& data, int world_size, int tp) {
  const dsp::model::ModelConfig config{.hidden_size = 32, .num_layers = 2, .num_attention_heads = 4,
                                       .num_query_groups = 2, .ffn_hidden_size = 64, .seq_length = 32};
  const dsp::train::TrainConfig tc{.micro_batch_size = 2, .global_batch_size = 4, .train_iters = 3, .lr = 3e-3f};
  std::vector<double> losses;
  dsp::comm::launch(world_size, [&](dsp::comm::ThreadComm& world) {
    dsp::DeviceMesh mesh(world, dsp::ParallelLayout{.tensor = tp});
    dsp::train::Trainer<P> trainer(config, tc, mesh, data);
    for (int i = 0; i < tc.train_iters; ++i) {
      const double loss = trainer.train_step().loss;
      if (world.rank() == 0) losses.push_back(loss);
    }
  });
  return losses;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DATA_FILE (data/tinyshakespeare.txt)\n", argv[0]);
    return 2;
  }
  const auto data = dsp::train::TokenDataset::from_file(argv[1], 32);
  const std::vector<double> one = train(data, 1, 1), split = train(data, 4, 2);
  bool ok = one.back() < one.front();
  for (std::size_t i = 0; i < one.size(); ++i) {
    const double rel = std::abs(split[i] - one[i]) / std::abs(one[i]);
    std::printf("consumer: step %zu loss %.6f at TP1, %.6f at TP2 x DP2 (relative difference %.1e)\n", i + 1,
                one[i], split[i], rel);
    ok = ok && rel <= 1e-5;
  }
  std::printf("consumer: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
