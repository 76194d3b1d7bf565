// Causal attention on the host, fp32: the memory-efficient op of --use-flash-attn
// (flash_attention_*, backend/host/flash_attention.hpp: query tiles of 64 rows against the keys
// they see, log-sum-exp kept) against the materialising op (attention_*, backend/attention.hpp:
// one [s, s] GEMM per (batch, head), probabilities kept). GPU counterpart: bench_attention_cuda.
//
// attention/<impl>/<pass>/seq:<s>: batch 2, 4 query and 4 key/value heads, head_dim 64,
// positions 0..s-1; impl flash or materialising; pass fwd (forward, keeping lse or probs) or
// fwd_bwd (forward then backward). OpenBLAS uses the machine's threads (as one trainer rank).
//   time      wall time of one pass (manual timing, steady_clock)
//   GFLOPs    model FLOPs / time / 1e9 with FlashAttention-2's count (Dao 2023, section 4.1):
//             causal forward 2 b h s^2 d, backward 2.5x the forward; the same count for both
//             impls, so their GFLOPs ratio is their speed ratio
//   max_rel_diff  max |out - out_other| / max(1, |out_other|) against the other impl's output
//   held_MB   bytes the forward keeps for backward (lse [b, h, s] or probs [b, h, s, s]) / 1e6
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_cases.hpp"
#include "dsp/backend/host.hpp"

namespace {

using dsp::backend::Host;

constexpr std::int64_t kBatch = 2, kHeads = 4, kHeadDim = 64;

void BM_attention(benchmark::State& state, bool flash, bool backward) {
  const std::int64_t s = state.range(0), b = kBatch, h = kHeads, d = kHeadDim;
  const std::size_t qn = std::size_t(b * s * h * d);
  std::vector<float> q(qn), k(qn), v(qn), dout(qn), out(qn), other(qn), dq(qn), dk(qn), dv(qn);
  for (std::size_t i = 0; i < qn; ++i) {  // smooth values in [-1, 1]
    q[i] = std::sin(0.37f * float(i % 1013));
    k[i] = std::cos(0.53f * float(i % 1019));
    v[i] = std::sin(0.71f * float(i % 1021));
    dout[i] = std::cos(0.29f * float(i % 1031));
  }
  std::vector<std::int32_t> pos(std::size_t(b * s));
  for (std::int64_t i = 0; i < b * s; ++i) pos[std::size_t(i)] = std::int32_t(i % s);
  auto pass = [&](bool use_flash, float* o) {  // allocates what it keeps, as a training forward does
    if (use_flash) {
      std::vector<float> l(std::size_t(b * h * s));
      flash_attention_forward(Host{}, q.data(), k.data(), v.data(), pos.data(), b, s, s, h, h, d, o, l.data());
      if (backward)
        flash_attention_backward(Host{}, q.data(), k.data(), v.data(), o, dout.data(), l.data(), pos.data(), b, s,
                                 s, h, h, d, dq.data(), dk.data(), dv.data());
    } else {
      std::vector<float> p(std::size_t(b * h * s * s));
      attention_forward(Host{}, q.data(), k.data(), v.data(), pos.data(), b, s, s, h, h, d, o, p.data());
      if (backward)
        attention_backward(Host{}, q.data(), k.data(), v.data(), p.data(), dout.data(), b, s, s, h, h, d, dq.data(),
                           dk.data(), dv.data());
    }
  };
  pass(!flash, other.data());  // the other op's output, to compare with
  pass(flash, out.data());     // warm-up
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    pass(flash, out.data());
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(dt);
    seconds += dt;
  }
  const double flops = dsp::bench::attention_flops(b, h, s, d, backward);
  state.counters["GFLOPs"] = seconds > 0 ? flops * double(state.iterations()) / seconds / 1e9 : 0.0;
  state.counters["max_rel_diff"] = dsp::bench::max_rel_diff(out, other);
  state.counters["held_MB"] = double(flash ? b * h * s : b * h * s * s) * 4.0 / 1e6;
}

}  // namespace

int main(int argc, char** argv) {
  dsp::bench::register_attention_cases("attention", BM_attention, {512, 2048});
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
