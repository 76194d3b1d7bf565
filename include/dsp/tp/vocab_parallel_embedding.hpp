#pragma once
// VocabParallelEmbedding (Megatron-LM): the table [vocab, hidden] is split by rows over the
// TP group, vocab padded up to a multiple of TP. Each rank looks up the ids in its range
// (others give zero rows) and the partial results are summed over TP.
#include <cstdint>
#include <vector>

#include "dsp/backend/host/embedding.hpp"
#include "dsp/parallel/parameter.hpp"
#include "dsp/tp/mappings.hpp"

namespace dsp::tp {

template <class Policy>
class VocabParallelEmbedding {
 public:
  using Backend = typename Policy::Backend;
  using Comm = typename Policy::Comm;

  /// name: global parameter name; table global shape [vocab, hidden].
  VocabParallelEmbedding(Comm& tp, std::string name, std::int64_t vocab, std::int64_t hidden, Init init,
                         std::uint64_t seed)
      : VocabParallelEmbedding(tp, ParameterSpec{ShardedTensor::vocab(std::move(name), {vocab, hidden}), init}, seed) {}
  /// The table `weight` (a ShardedTensor::vocab [vocab, hidden]), this rank's rows.
  VocabParallelEmbedding(Comm& tp, const ParameterSpec& weight, std::uint64_t seed)
      : tp_(&tp), vocab_(weight.tensor.global_shape.at(0)), weight_(weight, seed, tp.size(), tp.rank()) {}

  /// ids [tokens] in [0, vocab) -> [tokens, hidden], the same on every TP rank.
  /// Throws InputError for an id outside the vocabulary.
  Tensor forward(const std::vector<std::int32_t>& ids) const {
    for (auto id : ids)
      DSP_CHECK_AS(InputError, id >= 0 && id < vocab_, "token id ", id, " outside the vocabulary [0, ", vocab_, ")");
    const auto n = static_cast<std::int64_t>(ids.size());
    Tensor out({n, hidden()});
    embedding_forward(Backend{}, SpaceArray<std::int32_t>(ids).data(), n, weight_.value.data(), rows_local(),
                      row_offset(), hidden(), out.data());
    ReduceFromTpRegion::forward(*tp_, out);
    return out;
  }
  /// dy [tokens, hidden] (the same on every TP rank): accumulates this rank's rows of dW.
  void backward(const std::vector<std::int32_t>& ids, const Tensor& dy) {
    embedding_backward(Backend{}, SpaceArray<std::int32_t>(ids).data(), static_cast<std::int64_t>(ids.size()),
                       dy.data(), rows_local(), row_offset(), hidden(), weight_.grad.data());
  }

  Parameter& weight() { return weight_; }
  std::int64_t hidden() const { return weight_.value.dim(1); }
  std::int64_t rows_local() const { return weight_.value.dim(0); }
  std::int64_t row_offset() const { return rows_local() * tp_->rank(); }

 private:
  Comm* tp_;
  std::int64_t vocab_;
  Parameter weight_;
};

}  // namespace dsp::tp
