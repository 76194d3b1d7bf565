#pragma once
// Generator: autoregressive generation with a KV cache over a tensor-parallel CausalLM.
// A request's prompts run as one batch: one prefill forward over every prompt, then one
// decode forward per new token. Each step's logits are gathered over the TP group and every
// TP rank samples the same tokens (sampling is a pure function of the logits and of
// (seed, prompt index, token index), see sampler.hpp).
//
// Padding invariant (prefill of prompts of different lengths). Prompts are padded on the
// right to the longest, L tokens; row b's padding tokens sit at positions len_b .. L-1 and
// write garbage keys/values into cache rows len_b .. L-1. No real query ever sees them:
// a real prompt token at position p < len_b attends keys j <= p only, and decode step s
// feeds row b's token at position len_b + s, which overwrites cache row len_b + s before the
// attention of that same forward reads it. So by the time a query at position p runs, cache
// rows 0..p of its row hold that sequence's own keys and values only.
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "dsp/backend/host/copy_columns.hpp"
#include "dsp/backend/host/elementwise.hpp"
#include "dsp/model/causal_lm.hpp"
#include "dsp/serve/kv_cache.hpp"
#include "dsp/serve/sampler.hpp"
#include "dsp/tp/mappings.hpp"

namespace dsp::serve {

template <class Policy>
class Generator {
 public:
  using Backend = typename Policy::Backend;
  /// Token id used to pad short prompts in a prefill (any valid id: padding never reaches a
  /// real query, see the padding invariant above).
  static constexpr std::int32_t pad_token = 0;

  /// Serves `model`, which must outlive the generator.
  explicit Generator(model::CausalLM<Policy>& model) : model_(&model) {}

  /// The new tokens of each prompt: prompts[i] (token ids in [0, vocab)) continued by
  /// max_new_tokens tokens drawn with `params`, prompt i using random stream first_stream + i
  /// (first_stream lets a request split over several calls keep each prompt's stream).
  /// Collective over the model's TP group: every TP rank calls it with the same arguments
  /// and returns the same tokens; blocks until done. Throws InputError for an empty prompt,
  /// a token id outside the vocabulary, a negative max_new_tokens, invalid params, or a
  /// prompt whose length plus max_new_tokens exceeds the model's seq_length.
  std::vector<std::vector<std::int32_t>> generate(const std::vector<std::vector<std::int32_t>>& prompts,
                                                  std::int64_t max_new_tokens, const SamplingParams& params,
                                                  std::uint64_t first_stream = 0) {
    params.validate();
    DSP_CHECK_AS(InputError, max_new_tokens >= 0, "max new tokens must be >= 0, got ", max_new_tokens);
    const std::int64_t seq_length = model_->config().seq_length;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      check_prompt(prompts[i], i);
      const auto len = static_cast<std::int64_t>(prompts[i].size());
      DSP_CHECK_AS(InputError, len + max_new_tokens <= seq_length, "prompt ", i, ": prompt of ", len, " tokens plus ",
                   max_new_tokens, " new tokens exceeds --seq-length ", seq_length);
    }
    std::vector<std::vector<std::int32_t>> out(prompts.size());
    if (prompts.empty() || max_new_tokens == 0) return out;

    const auto batch = static_cast<std::int64_t>(prompts.size());
    const std::int64_t vocab = model_->config().vocab_size;
    KvCache cache = make_cache(batch);
    Tensor logits = prefill(cache, prompts);
    std::vector<std::int32_t> tokens(prompts.size()), positions(prompts.size());
    for (std::int64_t step = 0;; ++step) {
      for (std::size_t b = 0; b < prompts.size(); ++b) {
        const std::span<const float> row = logits.span().subspan(  // host logits: span() throws for others
            static_cast<std::size_t>(static_cast<std::int64_t>(b) * vocab), static_cast<std::size_t>(vocab));
        tokens[b] = sample_token(row, vocab, params, first_stream + b, static_cast<std::uint64_t>(step));
        positions[b] = static_cast<std::int32_t>(static_cast<std::int64_t>(prompts[b].size()) + step);
        out[b].push_back(tokens[b]);
      }
      if (step + 1 == max_new_tokens) return out;
      logits = decode(cache, tokens, positions);
    }
  }

  /// An empty cache for `batch` sequences of up to seq_length tokens, holding this rank's
  /// kv heads: KvCache(layers, batch, seq_length, kv_heads_local, head_dim).
  KvCache make_cache(std::int64_t batch) const {
    const auto& c = model_->config();
    return KvCache(c.num_layers, batch, c.seq_length, model_->kv_heads_local(), c.head_dim());
  }

