// Causal attention on the GPU: the tiled memory-efficient kernels (flash_attention_*,
// backend/cuda/flash_attention.cuh) against the materialising op (attention_*, cuBLAS GEMMs per
// (batch, head) around a softmax kernel, probabilities [batch, heads, seq, seq] in device
// memory), in fp32 and in a bf16 matmul scope (mixed-precision training's: the flash op runs its
// tensor-core kernels, flash_attention_mma.cuh, and the materialising op's GEMMs take bf16
// inputs). Needs a CUDA device; without one every case reports "no CUDA device" as its error.
//
// attention_cuda[_bf16]/<impl>/<pass>/seq:<s>: batch 2, 12 query heads and 12 key/value heads,
// head_dim 128 (the attention of bench_train_step_cuda's model), positions 0..s-1; impl flash or
// materialising; pass fwd (forward, keeping what backward needs: lse or probs) or fwd_bwd
// (forward then backward).
//   time      GPU time of one pass: CUDA events around `batch` back-to-back passes, divided by
//             batch (manual time)
//   TFLOPs    model FLOPs / time / 1e12, with FlashAttention-2's count (Dao 2023, section 4.1):
//             forward 4 b h s^2 d halved for the causal mask = 2 b h s^2 d; backward 2.5x the
//             forward. The same count for both impls, though the materialising one computes the
//             masked half too: the ratio of their TFLOPs is the ratio of their speeds.
//   max_rel_diff  max |out - out_other| / max(1, |out_other|) against the other impl's forward
//             on the same inputs (fp32: expect ~1e-6; bf16: both round the same inputs, expect
//             ~1e-3 at most from one-ulp flips of rounded probabilities)
//   held_MB   device memory the forward keeps for backward (lse or probs), MB = 1e6 B
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "attention_cases.hpp"
#include "dsp/backend/cuda.hpp"
#include "dsp/backend/matmul_precision.hpp"

namespace {

using dsp::backend::Cuda;
using dsp::backend::DeviceBuffer;

constexpr std::int64_t kBatch = 2, kHeads = 12, kHeadDim = 128;

std::vector<float> pseudo_random(std::size_t n, std::uint32_t seed) {
  std::vector<float> v(n);
  std::uint32_t x = seed * 2654435761u + 1u;
  for (auto& e : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    e = float(x % 2001u) / 1000.0f - 1.0f;  // [-1, 1]
  }
  return v;
}

void BM_attention(benchmark::State& state, bool flash, bool backward) {
  std::string why;
  if (dsp::backend::device_count(&why) == 0) {
    state.SkipWithError(("no CUDA device: " + why).c_str());
    return;
  }
  const std::int64_t s = state.range(0), b = kBatch, h = kHeads, d = kHeadDim;
  dsp::backend::Stream stream;
  const Cuda be = stream.backend();
  const std::size_t qn = std::size_t(b * s * h * d);
  auto q = dsp::backend::to_device<float>(be, pseudo_random(qn, 1));
  auto k = dsp::backend::to_device<float>(be, pseudo_random(qn, 2));
  auto v = dsp::backend::to_device<float>(be, pseudo_random(qn, 3));
  auto dout = dsp::backend::to_device<float>(be, pseudo_random(qn, 4));
  std::vector<std::int32_t> positions(std::size_t(b * s));
  for (std::int64_t i = 0; i < b * s; ++i) positions[std::size_t(i)] = std::int32_t(i % s);
  auto pos = dsp::backend::to_device<std::int32_t>(be, positions);
  DeviceBuffer<float> out(be, qn), other(be, qn), dq(be, qn), dk(be, qn), dv(be, qn);
  DeviceBuffer<float> lse(be, std::size_t(b * h * s));
  DeviceBuffer<float> probs(be, std::size_t(b * h * s * s));
  auto pass = [&](bool use_flash, float* o) {
    if (use_flash) {
      flash_attention_forward(be, q.data(), k.data(), v.data(), pos.data(), b, s, s, h, h, d, o, lse.data());
      if (backward)
        flash_attention_backward(be, q.data(), k.data(), v.data(), o, dout.data(), lse.data(), pos.data(), b, s, s,
                                 h, h, d, dq.data(), dk.data(), dv.data());
    } else {
      attention_forward(be, q.data(), k.data(), v.data(), pos.data(), b, s, s, h, h, d, o, probs.data());
      if (backward)
        attention_backward(be, q.data(), k.data(), v.data(), probs.data(), dout.data(), b, s, s, h, h, d, dq.data(),
                           dk.data(), dv.data());
    }
  };
  pass(!flash, other.data());  // the reference output, and a warm-up of both
  pass(flash, out.data());
  dsp::backend::Event start, stop;
  start.record(be);
  pass(flash, out.data());
  stop.record(be);
  stop.synchronize();
  const int batch = std::max(1, int(50.0f / std::max(stop.elapsed_ms(start), 1e-3f)));
  double seconds = 0;
  for (auto _ : state) {
    start.record(be);
    for (int i = 0; i < batch; ++i) pass(flash, out.data());
    stop.record(be);
    stop.synchronize();
    const double dt = stop.elapsed_ms(start) / 1e3 / batch;
    state.SetIterationTime(dt);
    seconds += dt;
  }
  const auto got = dsp::backend::to_host(be, out.data(), qn), want = dsp::backend::to_host(be, other.data(), qn);
  const double flops = dsp::bench::attention_flops(b, h, s, d, backward);
  state.counters["TFLOPs"] = seconds > 0 ? flops * double(state.iterations()) / seconds / 1e12 : 0.0;
  state.counters["max_rel_diff"] = dsp::bench::max_rel_diff(got, want);
  state.counters["held_MB"] = double(flash ? lse.size() : probs.size()) * 4.0 / 1e6;
  state.counters["batch"] = batch;
}

/// BM_attention inside a bf16 matmul scope.
void BM_attention_bf16(benchmark::State& state, bool flash, bool backward) {
  dsp::backend::MatmulPrecisionScope scope(dsp::backend::MatmulPrecision::Bf16);
  BM_attention(state, flash, backward);
}

}  // namespace

int main(int argc, char** argv) {
  dsp::bench::register_attention_cases("attention_cuda", BM_attention, {2048, 8192});
  dsp::bench::register_attention_cases("attention_cuda_bf16", BM_attention_bf16, {2048, 8192});
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
