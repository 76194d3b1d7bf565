#pragma once
// Host ops of mixture-of-experts routing (used by dsp::ep): top-k expert selection with
// group-limited masking, gate weights and their backward, the sequence-wise balance loss,
// expert counts, the auxiliary-loss-free bias step and capacity dropping. fp32 data, fp64
// sums. Sources: DeepSeek-V2 report (softmax top-k, sequence-wise auxiliary loss); DeepSeek-V3
// report section 2.1.2, eqs 12-20 (sigmoid scores, correction bias, balance loss); Hugging Face
// modeling_deepseek MoEGate (group-limited selection).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "dsp/backend/host/host.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/host_device.hpp"

namespace dsp::backend {

/// How a group of experts is scored for group-limited routing: the sum of its two best biased
/// scores (DeepSeek-V3's noaux_tc; one best for groups of one expert) or its best score
/// (DeepSeek-V2's group_limited_greedy), as transformers' DeepseekV3TopkRouter and
/// DeepseekV2TopkRouter compute them.
enum class GroupScore { TopTwoSum, Max };

namespace detail {

/// True when index a ranks before index b in v: a higher value, or an equal value and a lower
/// index (a strict total order on indices, also for -inf values).
DSP_HOST_DEVICE inline bool ranks_before(const float* v, std::int64_t a, std::int64_t b) {
  return v[a] > v[b] || (v[a] == v[b] && a < b);
}

/// out [k] = the k first indices of v [n] in ranks_before order, best first, by k selection
/// passes (each picks the best index ranking after the previous pick): O(k n), no scratch, the
/// same result as a partial sort with that order. Requires k <= n.
DSP_HOST_DEVICE inline void select_top(const float* v, std::int64_t n, std::int64_t k, std::int32_t* out) {
  for (std::int64_t r = 0; r < k; ++r) {
    std::int64_t best = -1;
    for (std::int64_t i = 0; i < n; ++i) {
      if (r > 0 && !ranks_before(v, out[r - 1], i)) continue;  // picked already
      if (best < 0 || ranks_before(v, i, best)) best = i;
    }
    out[r] = static_cast<std::int32_t>(best);
  }
}

/// One token of router_topk (its contract below): chosen [top_k] from scores [experts], with
/// scratch biased [experts], group_score [groups] and group_order [groups]. Returns the first
/// expert whose biased score is NaN (nothing chosen then), or -1. Shared by the Host and CUDA ops.
DSP_HOST_DEVICE inline std::int64_t route_token(const float* scores, const float* bias, std::int64_t experts,
                                                std::int64_t groups, std::int64_t group_topk, std::int64_t top_k,
                                                float* biased, float* group_score, std::int32_t* group_order,
                                                std::int32_t* chosen, GroupScore how = GroupScore::TopTwoSum) {
  for (std::int64_t e = 0; e < experts; ++e) {
    biased[e] = scores[e] + (bias ? bias[e] : 0.0f);
    if (biased[e] != biased[e]) return e;  // NaN
  }
  if (group_topk < groups) {
    const std::int64_t per_group = experts / groups;
    for (std::int64_t g = 0; g < groups; ++g) {
      float first = -INFINITY, second = -INFINITY;
      for (std::int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
        if (biased[e] > first) {
          second = first;
          first = biased[e];
        } else if (biased[e] > second) {
          second = biased[e];
        }
      }
      group_score[g] = per_group >= 2 && how == GroupScore::TopTwoSum ? first + second : first;
    }
    select_top(group_score, groups, group_topk, group_order);
    for (std::int64_t g = 0; g < groups; ++g) {
      bool kept = false;
      for (std::int64_t r = 0; r < group_topk; ++r) kept = kept || group_order[r] == g;
      if (!kept)
        for (std::int64_t e = g * per_group; e < (g + 1) * per_group; ++e) biased[e] = -INFINITY;
    }
  }
  select_top(biased, experts, top_k, chosen);
  return -1;
}

/// One token of router_gate_weights: weights [top_k] from scores [experts] and chosen [top_k].
DSP_HOST_DEVICE inline void gate_weights_token(const float* scores, const std::int32_t* chosen, std::int64_t top_k,
                                               bool normalize, float scale, float* weights) {
  double sum = 0.0;
  for (std::int64_t j = 0; j < top_k; ++j) sum += scores[chosen[j]];
  const float denom = normalize ? static_cast<float>(sum + 1e-20) : 1.0f;
  for (std::int64_t j = 0; j < top_k; ++j) weights[j] = scale * (scores[chosen[j]] / denom);
}

/// One token of router_gate_weights_backward: dscores [experts] at the chosen experts (the
/// caller zeroes the others) from dweights [top_k]; kept [top_k] may be nullptr (all kept).
DSP_HOST_DEVICE inline void gate_weights_backward_token(const float* scores, const std::int32_t* chosen,
                                                        const std::uint8_t* kept, const float* dweights,
                                                        std::int64_t top_k, bool normalize, float scale,
                                                        float* dscores) {
  double sum = 0.0, gr = 0.0;
  for (std::int64_t j = 0; j < top_k; ++j) {
    const double g = kept && !kept[j] ? 0.0 : double(dweights[j]);
    sum += scores[chosen[j]];
    gr += g * scores[chosen[j]];
  }
  const double d = normalize ? static_cast<float>(sum + 1e-20) : 1.0;
  for (std::int64_t j = 0; j < top_k; ++j) {
    const double g = kept && !kept[j] ? 0.0 : double(dweights[j]);
    dscores[chosen[j]] = static_cast<float>(scale * (normalize ? g / d - gr / (d * d) : g));
  }
}

}  // namespace detail

/// chosen [tokens, top_k] = per token, the top_k experts by biased score scores[e] + bias[e]
/// (scores [tokens, experts]; bias [experts] or nullptr for none), best first, ties to the lower
/// index. Group-limited when group_topk < groups: the experts split into `groups` contiguous
/// groups, a group scores as `how` says (the sum of its top-2 biased scores, its top-1 for
/// groups of one expert; or its top-1), the group_topk best groups are kept (ties to the lower group) and every other
/// expert is masked to -inf, so it can never be chosen, even when all biased scores are
/// negative. Requires experts % groups == 0 and top_k <= group_topk * experts / groups (the
/// caller validates). Throws Error for a NaN biased score. Overwrites chosen.
inline void router_topk(Host, const float* scores, const float* bias, std::int64_t tokens, std::int64_t experts,
                        std::int64_t groups, std::int64_t group_topk, std::int64_t top_k, std::int32_t* chosen,
                        GroupScore how = GroupScore::TopTwoSum) {
  std::vector<float> biased(static_cast<std::size_t>(experts)), group_score(static_cast<std::size_t>(groups));
  std::vector<std::int32_t> group_order(static_cast<std::size_t>(groups));
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int64_t nan_expert = detail::route_token(scores + t * experts, bias, experts, groups, group_topk, top_k,
                                                        biased.data(), group_score.data(), group_order.data(),
                                                        chosen + t * top_k, how);
    DSP_CHECK(nan_expert < 0, "router: NaN score for token ", t, " expert ", nan_expert);
  }
}