  /// Prefill: runs every prompt (padded on the right to the longest, positions 0..len-1,
  /// writing cache rows 0..len-1 of its batch row) and returns the gathered logits of each
  /// prompt's last token [prompts, vocab] (padding columns dropped), the same on every rank.
  /// Collective over the TP group. Throws InputError for an empty prompt, an id outside the
  /// vocabulary or a prompt longer than the cache, and Error when cache.batch() differs from
  /// the number of prompts.
  Tensor prefill(KvCache& cache, const std::vector<std::vector<std::int32_t>>& prompts) {
    const auto batch = static_cast<std::int64_t>(prompts.size());
    DSP_CHECK(cache.batch() == batch, "prefill: a cache of ", cache.batch(), " rows for ", batch, " prompts");
    std::int64_t longest = 0;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      check_prompt(prompts[i], i);
      longest = std::max(longest, static_cast<std::int64_t>(prompts[i].size()));
    }
    DSP_CHECK_AS(InputError, longest <= cache.capacity(), "prefill: a prompt of ", longest,
                 " tokens does not fit a cache of ", cache.capacity(), " positions");
    model::ForwardContext ctx = model::ForwardContext::for_serving(batch, longest, {}, &cache);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(batch * longest), pad_token);
    ctx.positions.resize(ids.size());
    for (std::int64_t b = 0; b < batch; ++b) {
      const auto& prompt = prompts[static_cast<std::size_t>(b)];
      std::copy(prompt.begin(), prompt.end(), ids.begin() + b * longest);
      for (std::int64_t t = 0; t < longest; ++t)
        ctx.positions[static_cast<std::size_t>(b * longest + t)] = static_cast<std::int32_t>(t);
    }
    const Tensor local = model_->logits(ctx, ids);  // [batch * longest, padded_vocab / tp]
    const std::int64_t cols = local.dim(1);
    Tensor last({batch, cols});
    for (std::int64_t b = 0; b < batch; ++b) {
      const auto len = static_cast<std::int64_t>(prompts[static_cast<std::size_t>(b)].size());
      copy(Backend{}, cols, local.data() + (b * longest + len - 1) * cols, last.data() + b * cols);
    }
    return gathered(last);
  }

  /// Decode step: row b's token tokens[b] at position positions[b]; cache rows
  /// 0..positions[b]-1 of row b must hold that sequence (prefill and earlier steps). Writes
  /// cache row positions[b] and returns the gathered next-token logits [batch, vocab], the
  /// same on every rank. Collective over the TP group. Throws Error when the sizes differ
  /// from cache.batch() and InputError for a position outside the cache or an id outside
  /// the vocabulary.
  Tensor decode(KvCache& cache, const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& positions) {
    const std::int64_t batch = cache.batch();
    DSP_CHECK(static_cast<std::int64_t>(tokens.size()) == batch && static_cast<std::int64_t>(positions.size()) == batch,
              "decode: ", tokens.size(), " tokens and ", positions.size(), " positions for a cache of ", batch,
              " rows");
    for (auto p : positions)
      DSP_CHECK_AS(InputError, p >= 0 && p < cache.capacity(), "decode: position ", p, " outside the cache of ",
                   cache.capacity(), " positions");
    const auto ctx = model::ForwardContext::for_serving(batch, 1, positions, &cache);
    return gathered(model_->logits(ctx, tokens));
  }

  /// Logits of every position of `prompt` [len, vocab] (padding columns dropped) from one
  /// forward without cache (the training path's attention), gathered over the TP group; the
  /// reference that cached decoding is checked against. Collective over the TP group. Throws
  /// InputError for an empty prompt, an id outside the vocabulary or more than seq_length
  /// tokens.
  Tensor full_logits(const std::vector<std::int32_t>& prompt) {
    check_prompt(prompt, 0);
    const auto len = static_cast<std::int64_t>(prompt.size());
    DSP_CHECK_AS(InputError, len <= model_->config().seq_length, "prompt of ", len, " tokens exceeds --seq-length ",
                 model_->config().seq_length);
    model::ForwardContext ctx = model::ForwardContext::for_training(1, len);
    ctx.training = false;
    return gathered(model_->logits(ctx, prompt));
  }

 private:
  // Throws InputError when prompt `index` is empty or holds an id outside [0, vocab).
  void check_prompt(const std::vector<std::int32_t>& prompt, std::size_t index) const {
    const std::int64_t vocab = model_->config().vocab_size;
    DSP_CHECK_AS(InputError, !prompt.empty(), "prompt ", index, " is empty");
    for (auto id : prompt)
      DSP_CHECK_AS(InputError, id >= 0 && id < vocab, "prompt ", index, ": token id ", id,
                   " outside the vocabulary [0, ", vocab, ")");
  }

  // This rank's logits [rows, padded_vocab / tp] -> all of them [rows, vocab]: all-gathered
  // over the TP group, padding columns dropped.
  Tensor gathered(const Tensor& local) {
    Tensor full = tp::GatherFromTpRegion<Backend>::forward(model_->tensor_group(), local);
    const std::int64_t vocab = model_->config().vocab_size, rows = full.dim(0);
    if (full.dim(1) == vocab) return full;
    Tensor out({rows, vocab});
    copy_columns(Backend{}, full.data(), full.dim(1), 0, out.data(), vocab, 0, rows, vocab);
    return out;
  }

  model::CausalLM<Policy>* model_;
};

}  // namespace dsp::serve
