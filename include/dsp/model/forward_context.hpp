#pragma once
// ForwardContext: the shape of the micro-batch a forward pass runs on, and where keys and
// values live when serving.
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "dsp/backend/paged_kv.hpp"
#include "dsp/ep/moe_options.hpp"
#include "dsp/precision/activation_precision.hpp"
#include "dsp/model/recompute.hpp"

namespace dsp::model {

/// A serving forward pass's paged KV cache (backend/paged_kv.hpp): every layer's pool and the
/// batch's block tables, slots and sequence of each token, in the memory the backend's ops
/// read. serve::Engine fills it each step from its serve::KvCachePool.
struct PagedKvBatch {
  std::vector<void*> pools;                    ///< per global layer: its pool (null on other stages)
  backend::KvCacheDType dtype = backend::KvCacheDType::Fp32;
  std::int64_t block_size = 16;                ///< token rows per block
  const std::int32_t* block_tables = nullptr;  ///< [seqs, max_blocks]
  std::int64_t max_blocks = 0;                 ///< row stride of block_tables
  const std::int32_t* slots = nullptr;         ///< [tokens]: the pool row of each token's K/V
  const std::int32_t* token_seq = nullptr;     ///< [tokens]: the block-table row of each token

  /// What the paged ops read of global layer `layer`.
  backend::PagedKvLayer layer(std::int64_t layer) const {
    return {pools.at(static_cast<std::size_t>(layer)), dtype, block_size, block_tables, max_blocks, slots, token_seq};
  }
};

struct ForwardContext {
  std::int64_t batch = 1;                 ///< sequences in the micro-batch
  std::int64_t seq = 1;                   ///< tokens per sequence in this call
  std::vector<std::int32_t> positions;    ///< [batch * seq] position of each token in its sequence (RoPE's)
  /// Training on packed documents (model/document_mask.hpp, Megatron's --reset-attention-mask):
  /// per token [batch * seq], the row in its sequence of its document's first token; a token
  /// attends only the keys from there up to mask_positions (its own document). Empty: from 0.
  std::vector<std::int32_t> key_begin;
  /// Per token [batch * seq], the last key row it attends, when positions no longer say it
  /// (--reset-position-ids restarts positions after every end-of-document token; the causal
  /// mask reads the row in the sequence). Empty: positions.
  std::vector<std::int32_t> mask_positions;
  /// Serving: a ragged batch (batch = 1, seq = its tokens, each at ctx.positions in its own
  /// sequence) whose keys and values are written to and attended from this paged cache.
  const PagedKvBatch* paged = nullptr;
  /// Serving: the rows (token indices) whose logits the last stage computes, in this order
  /// (none when empty); nullopt: every row.
  std::optional<std::vector<std::int64_t>> logit_rows;
  bool training = true;                   ///< keep activations for backward
  ep::MoeOptions moe;                     ///< capacity and balance loss of MoE layers (training)
  RecomputeConfig recompute;              ///< what a training forward keeps for backward
  bool recomputing = false;               ///< a forward re-run in backward: layers count nothing twice
  /// Training with mixed precision: the 16-bit type activations are rounded to and kept in.
  precision::ActivationPrecision activations = precision::ActivationPrecision::Fp32;

  std::int64_t tokens() const { return batch * seq; }
  /// Whether attention reads key_begin / mask_positions (packed documents) instead of only positions.
  bool masks_documents() const { return !key_begin.empty() || !mask_positions.empty(); }

  /// Serving: a ragged batch of positions.size() tokens, each at its position in its own
  /// sequence, keys and values in `paged`; logits of `logit_rows` only (nullopt: all).
  static ForwardContext for_serving(std::vector<std::int32_t> positions, const PagedKvBatch* paged,
                                    std::optional<std::vector<std::int64_t>> logit_rows = std::nullopt) {
    ForwardContext c;
    c.batch = 1;
    c.seq = static_cast<std::int64_t>(positions.size());
    c.positions = std::move(positions);
    c.paged = paged;
    c.logit_rows = std::move(logit_rows);
    c.training = false;
    return c;
  }

  /// Training layout: batch rows of seq tokens at positions 0..seq-1.
  static ForwardContext for_training(std::int64_t batch, std::int64_t seq) {
    ForwardContext c;
    c.batch = batch;
    c.seq = seq;
    c.positions.resize(static_cast<std::size_t>(batch * seq));
    for (std::int64_t i = 0; i < batch * seq; ++i) c.positions[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i % seq);
    return c;
  }
};

}  // namespace dsp::model
