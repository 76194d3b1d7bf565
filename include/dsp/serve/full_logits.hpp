#pragma once
// full_logits: a model's logits of every position of one sequence from a plain forward pass
// (the training path's attention over the sequence, no KV cache): the independent reference
// the serving engine's paged, batched, chunked logits are checked against (tests,
// dsp-consistency-check).
#include <cstdint>
#include <vector>

#include "dsp/backend/host/copy_columns.hpp"
#include "dsp/core/error.hpp"
#include "dsp/model/causal_lm.hpp"
#include "dsp/tp/mappings.hpp"

namespace dsp::serve {

/// Logits [tokens, vocab] of every position of `tokens` (ids in [0, vocab), at most
/// seq_length of them), gathered over the model's tensor group with the vocabulary padding
/// dropped; the same on every rank. Collective over the tensor group. Throws InputError for
/// an empty sequence, an id outside the vocabulary or more than seq_length tokens.
template <class Policy>
Tensor full_logits(model::CausalLM<Policy>& model, const std::vector<std::int32_t>& tokens) {
  using Backend = typename Policy::Backend;
  const auto& c = model.config();
  const auto len = static_cast<std::int64_t>(tokens.size());
  DSP_CHECK_AS(InputError, len > 0, "full_logits: the sequence is empty");
  DSP_CHECK_AS(InputError, len <= c.seq_length, "full_logits: ", len, " tokens exceed --seq-length ", c.seq_length);
  for (auto t : tokens)
    DSP_CHECK_AS(InputError, t >= 0 && t < c.vocab_size, "full_logits: token id ", t, " outside the vocabulary [0, ",
                 c.vocab_size, ")");
  model::ForwardContext ctx = model::ForwardContext::for_training(1, len);
  ctx.training = false;
  const Tensor all = tp::GatherFromTpRegion<Backend>::forward(model.tensor_group(), model.logits(ctx, tokens));
  if (all.dim(1) == c.vocab_size) return all;
  Tensor out({len, c.vocab_size});
  copy_columns(Backend{}, all.data(), all.dim(1), 0, out.data(), c.vocab_size, 0, len, c.vocab_size);
  return out;
}

}  // namespace dsp::serve
