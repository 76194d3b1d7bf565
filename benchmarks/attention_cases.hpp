#pragma once
// What bench_attention (host) and bench_attention_cuda (GPU) share: their cases, the FLOP count
// and the comparison of the two attention ops' outputs.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace dsp::bench {

/// Model FLOPs of causal attention over batch b, h heads, sequence s, head_dim d, with
/// FlashAttention-2's count (Dao 2023, section 4.1): the forward's two GEMMs 4 b h s^2 d, halved
/// by the causal mask, 2 b h s^2 d; the backward 2.5x the forward.
inline double attention_flops(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d, bool backward) {
  return 2.0 * double(b * h) * double(s) * double(s) * double(d) * (backward ? 3.5 : 1.0);
}

/// max_i |got[i] - want[i]| / max(1, |want[i]|).
inline double max_rel_diff(const std::vector<float>& got, const std::vector<float>& want) {
  double worst = 0;
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i)
    worst = std::max(worst, std::abs(double(got[i]) - want[i]) / std::max(1.0, std::abs(double(want[i]))));
  return worst;
}

/// Registers <prefix>/<flash|materialising>/<fwd|fwd_bwd>/seq:<s> for each s in seqs, timed
/// manually in ms, each calling fn(state, flash, backward) with state.range(0) = s.
template <class Fn>
void register_attention_cases(const char* prefix, Fn fn, std::initializer_list<std::int64_t> seqs) {
  for (bool flash : {true, false})
    for (bool backward : {false, true}) {
      const std::string name =
          std::string(prefix) + (flash ? "/flash" : "/materialising") + (backward ? "/fwd_bwd" : "/fwd");
      auto* b = benchmark::RegisterBenchmark(name.c_str(), fn, flash, backward)->ArgName("seq");
      for (std::int64_t s : seqs) b->Arg(s);
      b->UseManualTime()->Unit(benchmark::kMillisecond);
    }
}

}  // namespace dsp::bench
