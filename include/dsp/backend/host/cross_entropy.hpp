#pragma once
// Building blocks of (vocab-parallel) softmax cross-entropy, Megatron-LM style
// (VocabParallelCrossEntropy). Each rank holds logits [tokens, cols] for the global vocab ids
// [col_offset, col_offset + cols); only the first `valid` columns are real, the rest is vocab
// padding that never contributes. targets [tokens] are global ids; target < 0 means "ignore".
// Across ranks: max = all-reduce max of row_max; sum_exp = all-reduce sum of row_sum_exp taken
// with that global max; target_logit = all-reduce sum of gather_target_logit;
// loss = log(sum_exp) + max - target_logit; then cross_entropy_backward on every rank.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "dsp/backend/host/host.hpp"
#include "dsp/core/error.hpp"

namespace dsp::backend {

/// out [tokens] = max over the first `valid` columns of logits [tokens, cols] (-infinity when
/// valid == 0). Overwrites out.
inline void row_max(Host, const float* logits, std::int64_t tokens, std::int64_t cols, std::int64_t valid,
                    float* out) {
  DSP_CHECK(valid >= 0 && valid <= cols, "row_max: valid=", valid, " outside [0, cols=", cols, "]");
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * cols;
    out[t] = valid > 0 ? *std::max_element(l, l + valid) : -std::numeric_limits<float>::infinity();
  }
}

/// out [tokens] = sum_{j < valid} exp(logits[t, j] - row_max[t]), accumulated in fp64, for
/// logits [tokens, cols] and row_max [tokens] (the global max in the vocab-parallel case).
/// Overwrites out.
inline void row_sum_exp(Host, const float* logits, std::int64_t tokens, std::int64_t cols, std::int64_t valid,
                        const float* row_max, float* out) {
  DSP_CHECK(valid >= 0 && valid <= cols, "row_sum_exp: valid=", valid, " outside [0, cols=", cols, "]");
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * cols;
    double s = 0.0;
    for (std::int64_t j = 0; j < valid; ++j) s += std::exp(l[j] - row_max[t]);
    out[t] = static_cast<float>(s);
  }
}

/// out [tokens] = logits [tokens, cols] [t, targets[t] - col_offset] when the global id
/// targets[t] lies in this rank's [col_offset, col_offset + cols), else 0 (also for ignored
/// targets < 0). Overwrites out.
inline void gather_target_logit(Host, const float* logits, const std::int32_t* targets, std::int64_t tokens,
                                std::int64_t cols, std::int64_t col_offset, float* out) {
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int64_t j = targets[t] - col_offset;
    out[t] = targets[t] >= 0 && j >= 0 && j < cols ? logits[t * cols + j] : 0.0f;
  }
}

/// dlogits [tokens, cols] = (exp(logits - row_max[t]) / sum_exp[t] - [j is the target]) * dloss[t]
/// for columns j < valid; padding columns and rows with target < 0 get 0. row_max, sum_exp,
/// dloss [tokens] (global values in the vocab-parallel case). Overwrites dlogits; dlogits ==
/// logits allowed.
inline void cross_entropy_backward(Host, const float* logits, const std::int32_t* targets, std::int64_t tokens,
                                   std::int64_t cols, std::int64_t valid, std::int64_t col_offset,
                                   const float* row_max, const float* sum_exp, const float* dloss,
                                   float* dlogits) {
  DSP_CHECK(valid >= 0 && valid <= cols, "cross_entropy_backward: valid=", valid, " outside [0, cols=", cols, "]");
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * cols;
    float* d = dlogits + t * cols;
    if (targets[t] < 0) {
      std::fill(d, d + cols, 0.0f);
      continue;
    }
    const float c = dloss[t] / sum_exp[t];
    for (std::int64_t j = 0; j < valid; ++j) d[j] = std::exp(l[j] - row_max[t]) * c;
    std::fill(d + valid, d + cols, 0.0f);
    const std::int64_t target = targets[t] - col_offset;
    if (target >= 0 && target < valid) d[target] -= dloss[t];
  }
}

/// Single-rank cross-entropy (col_offset = 0): loss [tokens] = log(sum_exp) + max - logit of
/// the target, 0 for ignored targets (< 0); also writes row_max and sum_exp [tokens] for the
/// backward. logits [tokens, cols] with `valid` real columns; targets must be < valid.
/// Overwrites loss, row_max and sum_exp. The mean over non-ignored tokens is the caller's.
inline void cross_entropy_forward(Host h, const float* logits, const std::int32_t* targets, std::int64_t tokens,
                                  std::int64_t cols, std::int64_t valid, float* loss, float* row_max_out,
                                  float* sum_exp) {
  for (std::int64_t t = 0; t < tokens; ++t)
    DSP_CHECK(targets[t] < valid, "cross_entropy_forward: target ", targets[t], " >= valid=", valid);
  row_max(h, logits, tokens, cols, valid, row_max_out);
  row_sum_exp(h, logits, tokens, cols, valid, row_max_out, sum_exp);
  gather_target_logit(h, logits, targets, tokens, cols, 0, loss);
  for (std::int64_t t = 0; t < tokens; ++t)
    loss[t] = targets[t] < 0 ? 0.0f : std::log(sum_exp[t]) + row_max_out[t] - loss[t];
}

}  // namespace dsp::backend
