#pragma once
// (Vocab-parallel) softmax cross-entropy on the GPU, the Host ops' contracts
// (backend/host/cross_entropy.hpp): one block per token for the row reductions and the
// gradient, one thread per token for the target logit and the loss.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/cross_entropy.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include <cuda_runtime.h>

#include <cstdint>

#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/grid_stride.cuh"
#include "dsp/backend/cuda/launch.hpp"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/backend/cuda/reduce.cuh"

namespace dsp::backend {

namespace detail {

template <int = 0>
__global__ void row_max_kernel(const float* logits, std::int64_t cols, std::int64_t valid, float* out) {
  const float* l = logits + blockIdx.x * cols;
  float mx = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < valid; j += blockDim.x) mx = fmaxf(mx, l[j]);
  mx = block_max(mx);
  if (threadIdx.x == 0) out[blockIdx.x] = mx;
}

template <int = 0>
__global__ void row_sum_exp_kernel(const float* logits, std::int64_t cols, std::int64_t valid, const float* row_max,
                                   float* out) {
  const float* l = logits + blockIdx.x * cols;
  const float mx = row_max[blockIdx.x];
  double s = 0.0;
  for (std::int64_t j = threadIdx.x; j < valid; j += blockDim.x) s += expf(l[j] - mx);
  s = block_sum(s);
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<float>(s);
}

template <int = 0>
__global__ void gather_target_logit_kernel(const float* logits, const std::int32_t* targets, std::int64_t tokens,
                                           std::int64_t cols, std::int64_t col_offset, float* out) {
  for (const std::int64_t t : grid_stride(tokens)) {
    const std::int64_t j = targets[t] - col_offset;
    out[t] = targets[t] >= 0 && j >= 0 && j < cols ? logits[t * cols + j] : 0.0f;
  }
}

template <int = 0>
__global__ void cross_entropy_backward_kernel(const float* logits, const std::int32_t* targets, std::int64_t cols,
                                              std::int64_t valid, std::int64_t col_offset, const float* row_max,
                                              const float* sum_exp, const float* dloss, float* dlogits) {
  const std::int64_t t = blockIdx.x;
  const float* l = logits + t * cols;
  float* d = dlogits + t * cols;
  const bool ignored = targets[t] < 0;
  const std::int64_t target = targets[t] - col_offset;
  const float mx = row_max[t], c = dloss[t] / sum_exp[t];
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    if (ignored || j >= valid) {
      d[j] = 0.0f;
    } else {
      const float p = expf(l[j] - mx) * c;
      d[j] = j == target ? p - dloss[t] : p;
    }
  }
}

/// bad[0] = how many targets are >= valid, bad[1] = the largest of them.
template <int = 0>
__global__ void count_bad_targets_kernel(const std::int32_t* targets, std::int64_t tokens, std::int64_t valid,
                                         int* bad) {
  for (const std::int64_t t : grid_stride(tokens)) {
    if (targets[t] >= valid) {
      atomicAdd(&bad[0], 1);
      atomicMax(&bad[1], targets[t]);
    }
  }
}

template <int = 0>
__global__ void cross_entropy_loss_kernel(const std::int32_t* targets, std::int64_t tokens, const float* row_max,
                                          const float* sum_exp, float* loss) {
  for (const std::int64_t t : grid_stride(tokens))
    loss[t] = targets[t] < 0 ? 0.0f : logf(sum_exp[t]) + row_max[t] - loss[t];
}

}  // namespace detail