/// weights [tokens, top_k] = scale * r_j, r_j = scores[t, chosen[t, j]] (unbiased scores
/// [tokens, experts]), divided by (sum_j r_j + 1e-20) when `normalize` (the epsilon is Hugging
/// Face's and Megatron's). Overwrites weights.
inline void router_gate_weights(Host, const float* scores, const std::int32_t* chosen, std::int64_t tokens,
                                std::int64_t experts, std::int64_t top_k, bool normalize, float scale, float* weights) {
  for (std::int64_t t = 0; t < tokens; ++t)
    detail::gate_weights_token(scores + t * experts, chosen + t * top_k, top_k, normalize, scale, weights + t * top_k);
}

/// Backward of router_gate_weights: dscores [tokens, experts] from dweights [tokens, top_k];
/// the selection is piecewise constant, so unchosen experts get exactly 0. Slots with
/// kept[t, j] == 0 (dropped by capacity; kept may be nullptr = all kept) have weight constant
/// 0: their dweights are ignored, but their score still enters the normalising sum.
/// With D = sum_j r_j + 1e-20: dr_j = scale (g_j / D - sum_l g_l r_l / D^2) when normalize,
/// else scale g_j. Overwrites dscores.
inline void router_gate_weights_backward(Host, const float* scores, const std::int32_t* chosen,
                                         const std::uint8_t* kept, const float* dweights, std::int64_t tokens,
                                         std::int64_t experts, std::int64_t top_k, bool normalize, float scale,
                                         float* dscores) {
  std::fill_n(dscores, tokens * experts, 0.0f);
  for (std::int64_t t = 0; t < tokens; ++t)
    detail::gate_weights_backward_token(scores + t * experts, chosen + t * top_k, kept ? kept + t * top_k : nullptr,
                                        dweights + t * top_k, top_k, normalize, scale, dscores + t * experts);
}

