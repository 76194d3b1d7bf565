#pragma once
// Host ops that move mixture-of-experts tokens: order the (token, slot) assignments by expert
// (a stable counting sort; on a GPU this is a radix sort by expert id and a scan), gather
// token rows into that order and scatter them back, combine expert outputs with the gate
// weights, and regroup received rows between source-major and expert-major order.
// An assignment a = token * top_k + slot indexes the router's [tokens, top_k] arrays.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dsp/backend/host/host.hpp"
#include "dsp/core/error.hpp"

namespace dsp::backend {

/// order [kept assignments] = the assignments a with kept[a] != 0 (kept may be nullptr = all),
/// sorted by experts[a], ties in increasing a (token order); counts [num_experts] = kept
/// assignments per expert. Returns the number written to order (order needs room for
/// `assignments`). Throws Error for an expert index outside [0, num_experts).
inline std::int64_t sort_by_expert(Host, const std::int32_t* experts, const std::uint8_t* kept,
                                   std::int64_t assignments, std::int64_t num_experts, std::int64_t* order,
                                   std::int64_t* counts) {
  std::fill(counts, counts + num_experts, 0);
  for (std::int64_t a = 0; a < assignments; ++a) {
    if (kept && !kept[a]) continue;
    DSP_CHECK(experts[a] >= 0 && experts[a] < num_experts, "sort_by_expert: expert ", experts[a],
              " outside [0, ", num_experts, ")");
    ++counts[experts[a]];
  }
  std::vector<std::int64_t> next(static_cast<std::size_t>(num_experts), 0);
  for (std::int64_t e = 1; e < num_experts; ++e) next[static_cast<std::size_t>(e)] = next[static_cast<std::size_t>(e - 1)] + counts[e - 1];
  std::int64_t n = 0;
  for (std::int64_t a = 0; a < assignments; ++a)
    if (!kept || kept[a]) {
      order[next[static_cast<std::size_t>(experts[a])]++] = a;
      ++n;
    }
  return n;
}

/// out [n, hidden]: row i = x [tokens, hidden] row order[i] / top_k (the token of assignment
/// order[i]). Overwrites out.
inline void permute_rows(Host, const float* x, const std::int64_t* order, std::int64_t n, std::int64_t top_k,
                         std::int64_t hidden, float* out) {  // n == 0: no call touches the (maybe null) pointers
  for (std::int64_t i = 0; i < n; ++i)
    std::memcpy(out + i * hidden, x + (order[i] / top_k) * hidden, static_cast<std::size_t>(hidden) * sizeof(float));
}

/// Backward of permute_rows: dx [tokens, hidden] row order[i] / top_k += rows [n, hidden] row i.
inline void unpermute_rows_add(Host, const float* rows, const std::int64_t* order, std::int64_t n,
                               std::int64_t top_k, std::int64_t hidden, float* dx) {
  for (std::int64_t i = 0; i < n; ++i) {
    float* d = dx + (order[i] / top_k) * hidden;
    const float* r = rows + i * hidden;
    for (std::int64_t j = 0; j < hidden; ++j) d[j] += r[j];
  }
}

/// y [tokens, hidden] row order[i] / top_k += weights[order[i]] * rows [n, hidden] row i
/// (weights [tokens, top_k]). Accumulates into y.
inline void combine_rows(Host, const float* rows, const float* weights, const std::int64_t* order, std::int64_t n,
                         std::int64_t top_k, std::int64_t hidden, float* y) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float w = weights[order[i]];
    float* out = y + (order[i] / top_k) * hidden;
    const float* r = rows + i * hidden;
    for (std::int64_t j = 0; j < hidden; ++j) out[j] += w * r[j];
  }
}

/// Backward of combine_rows: drows [n, hidden] row i = weights[order[i]] * dy row t (t =
/// order[i] / top_k), overwritten; dweights[order[i]] += dot(dy row t, rows row i) (fp64 sum).
inline void combine_rows_backward(Host, const float* rows, const float* weights, const std::int64_t* order,
                                  std::int64_t n, std::int64_t top_k, std::int64_t hidden, const float* dy,
                                  float* drows, float* dweights) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float w = weights[order[i]];
    const float* g = dy + (order[i] / top_k) * hidden;
    const float* r = rows + i * hidden;
    float* d = drows + i * hidden;
    double dot = 0.0;
    for (std::int64_t j = 0; j < hidden; ++j) {
      d[j] = w * g[j];
      dot += double(g[j]) * double(r[j]);
    }
    dweights[order[i]] += static_cast<float>(dot);
  }
}

namespace detail {
/// Row offsets of the blocks counts [sources, experts] (index s * experts + e) when the rows
/// are stored source-major (for each source, its experts in order) and expert-major (for each
/// expert, its sources in order).
struct RegroupOffsets {
  std::vector<std::int64_t> source_major, expert_major;
};
inline RegroupOffsets regroup_offsets(const std::int64_t* counts, std::int64_t sources, std::int64_t experts) {
  RegroupOffsets o{std::vector<std::int64_t>(static_cast<std::size_t>(sources * experts)),
                   std::vector<std::int64_t>(static_cast<std::size_t>(sources * experts))};
  std::int64_t off = 0;
  for (std::int64_t s = 0; s < sources; ++s)
    for (std::int64_t e = 0; e < experts; ++e) {
      o.source_major[static_cast<std::size_t>(s * experts + e)] = off;
      off += counts[s * experts + e];
    }
  off = 0;
  for (std::int64_t e = 0; e < experts; ++e)
    for (std::int64_t s = 0; s < sources; ++s) {
      o.expert_major[static_cast<std::size_t>(s * experts + e)] = off;
      off += counts[s * experts + e];
    }
  return o;
}
}  // namespace detail

/// Regroups rows held as blocks counts [sources, experts] (the rows from each source, per
/// expert): source-major (for each source, its experts in order) to expert-major (for each
/// expert, its sources in order) when to_expert_major, else back. in and out are [sum counts,
/// hidden] and must not alias.
inline void regroup_rows(Host, const float* in, const std::int64_t* counts, std::int64_t sources,
                         std::int64_t experts, std::int64_t hidden, bool to_expert_major, float* out) {
  const detail::RegroupOffsets o = detail::regroup_offsets(counts, sources, experts);
  for (std::size_t b = 0; b < o.source_major.size(); ++b) {
    if (counts[b] == 0) continue;  // an empty tensor's data() may be null
    const std::int64_t from = to_expert_major ? o.source_major[b] : o.expert_major[b];
    const std::int64_t to = to_expert_major ? o.expert_major[b] : o.source_major[b];
    std::memcpy(out + to * hidden, in + from * hidden, static_cast<std::size_t>(counts[b] * hidden) * sizeof(float));
  }
}

}  // namespace dsp::backend
