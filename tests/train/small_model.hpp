#pragma once
// The small model and data the training tests share: a 2-layer decoder on tiny Shakespeare
// bytes. vocab 127 (ASCII) is not a multiple of 2 or 4, so vocabulary padding is exercised;
// 2 query groups for 4 heads means that at TP4 every K/V head is replicated on two ranks.
#include <map>
#include <mutex>
#include <string>

#include "../data_dir.hpp"
#include "dsp/model/config.hpp"
#include "dsp/train/token_dataset.hpp"

namespace dsp::test {

inline model::ModelConfig small_model(bool tied = false) {
  return {.vocab_size = 127, .hidden_size = 32, .num_layers = 2, .num_attention_heads = 4, .num_query_groups = 2,
          .ffn_hidden_size = 64, .seq_length = 16, .tie_word_embeddings = tied};
}

/// small_model(tied = true) made a DeepSeekMoE model: 3 layers, the first dense, then 8 routed
/// experts (top-2, renormalised weights, [16]-wide) and one shared expert.
inline model::ModelConfig small_moe_model() {
  auto config = small_model(true);
  config.num_layers = 3;
  config.num_experts = 8;
  config.moe_router_topk = 2;
  config.moe_ffn_hidden_size = 16;
  config.num_shared_experts = 1;
  config.first_k_dense_replace = 1;
  config.moe_router_norm_topk_prob = true;
  return config;
}

/// `config` with DeepSeek-V3's attention: MLA with a query latent 16, KV latent 16, no-RoPE 8,
/// RoPE 4, value 8, YaRN (factor 4 over 16 positions, mscale != mscale_all_dim); no query groups.
inline model::ModelConfig with_mla(model::ModelConfig config) {
  config.num_query_groups = config.num_attention_heads;
  config.q_lora_rank = 16;
  config.kv_lora_rank = 16;
  config.qk_nope_head_dim = 8;
  config.qk_rope_head_dim = 4;
  config.v_head_dim = 8;
  config.rope_scaling = {.type = "yarn", .factor = 4, .original_max_position_embeddings = 16, .beta_fast = 32,
                         .beta_slow = 1, .mscale = 1.0, .mscale_all_dim = 0.8};
  return config;
}

/// tinyshakespeare.txt from the repository's data/ as windows of seq_length tokens (read once
/// per length; safe to call from several threads).
inline const train::TokenDataset& shakespeare(std::int64_t seq_length) {
  static std::mutex mu;
  static std::map<std::int64_t, train::TokenDataset> by_length;
  std::lock_guard lock(mu);
  auto it = by_length.find(seq_length);
  if (it == by_length.end())
    it = by_length
             .emplace(seq_length, train::TokenDataset::from_file(
                                      data_dir() + "/tinyshakespeare.txt", seq_length))
             .first;
  return it->second;
}

}  // namespace dsp::test
