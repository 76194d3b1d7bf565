// Consumer of the installed package: a 2-rank all_reduce on rank-valued inputs, checked
// against its closed form. Exit status 0 when every element on every rank is right.
#include <dsp/comm/launch.hpp>

#include <atomic>
#include <cstdio>
#include <span>
#include <vector>

int main() {
  constexpr int world = 2;
  constexpr int count = 1000;
  std::atomic<int> wrong{0};
  dsp::comm::launch(world, [&](dsp::comm::ThreadComm& comm) {
    std::vector<float> x(count);
    for (int i = 0; i < count; ++i) x[i] = float(comm.rank() * 1000 + i);
    comm.all_reduce(std::span(x));
    // sum over r in {0, 1} of (1000 r + i) = 1000 + 2 i
    for (int i = 0; i < count; ++i)
      if (x[i] != float(1000 + 2 * i)) ++wrong;
  });
  std::printf("consumer: 2-rank all_reduce of %d floats: %d wrong\n", count, wrong.load());
  return wrong.load() == 0 ? 0 : 1;
}