/// DeepSeek-V3 eqs 17-20 (sequence-wise balance loss), averaged over the sequences: tokens =
/// sequences x seq_len rows, sequence-major. Per sequence of T = seq_len tokens,
/// f_i = E / (top_k T) * #{t : i in chosen[t]}, P_i = 1/T sum_t s'_{t,i}, s'_t = scores_t /
/// (sum_e scores_t,e + 1e-20); L = alpha * mean over sequences of sum_i f_i P_i.
/// scores [tokens, experts], chosen [tokens, top_k]; tokens % seq_len == 0 (caller checks).
/// Returns 0 for no tokens.
inline float sequence_balance_loss(Host, const float* scores, const std::int32_t* chosen, std::int64_t tokens,
                                   std::int64_t experts, std::int64_t top_k, std::int64_t seq_len, float alpha) {
  const std::int64_t sequences = tokens / seq_len;
  std::vector<double> count(experts), p(experts);
  double total = 0.0;
  for (std::int64_t b = 0; b < sequences; ++b) {
    std::fill(count.begin(), count.end(), 0.0);
    std::fill(p.begin(), p.end(), 0.0);
    for (std::int64_t t = b * seq_len; t < (b + 1) * seq_len; ++t) {
      for (std::int64_t j = 0; j < top_k; ++j) count[chosen[t * top_k + j]] += 1.0;
      const float* s = scores + t * experts;
      const double denom = std::accumulate(s, s + experts, 0.0) + 1e-20;
      for (std::int64_t e = 0; e < experts; ++e) p[e] += s[e] / denom;
    }
    for (std::int64_t e = 0; e < experts; ++e)
      total += double(experts) / double(top_k * seq_len) * count[e] * p[e] / double(seq_len);
  }
  return sequences ? static_cast<float>(alpha * total / double(sequences)) : 0.0f;
}