/// The Host row_max on b.stream: out [tokens] = max over the first `valid` columns of logits
/// [tokens, cols] (-infinity when valid == 0). Throws Error when valid is outside [0, cols].
inline void row_max(Cuda b, const float* logits, std::int64_t tokens, std::int64_t cols, std::int64_t valid,
                    float* out) {
  DSP_CHECK(valid >= 0 && valid <= cols, "row_max: valid=", valid, " outside [0, cols=", cols, "]");
  if (tokens == 0) return;
  detail::row_max_kernel<<<detail::row_blocks(tokens), detail::kBlockThreads, 0, b.stream>>>(logits, cols, valid,
                                                                                           out);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host row_sum_exp on b.stream: out [tokens] = sum_{j < valid} exp(logits[t, j] -
/// row_max[t]), accumulated in fp64. Throws Error when valid is outside [0, cols].
inline void row_sum_exp(Cuda b, const float* logits, std::int64_t tokens, std::int64_t cols, std::int64_t valid,
                        const float* row_max, float* out) {
  DSP_CHECK(valid >= 0 && valid <= cols, "row_sum_exp: valid=", valid, " outside [0, cols=", cols, "]");
  if (tokens == 0) return;
  detail::row_sum_exp_kernel<<<detail::row_blocks(tokens), detail::kBlockThreads, 0, b.stream>>>(logits, cols, valid,
                                                                                               row_max, out);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host gather_target_logit on b.stream: out [tokens] = logits[t, targets[t] - col_offset]
/// when that column is this rank's, else 0 (also for ignored targets < 0).
inline void gather_target_logit(Cuda b, const float* logits, const std::int32_t* targets, std::int64_t tokens,
                                std::int64_t cols, std::int64_t col_offset, float* out) {
  if (tokens == 0) return;
  detail::gather_target_logit_kernel<<<detail::elementwise_blocks(tokens), detail::kBlockThreads, 0, b.stream>>>(
      logits, targets, tokens, cols, col_offset, out);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host cross_entropy_backward on b.stream: dlogits [tokens, cols] = (softmax - one-hot
/// target) * dloss[t] over the valid columns, 0 on padding columns and ignored rows.
/// dlogits == logits allowed. Throws Error when valid is outside [0, cols].
inline void cross_entropy_backward(Cuda b, const float* logits, const std::int32_t* targets, std::int64_t tokens,
                                   std::int64_t cols, std::int64_t valid, std::int64_t col_offset,
                                   const float* row_max, const float* sum_exp, const float* dloss,
                                   float* dlogits) {
  DSP_CHECK(valid >= 0 && valid <= cols, "cross_entropy_backward: valid=", valid, " outside [0, cols=", cols, "]");
  if (tokens == 0) return;
  detail::cross_entropy_backward_kernel<<<detail::row_blocks(tokens), detail::kBlockThreads, 0, b.stream>>>(
      logits, targets, cols, valid, col_offset, row_max, sum_exp, dloss, dlogits);
  DSP_CUDA_CHECK(cudaGetLastError());
}

/// The Host cross_entropy_forward on b.stream (single rank, col_offset 0): loss [tokens] =
/// log(sum_exp) + max - target logit (0 for ignored targets), and row_max, sum_exp [tokens] for
/// the backward. Checks the targets on the device first and waits for that check (one stream
/// synchronisation): throws Error naming the largest target when one is >= valid, as the Host op
/// does, before computing anything.
inline void cross_entropy_forward(Cuda b, const float* logits, const std::int32_t* targets, std::int64_t tokens,
                                  std::int64_t cols, std::int64_t valid, float* loss, float* row_max_out,
                                  float* sum_exp) {
  if (tokens == 0) return;
  DeviceBuffer<int> bad(b, 2, memory::Category::Workspace);
  DSP_CUDA_CHECK(cudaMemsetAsync(bad.data(), 0, bad.bytes(), b.stream));
  detail::count_bad_targets_kernel<<<detail::elementwise_blocks(tokens), detail::kBlockThreads, 0, b.stream>>>(
      targets, tokens, valid, bad.data());
  DSP_CUDA_CHECK(cudaGetLastError());
  const std::vector<int> found = to_host(b, bad.data(), 2);
  DSP_CHECK(found[0] == 0, "cross_entropy_forward: ", found[0], " targets >= valid=", valid, " (largest ", found[1],
            ")");
  row_max(b, logits, tokens, cols, valid, row_max_out);
  row_sum_exp(b, logits, tokens, cols, valid, row_max_out, sum_exp);
  gather_target_logit(b, logits, targets, tokens, cols, 0, loss);
  detail::cross_entropy_loss_kernel<<<detail::elementwise_blocks(tokens), detail::kBlockThreads, 0, b.stream>>>(
      targets, tokens, row_max_out, sum_exp, loss);
  DSP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsp::backend
