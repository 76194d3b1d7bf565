#pragma once
// Packed documents: the position ids, attention mask and loss mask of sequences that hold
// several documents, each ended by an end-of-document (EOD) token, as Megatron-LM builds them
// (megatron/core/datasets/gpt_dataset.py, _get_ltor_masks_and_position_ids(data, eod_token,
// reset_position_ids, reset_attention_mask, eod_mask_loss), data = the input tokens text[:-1]):
//  - --reset-position-ids: positions restart at 0 after every EOD (the EOD itself keeps its
//    document's next position; the token after it gets 0). RoPE reads them.
//  - --reset-attention-mask: `attention_mask[(i + 1):, :(i + 1)] = 0` for every EOD at i: a
//    token attends only earlier tokens of its own document (the EOD belongs to the document
//    it ends).
//  - --eod-mask-loss: `loss_mask[data == eod_token] = 0`: the prediction made AT an input EOD
//    (of the next document's first token) carries no loss. Here: that token's target is set to
//    -1, the "ignore" target every loss already skips, so the loss tokens the trainer counts
//    (targets >= 0, over every micro-batch and data-parallel rank) are Megatron's
//    loss_mask.sum() over the global batch.
// Per sequence, so a micro-batch [batch, seq] is batch sequences side by side.
#include <cstdint>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/model/forward_context.hpp"

namespace dsp::model {

/// Megatron's document flags (defaults off: every sequence one document, positions 0..seq-1).
struct DocumentMaskConfig {
  bool reset_position_ids = false;    ///< --reset-position-ids
  bool reset_attention_mask = false;  ///< --reset-attention-mask
  bool eod_mask_loss = false;         ///< --eod-mask-loss
  std::int32_t eod_token = -1;        ///< the tokenizer's end-of-document id (< 0: none)

  bool any() const { return reset_position_ids || reset_attention_mask || eod_mask_loss; }
  /// Throws ConfigError when an option is on without an EOD token (eod_token < 0).
  void validate() const {
    DSP_CHECK_AS(ConfigError, !any() || eod_token >= 0,
                 "--reset-position-ids, --reset-attention-mask and --eod-mask-loss need the end-of-document "
                 "token id (eod_token), got ",
                 eod_token);
  }
};

/// Per token [batch * seq] of a micro-batch of packed documents.
struct DocumentMasks {
  std::vector<std::int32_t> positions;     ///< RoPE position: restarted after each EOD, or the row
  std::vector<std::int32_t> document_ids;  ///< index of its document in its sequence (0, 1, ...)
  std::vector<std::int32_t> key_begin;     ///< row of its document's first token (0 without reset_attention_mask)
  std::vector<float> loss_mask;            ///< 0 where the input is an EOD and eod_mask_loss, else 1
};

/// Megatron's masks of inputs [batch * seq] (seq tokens per sequence). Throws Error when
/// inputs.size() is not a multiple of seq.
inline DocumentMasks document_masks(const std::vector<std::int32_t>& inputs, std::int64_t seq,
                                    const DocumentMaskConfig& c) {
  DSP_CHECK(seq > 0 && static_cast<std::int64_t>(inputs.size()) % seq == 0, "document_masks: ", inputs.size(),
            " tokens are not sequences of ", seq);
  const std::size_t n = inputs.size();
  DocumentMasks m;
  m.positions.resize(n);
  m.document_ids.resize(n);
  m.key_begin.resize(n);
  m.loss_mask.assign(n, 1.0f);
  std::int32_t start = 0, doc = 0;  // the current document's first row and index
  for (std::size_t t = 0; t < n; ++t) {
    const auto row = static_cast<std::int32_t>(static_cast<std::int64_t>(t) % seq);
    if (row == 0) start = doc = 0;
    m.positions[t] = c.reset_position_ids ? row - start : row;
    m.document_ids[t] = doc;
    m.key_begin[t] = c.reset_attention_mask ? start : 0;
    const bool eod = c.eod_token >= 0 && inputs[t] == c.eod_token;
    if (eod && c.eod_mask_loss) m.loss_mask[t] = 0.0f;
    if (eod) {  // the next row starts a document
      start = row + 1;
      ++doc;
    }
  }
  return m;
}

/// A micro-batch's document masks into what the model reads: ctx.positions = masks.positions;
/// with ctx.positions reset, ctx.mask_positions = the rows; ctx.key_begin = masks.key_begin when
/// some token's document does not start at row 0 (else left empty: plain causal); targets[t] = -1
/// where masks.loss_mask[t] == 0. Throws Error when a size is not ctx.tokens() or a loss-mask
/// value is neither 0 nor 1 (weighted losses are not supported).
inline void apply_document_masks(ForwardContext& ctx, const DocumentMasks& masks, std::vector<std::int32_t>& targets) {
  const auto n = static_cast<std::size_t>(ctx.tokens());
  DSP_CHECK(masks.positions.size() == n && masks.key_begin.size() == n && masks.loss_mask.size() == n &&
                targets.size() == n,
            "apply_document_masks: masks and targets must hold ", n, " tokens ([batch * seq])");
  ctx.positions = masks.positions;
  ctx.mask_positions.clear();
  ctx.key_begin.clear();
  bool reset = false, documents = false;
  for (std::size_t t = 0; t < n; ++t) {
    reset = reset || masks.positions[t] != static_cast<std::int32_t>(static_cast<std::int64_t>(t) % ctx.seq);
    documents = documents || masks.key_begin[t] != 0;
    const float w = masks.loss_mask[t];
    DSP_CHECK(w == 0.0f || w == 1.0f, "loss mask: token ", t, " has weight ", w, "; only 0 and 1 are supported");
    if (w == 0.0f) targets[t] = -1;
  }
  if (reset) {
    ctx.mask_positions.resize(n);
    for (std::size_t t = 0; t < n; ++t)
      ctx.mask_positions[t] = static_cast<std::int32_t>(static_cast<std::int64_t>(t) % ctx.seq);
  }
  if (documents) ctx.key_begin = masks.key_begin;
}

/// document_masks then apply_document_masks, for inputs and targets [ctx.tokens()]: what the
/// trainer does to every micro-batch when an option of c is on.
inline void apply_document_masks(ForwardContext& ctx, const std::vector<std::int32_t>& inputs,
                                 std::vector<std::int32_t>& targets, const DocumentMaskConfig& c) {
  apply_document_masks(ctx, document_masks(inputs, ctx.seq, c), targets);
}

/// key_begin [batch * seq] from per-token document ids (non-decreasing along each sequence):
/// the row where each token's document starts. Throws Error when a sequence's ids decrease.
inline std::vector<std::int32_t> key_begin_from_document_ids(const std::vector<std::int32_t>& document_ids,
                                                             std::int64_t seq) {
  std::vector<std::int32_t> out(document_ids.size());
  std::int32_t start = 0;
  for (std::size_t t = 0; t < document_ids.size(); ++t) {
    const auto row = static_cast<std::int32_t>(static_cast<std::int64_t>(t) % seq);
    if (row == 0) {
      start = 0;
    } else if (document_ids[t] != document_ids[t - 1]) {
      DSP_CHECK(document_ids[t] > document_ids[t - 1], "document ids decrease at token ", t, " (", document_ids[t - 1],
                " then ", document_ids[t], "): a document must be contiguous in its sequence");
      start = row;
    }
    out[t] = start;
  }
  return out;
}

}  // namespace dsp::model
