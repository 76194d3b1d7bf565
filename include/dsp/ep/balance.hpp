#pragma once
// Expert load balance. Sequence-wise auxiliary loss (DeepSeek-V2 report; DeepSeek-V3 report
// eqs 17-20), computed from the top-k selection before any capacity dropping, and the
// auxiliary-loss-free bias update (DeepSeek-V3 report section 2.1.2: after each step every
// expert's bias moves by gamma toward the mean load).
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "dsp/ep/router.hpp"

namespace dsp::ep {

namespace detail {
inline void check_sequences(const Routing& r, std::int64_t seq_len) {
  DSP_CHECK(seq_len >= 1 && r.tokens % seq_len == 0, "sequence aux loss: ", r.tokens,
            " tokens are not a whole number of sequences of seq_len = ", seq_len);
}
}  // namespace detail

/// Sequence-wise balance loss of a routing whose tokens are sequences of seq_len rows,
/// sequence-major (row = sequence * seq_len + position), averaged over the sequences. Per
/// sequence of T tokens: f_i = E / (k T) * (times expert i was chosen), P_i = 1/T sum_t s'_t,i
/// with s' the scores normalised to sum 1 per token, L = alpha * sum_i f_i P_i (1 * alpha when
/// perfectly balanced). Counts every chosen slot, dropped or not. Returns L (0 for no tokens).
/// Throws Error when tokens is not a multiple of seq_len.
template <class Backend = backend::Host>
float sequence_aux_loss(const Routing& r, std::int64_t seq_len, float alpha) {
  detail::check_sequences(r, seq_len);
  return sequence_balance_loss(Backend{}, r.scores.data(), r.experts.data(), r.tokens, r.num_experts, r.top_k,
                               seq_len, alpha);
}

/// Adds dloss * dL/dlogits [tokens, E] to dlogits for L = sequence_aux_loss(r, seq_len,
/// alpha), through P only (the counts f are piecewise constant). Throws Error when the sizes
/// or config do not match the routing or tokens is not a multiple of seq_len.
template <class Backend = backend::Host>
void sequence_aux_loss_backward(const RouterConfig& cfg, const Routing& r, std::int64_t seq_len, float alpha,
                                float dloss, std::span<float> dlogits) {
  detail::check_matches(cfg, r);
  detail::check_sequences(r, seq_len);
  std::vector<float> dscores(r.scores.size());
  sequence_balance_loss_backward(Backend{}, r.scores.data(), r.experts.data(), r.tokens, r.num_experts, r.top_k,
                                 seq_len, alpha, dloss, dscores.data());
  detail::add_scores_backward<Backend>(cfg.score, r, dscores, dlogits);
}

/// Auxiliary-loss-free balancing step: bias [E] += gamma * sign(mean(load) - load_i) (0 for an
/// expert exactly at the mean), load [E] from expert_load (summed over the step's micro-batches
/// and, for a replicated bias, over the data-parallel ranks so every rank moves it alike).
/// Throws ConfigError for a negative or non-finite gamma, Error for mismatched sizes.
template <class Backend = backend::Host>
void update_expert_bias(std::span<float> bias, std::span<const std::int64_t> load, float gamma) {
  DSP_CHECK_AS(ConfigError, std::isfinite(gamma) && gamma >= 0.0f,
               "expert bias update rate must be finite and >= 0, got ", gamma);
  DSP_CHECK(bias.size() == load.size() && !bias.empty(), "update_expert_bias: bias has ", bias.size(),
            " values, load ", load.size());
  expert_bias_update(Backend{}, bias.data(), load.data(), static_cast<std::int64_t>(bias.size()), gamma);
}

}  // namespace dsp::ep
