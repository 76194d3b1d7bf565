#pragma once
// Mixture-of-experts token movement on the GPU, the Host ops' contracts
// (backend/host/moe_permute.hpp): the assignments ordered by expert with CUB's radix sort
// (stable: ties stay in assignment order) and a histogram for the per-expert counts; row
// gathers and scatters as kernels (scatters that can meet the same row add atomically).
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/moe_permute.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cub/device/device_radix_sort.cuh>
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
#include "dsp/backend/host/moe_permute.hpp"

namespace dsp::backend {

namespace detail {

/// keys[a] = experts[a] for kept assignments, num_experts (sorts after every expert) for the
/// others; values[a] = a; counts[e] += kept assignments of expert e; *kept_total += kept; a kept
/// assignment whose expert is outside [0, num_experts) is reported to first_bad (FirstIndex).
template <int = 0>
__global__ void expert_keys_kernel(const std::int32_t* experts, const std::uint8_t* kept, std::int64_t assignments,
                                   std::int64_t num_experts, std::int32_t* keys, std::int64_t* values,
                                   unsigned long long* counts, unsigned long long* kept_total,
                                   unsigned long long* first_bad) {
  for (const std::int64_t a : grid_stride(assignments)) {
    values[a] = a;
    const bool keep = !kept || kept[a];
    const std::int32_t e = experts[a];
    keys[a] = keep ? e : std::int32_t(num_experts);
    if (!keep) continue;
    if (e < 0 || e >= num_experts) {
      keys[a] = std::int32_t(num_experts);
      report_index(first_bad, a);
      continue;
    }
    atomicAdd(&counts[e], 1ull);
    atomicAdd(kept_total, 1ull);
  }
}

template <int = 0>
__global__ void permute_rows_kernel(const float* x, const std::int64_t* order, std::int64_t n, std::int64_t top_k,
                                    std::int64_t hidden, float* out) {
  for (const std::int64_t e : grid_stride(n * hidden)) {
    const std::int64_t i = e / hidden, j = e % hidden;
    out[e] = x[(order[i] / top_k) * hidden + j];
  }
}

/// dst row order[i] / top_k += (weights ? weights[order[i]] : 1) * rows row i, atomically (the
/// top_k assignments of a token meet on its row).
template <int = 0>
__global__ void scatter_rows_add_kernel(const float* rows, const float* weights, const std::int64_t* order,
                                        std::int64_t n, std::int64_t top_k, std::int64_t hidden, float* dst) {
  for (const std::int64_t e : grid_stride(n * hidden)) {
    const std::int64_t i = e / hidden, j = e % hidden;
    const float w = weights ? weights[order[i]] : 1.0f;
    atomicAdd(&dst[(order[i] / top_k) * hidden + j], w * rows[e]);
  }
}

/// One block per assignment row i: drows row i = w dy row t; dweights[order[i]] += fp64 dot.
template <int = 0>
__global__ void combine_rows_backward_kernel(const float* rows, const float* weights, const std::int64_t* order,
                                             std::int64_t top_k, std::int64_t hidden, const float* dy, float* drows,
                                             float* dweights) {
  const std::int64_t i = blockIdx.x, a = order[i];
  const float w = weights[a];
  const float* g = dy + (a / top_k) * hidden;
  const float* r = rows + i * hidden;
  float* d = drows + i * hidden;
  double dot = 0.0;
  for (std::int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
    d[j] = w * g[j];
    dot += double(g[j]) * double(r[j]);
  }
  dot = block_sum(dot);
  if (threadIdx.x == 0) dweights[a] += static_cast<float>(dot);  // each assignment appears once in order
}

}  // namespace detail

/// The Host sort_by_expert on b.stream, with device arrays: order [assignments] gets the kept
/// assignments sorted by expert (ties in increasing assignment index) in its first n entries
/// (the rest is unspecified), counts [num_experts] the kept assignments per expert. Returns n;
/// waits for b.stream (n and the expert check come back to the host). Throws Error for an
/// expert index outside [0, num_experts), as the Host op does; CudaError when CUDA fails.
inline std::int64_t sort_by_expert(Cuda b, const std::int32_t* experts, const std::uint8_t* kept,
                                   std::int64_t assignments, std::int64_t num_experts, std::int64_t* order,
                                   std::int64_t* counts) {
  DSP_CHECK(num_experts >= 1 && num_experts < (std::int64_t{1} << 30), "sort_by_expert: num_experts=", num_experts,
            " outside [1, 2^30)");
  static_assert(sizeof(unsigned long long) == sizeof(std::int64_t));
  auto* ucounts = reinterpret_cast<unsigned long long*>(counts);
  DSP_CUDA_CHECK(cudaMemsetAsync(counts, 0, std::size_t(num_experts) * sizeof(std::int64_t), b.stream));
  if (assignments == 0) return 0;
  const memory::CategoryScope scope(memory::Category::Workspace);
  DeviceBuffer<std::int32_t> keys(b, std::size_t(assignments)), sorted_keys(b, std::size_t(assignments));
  DeviceBuffer<std::int64_t> values(b, std::size_t(assignments));
  DeviceBuffer<unsigned long long> kept_total(b, 1);
  DSP_CUDA_CHECK(cudaMemsetAsync(kept_total.data(), 0, kept_total.bytes(), b.stream));
  detail::FirstIndex first_bad(b);
  detail::expert_keys_kernel<<<detail::elementwise_blocks(assignments), detail::kBlockThreads, 0, b.stream>>>(
      experts, kept, assignments, num_experts, keys.data(), values.data(), ucounts, kept_total.data(),
      first_bad.data());
  DSP_CUDA_CHECK(cudaGetLastError());
  // Keys lie in [0, num_experts]: only their low bits take part in the sort.
  const int end_bit = std::bit_width(static_cast<std::uint64_t>(num_experts));
  std::size_t temp_bytes = 0;
  DSP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys.data(), sorted_keys.data(), values.data(),
                                                 order, assignments, 0, end_bit, b.stream));
  DeviceBuffer<char> temp(b, std::max<std::size_t>(temp_bytes, 1));  // a null pointer would only query the size
  DSP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, keys.data(), sorted_keys.data(),
                                                 values.data(), order, assignments, 0, end_bit, b.stream));
  if (const std::int64_t at = first_bad.read(); at >= 0)  // the Host op names the first bad expert in order
    throw Error(dsp::detail::concat("sort_by_expert: expert ", to_host(b, experts + at, 1)[0], " outside [0, ",
                                    num_experts, ")"));
  return static_cast<std::int64_t>(to_host(b, kept_total.data(), 1)[0]);
}

