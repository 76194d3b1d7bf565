#pragma once
// Mixture-of-experts routing on the GPU, the Host ops' contracts (backend/host/router.hpp):
// top-k selection (detail::route_token) and the gate weights and their backward
// (detail::gate_weights_token, gate_weights_backward_token), the per-token code shared with the
// Host ops, one thread per token; the sequence-wise balance loss and its backward (one block per
// token); expert counts; the bias step; capacity dropping (CUB radix sorts and scan).
// Ops that report a value or an input error to the host wait for b.stream (said per op).
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/router.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <vector>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/first_index.cuh"
#include "dsp/backend/cuda/grid_stride.cuh"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/backend/cuda/reduce.cuh"
#include "dsp/backend/host/router.hpp"

namespace dsp::backend {

namespace detail {

/// One thread per token; nan_at = the smallest t * experts + e with a NaN biased score.
template <int = 0>
__global__ void router_topk_kernel(const float* scores, const float* bias, std::int64_t tokens, std::int64_t experts,
                                   std::int64_t groups, std::int64_t group_topk, std::int64_t top_k, float* biased,
                                   float* group_score, std::int32_t* group_order, std::int32_t* chosen,
                                   GroupScore how, unsigned long long* nan_at) {
  for (const std::int64_t t : grid_stride(tokens)) {
    const std::int64_t e = route_token(scores + t * experts, bias, experts, groups, group_topk, top_k,
                                       biased + t * experts, group_score + t * groups, group_order + t * groups,
                                       chosen + t * top_k, how);
    if (e >= 0) report_index(nan_at, t * experts + e);
  }
}

template <int = 0>
__global__ void router_gate_weights_kernel(const float* scores, const std::int32_t* chosen, std::int64_t tokens,
                                           std::int64_t experts, std::int64_t top_k, bool normalize, float scale,
                                           float* weights) {
  for (const std::int64_t t : grid_stride(tokens))
    gate_weights_token(scores + t * experts, chosen + t * top_k, top_k, normalize, scale, weights + t * top_k);
}

/// dscores must be zero already (the unchosen experts stay 0).
template <int = 0>
__global__ void router_gate_weights_backward_kernel(const float* scores, const std::int32_t* chosen,
                                                    const std::uint8_t* kept, const float* dweights,
                                                    std::int64_t tokens, std::int64_t experts, std::int64_t top_k,
                                                    bool normalize, float scale, float* dscores) {
  for (const std::int64_t t : grid_stride(tokens))
    gate_weights_backward_token(scores + t * experts, chosen + t * top_k, kept ? kept + t * top_k : nullptr,
                                dweights + t * top_k, top_k, normalize, scale, dscores + t * experts);
}

/// count [sequences, experts] += 1 per choice of an expert by a token of the sequence.
template <int = 0>
__global__ void sequence_counts_kernel(const std::int32_t* chosen, std::int64_t tokens, std::int64_t experts,
                                       std::int64_t top_k, std::int64_t seq_len, double* count) {
  for (const std::int64_t i : grid_stride(tokens * top_k))
    atomicAdd(&count[(i / top_k / seq_len) * experts + chosen[i]], 1.0);
}

/// One block per token t: p [sequences, experts] row t / seq_len += scores_t / (sum scores_t + 1e-20).
template <int = 0>
__global__ void sequence_probs_kernel(const float* scores, std::int64_t experts, std::int64_t seq_len, double* p) {
  const std::int64_t t = blockIdx.x;
  const float* s = scores + t * experts;
  double sum = 0.0;
  for (std::int64_t e = threadIdx.x; e < experts; e += blockDim.x) sum += s[e];
  const double denom = block_sum(sum) + 1e-20;
  for (std::int64_t e = threadIdx.x; e < experts; e += blockDim.x)
    atomicAdd(&p[(t / seq_len) * experts + e], s[e] / denom);
}

/// One block per token t: ds_t,e = c_e / D_t - sum_i c_i s_t,i / D_t^2 with c = count (row of
/// t's sequence) * unit.
template <int = 0>
__global__ void sequence_balance_backward_kernel(const float* scores, const double* count, std::int64_t experts,
                                                 std::int64_t seq_len, double unit, float* dscores) {
  const std::int64_t t = blockIdx.x;
  const float* s = scores + t * experts;
  const double* c = count + (t / seq_len) * experts;
  double sum = 0.0, cs = 0.0;
  for (std::int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    sum += s[e];
    cs += c[e] * unit * s[e];
  }
  const double d = block_sum(sum) + 1e-20;
  cs = block_sum(cs);
  for (std::int64_t e = threadIdx.x; e < experts; e += blockDim.x)
    dscores[t * experts + e] = static_cast<float>(c[e] * unit / d - cs / (d * d));
}

/// counts [experts] += choices; an i with chosen[i] outside [0, experts) is reported to
/// first_bad (FirstIndex) instead.
template <int = 0>
__global__ void expert_counts_kernel(const std::int32_t* chosen, std::int64_t n, std::int64_t experts,
                                     unsigned long long* counts, unsigned long long* first_bad) {
  for (const std::int64_t i : grid_stride(n)) {
    const std::int32_t e = chosen[i];
    if (e < 0 || e >= experts) {
      report_index(first_bad, i);
      continue;
    }
    atomicAdd(&counts[e], 1ull);
  }
}

/// One block: bias[e] += gamma * sign(mean - load[e]).
template <int = 0>
__global__ void expert_bias_update_kernel(float* bias, const std::int64_t* load, std::int64_t experts, float gamma) {
  long long sum = 0;
  for (std::int64_t e = threadIdx.x; e < experts; e += blockDim.x) sum += load[e];
  const double mean = double(block_sum(sum)) / double(experts);
  for (std::int64_t e = threadIdx.x; e < experts; e += blockDim.x)
    bias[e] += gamma * static_cast<float>((mean > load[e]) - (mean < load[e]));
}

/// expert_key[i] = the expert of slot slot_of[i] (slot_of nullptr: slot i) when it is kept,
/// `experts` (sorts after every expert) when not or when the expert is out of range; a kept
/// slot whose expert is out of range is reported to first_bad (FirstIndex).
template <int = 0>
__global__ void capacity_keys_kernel(const std::int32_t* chosen, const std::uint8_t* kept,
                                     const std::int64_t* slot_of, std::int64_t slots, std::int64_t experts,
                                     std::int32_t* expert_key, unsigned long long* first_bad) {
  for (const std::int64_t i : grid_stride(slots)) {
    const std::int64_t slot = slot_of ? slot_of[i] : i;
    const std::int32_t e = chosen[slot];
    const bool in_range = e >= 0 && e < experts;
    if (kept[slot] && !in_range) report_index(first_bad, slot);
    expert_key[i] = kept[slot] && in_range ? e : std::int32_t(experts);
  }
}

template <int = 0>
__global__ void iota_kernel(std::int64_t n, std::int64_t* out) {
  for (const std::int64_t i : grid_stride(n))
    out[i] = i;
}

/// Over the slots sorted by (expert, ...): a kept slot at position >= capacity within its
/// expert's run is dropped. run_start [experts + 1]: the sorted position of each expert's first
/// slot; not-kept slots carry the key `experts` and are skipped.
template <int = 0>
__global__ void capacity_drop_kernel(const std::int64_t* sorted_slots, const std::int32_t* sorted_experts,
                                     const unsigned long long* run_start, std::int64_t slots, std::int64_t experts,
                                     std::int64_t capacity, float* weights, std::uint8_t* kept,
                                     unsigned long long* dropped, unsigned long long* total) {
  for (const std::int64_t i : grid_stride(slots)) {
    const std::int32_t e = sorted_experts[i];
    if (e == experts || i - std::int64_t(run_start[e]) < capacity) continue;
    const std::int64_t slot = sorted_slots[i];
    kept[slot] = 0;
    weights[slot] = 0.0f;
    atomicAdd(&dropped[e], 1ull);
    atomicAdd(total, 1ull);
  }
}

}  // namespace detail

/// The Host router_topk on b.stream: chosen [tokens, top_k] from scores [tokens, experts] and
/// bias [experts] (or nullptr), group-limited when group_topk < groups, groups scored as `how`
/// says. Waits for b.stream to
/// check for NaN scores: throws Error naming the first token and expert with one, as the Host
/// op does.
inline void router_topk(Cuda b, const float* scores, const float* bias, std::int64_t tokens, std::int64_t experts,
                        std::int64_t groups, std::int64_t group_topk, std::int64_t top_k, std::int32_t* chosen,
                        GroupScore how = GroupScore::TopTwoSum) {
  if (tokens == 0) return;
  const memory::CategoryScope scope(memory::Category::Workspace);
  DeviceBuffer<float> biased(b, std::size_t(tokens * experts)), group_score(b, std::size_t(tokens * groups));
  DeviceBuffer<std::int32_t> group_order(b, std::size_t(tokens * groups));
  detail::FirstIndex nan_at(b);
  detail::router_topk_kernel<<<detail::elementwise_blocks(tokens), detail::kBlockThreads, 0, b.stream>>>(
      scores, bias, tokens, experts, groups, group_topk, top_k, biased.data(), group_score.data(),
      group_order.data(), chosen, how, nan_at.data());
  DSP_CUDA_CHECK(cudaGetLastError());
  const std::int64_t at = nan_at.read();
  DSP_CHECK(at < 0, "router: NaN score for token ", at / experts, " expert ", at % experts);
}

/// The Host router_gate_weights on b.stream: weights [tokens, top_k] = scale * the chosen
/// scores, normalised to sum 1 (+1e-20) when `normalize`.
inline void router_gate_weights(Cuda b, const float* scores, const std::int32_t* chosen, std::int64_t tokens,
                                std::int64_t experts, std::int64_t top_k, bool normalize, float scale, float* weights) {
  if (tokens == 0) return;
  detail::router_gate_weights_kernel<<<detail::elementwise_blocks(tokens), detail::kBlockThreads, 0, b.stream>>>(
      scores, chosen, tokens, experts, top_k, normalize, scale, weights);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host router_gate_weights_backward on b.stream: overwrites dscores [tokens, experts] (0 for
/// unchosen experts; dropped slots, kept == 0, contribute no gradient of their own).
inline void router_gate_weights_backward(Cuda b, const float* scores, const std::int32_t* chosen,
                                         const std::uint8_t* kept, const float* dweights, std::int64_t tokens,
                                         std::int64_t experts, std::int64_t top_k, bool normalize, float scale,
                                         float* dscores) {
  if (tokens == 0) return;
  DSP_CUDA_CHECK(cudaMemsetAsync(dscores, 0, std::size_t(tokens * experts) * sizeof(float), b.stream));
  detail::router_gate_weights_backward_kernel<<<detail::elementwise_blocks(tokens), detail::kBlockThreads, 0,
                                                b.stream>>>(scores, chosen, kept, dweights, tokens, experts, top_k,
                                                            normalize, scale, dscores);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host sequence_balance_loss (DeepSeek-V3 eqs 17-20) with scores and chosen on the device:
/// per-sequence counts and mean normalised scores on the GPU, the final sum on the host. Waits
/// for b.stream (the loss is returned). tokens % seq_len == 0 (the caller checks).
inline float sequence_balance_loss(Cuda b, const float* scores, const std::int32_t* chosen, std::int64_t tokens,
                                   std::int64_t experts, std::int64_t top_k, std::int64_t seq_len, float alpha) {
  const std::int64_t sequences = tokens / seq_len;
  if (sequences == 0) return 0.0f;
  const memory::CategoryScope scope(memory::Category::Workspace);
  DeviceBuffer<double> count(b, std::size_t(sequences * experts)), p(b, std::size_t(sequences * experts));
  DSP_CUDA_CHECK(cudaMemsetAsync(count.data(), 0, count.bytes(), b.stream));
  DSP_CUDA_CHECK(cudaMemsetAsync(p.data(), 0, p.bytes(), b.stream));
  detail::sequence_counts_kernel<<<detail::elementwise_blocks(tokens * top_k), detail::kBlockThreads, 0, b.stream>>>(
      chosen, tokens, experts, top_k, seq_len, count.data());
  DSP_CUDA_CHECK(cudaGetLastError());
  detail::sequence_probs_kernel<<<detail::row_blocks(sequences * seq_len), detail::kBlockThreads, 0, b.stream>>>(
      scores, experts, seq_len, p.data());
  DSP_CUDA_CHECK(cudaGetLastError());
  const std::vector<double> hc = to_host(b, count.data(), count.size()), hp = to_host(b, p.data(), p.size());
  double total = 0.0;
  for (std::size_t i = 0; i < hc.size(); ++i)
    total += double(experts) / double(top_k * seq_len) * hc[i] * hp[i] / double(seq_len);
  return static_cast<float>(alpha * total / double(sequences));
}

/// The Host sequence_balance_loss_backward on b.stream: overwrites dscores [tokens, experts].
inline void sequence_balance_loss_backward(Cuda b, const float* scores, const std::int32_t* chosen,
                                           std::int64_t tokens, std::int64_t experts, std::int64_t top_k,
                                           std::int64_t seq_len, float alpha, float dloss, float* dscores) {
  const std::int64_t sequences = tokens / seq_len;
  if (sequences == 0) return;
  DeviceBuffer<double> count(b, std::size_t(sequences * experts), memory::Category::Workspace);
  DSP_CUDA_CHECK(cudaMemsetAsync(count.data(), 0, count.bytes(), b.stream));
  detail::sequence_counts_kernel<<<detail::elementwise_blocks(tokens * top_k), detail::kBlockThreads, 0, b.stream>>>(
      chosen, tokens, experts, top_k, seq_len, count.data());
  DSP_CUDA_CHECK(cudaGetLastError());
  const double unit = double(alpha) * dloss * experts / (double(top_k) * seq_len * seq_len * sequences);
  detail::sequence_balance_backward_kernel<<<detail::row_blocks(sequences * seq_len), detail::kBlockThreads, 0,
                                             b.stream>>>(scores, count.data(), experts, seq_len, unit, dscores);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host expert_counts with device arrays: counts [experts] = choices of each expert among
/// chosen [n]. Waits for b.stream to check the indices: throws Error for one outside
/// [0, experts), as the Host op does.
inline void expert_counts(Cuda b, const std::int32_t* chosen, std::int64_t n, std::int64_t experts,
                          std::int64_t* counts) {
  DSP_CUDA_CHECK(cudaMemsetAsync(counts, 0, std::size_t(experts) * sizeof(std::int64_t), b.stream));
  if (n == 0) return;
  detail::FirstIndex first_bad(b);
  detail::expert_counts_kernel<<<detail::elementwise_blocks(n), detail::kBlockThreads, 0, b.stream>>>(
      chosen, n, experts, reinterpret_cast<unsigned long long*>(counts), first_bad.data());
  DSP_CUDA_CHECK(cudaGetLastError());
  if (const std::int64_t at = first_bad.read(); at >= 0)  // the Host op names the first bad index in order
    throw Error(dsp::detail::concat("expert index ", to_host(b, chosen + at, 1)[0], " outside [0, ", experts, ")"));
}

/// The Host expert_bias_update on b.stream: bias [experts] += gamma * sign(mean - load[e]), load
/// [experts] in device memory.
inline void expert_bias_update(Cuda b, float* bias, const std::int64_t* load, std::int64_t experts, float gamma) {
  if (experts == 0) return;
  detail::expert_bias_update_kernel<<<1, detail::kBlockThreads, 0, b.stream>>>(bias, load, experts, gamma);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host capacity_drop with device arrays: each expert keeps at most `capacity` of the kept
/// slots of chosen [tokens, top_k] (the highest weights, ties to the earlier slot, when
/// by_weight; else the earliest slots); dropped slots get kept = 0 and weight 0; dropped
/// [experts] = newly dropped per expert. Two stable CUB radix sorts (weight descending, then
/// expert) order the slots as the Host op's stable sort does (CUB, like the Host comparison,
/// treats -0.0 and +0.0 as equal). Returns the total dropped; waits for b.stream. Throws Error
/// when a kept slot names an expert outside [0, experts), as the Host op does.
inline std::int64_t capacity_drop(Cuda b, const std::int32_t* chosen, std::int64_t tokens, std::int64_t top_k,
                                  std::int64_t experts, std::int64_t capacity, bool by_weight, float* weights,
                                  std::uint8_t* kept, std::int64_t* dropped) {
  DSP_CUDA_CHECK(cudaMemsetAsync(dropped, 0, std::size_t(experts) * sizeof(std::int64_t), b.stream));
  const std::int64_t slots = tokens * top_k;
  if (slots == 0) return 0;
  const memory::CategoryScope scope(memory::Category::Workspace);
  const auto n = std::size_t(slots);
  DeviceBuffer<std::int32_t> expert_key(b, n), expert_sorted(b, n);
  DeviceBuffer<float> weight_sorted(b, by_weight ? n : 0);
  DeviceBuffer<std::int64_t> index(b, n), by_weight_order(b, by_weight ? n : 0), sorted_slots(b, n);
  DeviceBuffer<unsigned long long> counts(b, std::size_t(experts) + 1), run_start(b, std::size_t(experts) + 1),
      total(b, 1);
  detail::FirstIndex first_bad(b);
  const unsigned blocks = detail::elementwise_blocks(slots);
  detail::iota_kernel<<<blocks, detail::kBlockThreads, 0, b.stream>>>(slots, index.data());
  DSP_CUDA_CHECK(cudaGetLastError());
  // The expert sort's values: the slots in index order, or (by_weight) by weight, highest first
  // (a stable sort: equal weights keep slot order); the stable expert sort keeps that order
  // within each expert.
  const std::int64_t* values = index.data();
  const int expert_bits = std::bit_width(static_cast<std::uint64_t>(experts));
  std::size_t temp_bytes = 0;
  DSP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, expert_key.data(), expert_sorted.data(),
                                                 values, sorted_slots.data(), slots, 0, expert_bits, b.stream));
  if (by_weight) {
    std::size_t weight_bytes = 0;
    DSP_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(nullptr, weight_bytes, weights, weight_sorted.data(),
                                                             index.data(), by_weight_order.data(), slots, 0, 32,
                                                             b.stream));
    temp_bytes = std::max(temp_bytes, weight_bytes);
  }
  std::size_t scan_bytes = 0;
  DSP_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, counts.data(), run_start.data(), experts + 1,
                                               b.stream));
  temp_bytes = std::max(temp_bytes, scan_bytes);
  DeviceBuffer<char> temp(b, std::max<std::size_t>(temp_bytes, 1));  // a null pointer would only query the size
  if (by_weight) {
    DSP_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(temp.data(), temp_bytes, weights, weight_sorted.data(),
                                                             index.data(), by_weight_order.data(), slots, 0, 32,
                                                             b.stream));
    values = by_weight_order.data();
  }
  detail::capacity_keys_kernel<<<blocks, detail::kBlockThreads, 0, b.stream>>>(
      chosen, kept, by_weight ? values : nullptr, slots, experts, expert_key.data(), first_bad.data());
  DSP_CUDA_CHECK(cudaGetLastError());
  if (const std::int64_t bad_slot = first_bad.read(); bad_slot >= 0)
    throw Error(dsp::detail::concat("capacity_drop: expert ", to_host(b, chosen + bad_slot, 1)[0], " outside [0, ",
                                    experts, ")"));
  DSP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, expert_key.data(), expert_sorted.data(),
                                                 values, sorted_slots.data(), slots, 0, expert_bits, b.stream));
  // Where each expert's run starts in the sorted order: counts of the keys (the not-kept key
  // `experts` included), exclusive prefix sum.
  DSP_CUDA_CHECK(cudaMemsetAsync(counts.data(), 0, counts.bytes(), b.stream));
  detail::expert_counts_kernel<<<blocks, detail::kBlockThreads, 0, b.stream>>>(
      expert_sorted.data(), slots, experts + 1, counts.data(), first_bad.data());  // keys are in range now
  DSP_CUDA_CHECK(cudaGetLastError());
  DSP_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp.data(), temp_bytes, counts.data(), run_start.data(),
                                               experts + 1, b.stream));
  DSP_CUDA_CHECK(cudaMemsetAsync(total.data(), 0, total.bytes(), b.stream));
  detail::capacity_drop_kernel<<<blocks, detail::kBlockThreads, 0, b.stream>>>(
      sorted_slots.data(), expert_sorted.data(), run_start.data(), slots, experts, capacity, weights, kept,
      reinterpret_cast<unsigned long long*>(dropped), total.data());
  DSP_CUDA_CHECK(cudaGetLastError());
  return static_cast<std::int64_t>(to_host(b, total.data(), 1)[0]);
}

}  // namespace dsp::backend