/// Backward of sequence_balance_loss through P only (the counts f are piecewise constant):
/// dscores [tokens, experts] = dloss * dL/dscores, i.e. with c_i = alpha f_i / (T sequences),
/// ds_t,e = dloss (c_e / D_t - sum_i c_i s_t,i / D_t^2), D_t = sum_e s_t,e + 1e-20.
/// Overwrites dscores.
inline void sequence_balance_loss_backward(Host, const float* scores, const std::int32_t* chosen,
                                           std::int64_t tokens, std::int64_t experts, std::int64_t top_k,
                                           std::int64_t seq_len, float alpha, float dloss, float* dscores) {
  const std::int64_t sequences = tokens / seq_len;
  std::vector<double> c(experts);
  for (std::int64_t b = 0; b < sequences; ++b) {
    std::fill(c.begin(), c.end(), 0.0);
    const double unit = double(alpha) * dloss * experts / (double(top_k) * seq_len * seq_len * sequences);
    for (std::int64_t t = b * seq_len; t < (b + 1) * seq_len; ++t)
      for (std::int64_t j = 0; j < top_k; ++j) c[chosen[t * top_k + j]] += unit;
    for (std::int64_t t = b * seq_len; t < (b + 1) * seq_len; ++t) {
      const float* s = scores + t * experts;
      const double d = std::accumulate(s, s + experts, 0.0) + 1e-20;
      double cs = 0.0;
      for (std::int64_t e = 0; e < experts; ++e) cs += c[e] * s[e];
      for (std::int64_t e = 0; e < experts; ++e) dscores[t * experts + e] = static_cast<float>(c[e] / d - cs / (d * d));
    }
  }
}

/// counts [experts] = how many of chosen [n] name each expert. Throws Error for an index
/// outside [0, experts). Overwrites counts.
inline void expert_counts(Host, const std::int32_t* chosen, std::int64_t n, std::int64_t experts,
                          std::int64_t* counts) {
  std::fill_n(counts, experts, 0);
  for (std::int64_t i = 0; i < n; ++i) {
    DSP_CHECK(chosen[i] >= 0 && chosen[i] < experts, "expert index ", chosen[i], " outside [0, ", experts, ")");
    ++counts[chosen[i]];
  }
}

/// bias [experts] += gamma * sign(mean - load[e]) with mean = sum(load) / experts (fp64):
/// overloaded experts go down, underloaded up, those exactly at the mean stay. In place.
inline void expert_bias_update(Host, float* bias, const std::int64_t* load, std::int64_t experts, float gamma) {
  const double mean = double(std::accumulate(load, load + experts, std::int64_t{0})) / double(experts);
  for (std::int64_t e = 0; e < experts; ++e) bias[e] += gamma * static_cast<float>((mean > load[e]) - (mean < load[e]));
}

/// Capacity dropping: among the slots of chosen [tokens, top_k] still kept (kept [tokens,
/// top_k], 1/0, in/out), each expert keeps at most `capacity`: the highest weights (weights
/// [tokens, top_k]; ties to the earlier slot) when by_weight, else the earliest slots (token
/// order). Dropped slots get kept = 0 and weight 0. dropped [experts] = newly dropped slots
/// per expert (overwritten); returns their total. Throws Error when a kept slot names an expert
/// outside [0, experts).
inline std::int64_t capacity_drop(Host, const std::int32_t* chosen, std::int64_t tokens, std::int64_t top_k,
                                  std::int64_t experts, std::int64_t capacity, bool by_weight, float* weights,
                                  std::uint8_t* kept, std::int64_t* dropped) {
  std::vector<std::int64_t> slots;
  for (std::int64_t i = 0; i < tokens * top_k; ++i) {
    if (!kept[i]) continue;
    DSP_CHECK(chosen[i] >= 0 && chosen[i] < experts, "capacity_drop: expert ", chosen[i], " outside [0, ", experts,
              ")");
    slots.push_back(i);
  }
  std::stable_sort(slots.begin(), slots.end(), [&](std::int64_t a, std::int64_t b) {
    return chosen[a] < chosen[b] || (chosen[a] == chosen[b] && by_weight && weights[a] > weights[b]);
  });
  std::fill_n(dropped, experts, 0);
  std::int64_t total = 0, run = 0;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    run = (i > 0 && chosen[slots[i]] == chosen[slots[i - 1]]) ? run + 1 : 0;
    if (run < capacity) continue;
    kept[slots[i]] = 0;
    weights[slots[i]] = 0.0f;
    ++dropped[chosen[slots[i]]];
    ++total;
  }
  return total;
}

}  // namespace dsp::backend