/// The Host permute_rows on b.stream: out [n, hidden] row i = x [tokens, hidden] row
/// order[i] / top_k. Overwrites out.
inline void permute_rows(Cuda b, const float* x, const std::int64_t* order, std::int64_t n, std::int64_t top_k,
                         std::int64_t hidden, float* out) {
  if (n * hidden == 0) return;
  detail::permute_rows_kernel<<<detail::elementwise_blocks(n * hidden), detail::kBlockThreads, 0, b.stream>>>(
      x, order, n, top_k, hidden, out);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host unpermute_rows_add on b.stream: dx row order[i] / top_k += rows [n, hidden] row i
/// (atomically: the sum over a token's assignments is in an order that varies between runs).
inline void unpermute_rows_add(Cuda b, const float* rows, const std::int64_t* order, std::int64_t n,
                               std::int64_t top_k, std::int64_t hidden, float* dx) {
  if (n * hidden == 0) return;
  detail::scatter_rows_add_kernel<<<detail::elementwise_blocks(n * hidden), detail::kBlockThreads, 0, b.stream>>>(
      rows, nullptr, order, n, top_k, hidden, dx);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host combine_rows on b.stream: y row order[i] / top_k += weights[order[i]] * rows row i
/// (weights [tokens, top_k]; atomically, as unpermute_rows_add). Accumulates into y.
inline void combine_rows(Cuda b, const float* rows, const float* weights, const std::int64_t* order, std::int64_t n,
                         std::int64_t top_k, std::int64_t hidden, float* y) {
  if (n * hidden == 0) return;
  detail::scatter_rows_add_kernel<<<detail::elementwise_blocks(n * hidden), detail::kBlockThreads, 0, b.stream>>>(
      rows, weights, order, n, top_k, hidden, y);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host combine_rows_backward on b.stream: drows [n, hidden] row i = weights[order[i]] * dy
/// row order[i] / top_k (overwritten); dweights[order[i]] += dot(dy row, rows row i) in fp64.
inline void combine_rows_backward(Cuda b, const float* rows, const float* weights, const std::int64_t* order,
                                  std::int64_t n, std::int64_t top_k, std::int64_t hidden, const float* dy,
                                  float* drows, float* dweights) {
  if (n == 0) return;
  detail::combine_rows_backward_kernel<<<detail::row_blocks(n), detail::kBlockThreads, 0, b.stream>>>(
      rows, weights, order, top_k, hidden, dy, drows, dweights);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host regroup_rows on b.stream: rows held as blocks counts [sources, experts] (a host
/// array: the sizes come from the all-to-all's counts) between source-major and expert-major
/// order, one device-to-device copy per non-empty block. in and out must not alias.
inline void regroup_rows(Cuda b, const float* in, const std::int64_t* counts, std::int64_t sources,
                         std::int64_t experts, std::int64_t hidden, bool to_expert_major, float* out) {
  const detail::RegroupOffsets o = detail::regroup_offsets(counts, sources, experts);
  for (std::size_t k = 0; k < o.source_major.size(); ++k) {
    if (counts[k] == 0) continue;
    const std::int64_t from = to_expert_major ? o.source_major[k] : o.expert_major[k];
    const std::int64_t to = to_expert_major ? o.expert_major[k] : o.source_major[k];
    DSP_CUDA_CHECK(cudaMemcpyAsync(out + to * hidden, in + from * hidden,
                                   std::size_t(counts[k] * hidden) * sizeof(float), cudaMemcpyDeviceToDevice,
                                   b.stream));
  }
}

}  // namespace dsp::backend
