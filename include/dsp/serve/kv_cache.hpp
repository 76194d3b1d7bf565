#pragma once
// KvCache: keys and values of every layer for a batch of sequences being generated, on one
// TP rank (its kv heads only). Memory = 2 x layers x batch x capacity x kv_heads_local x
// head_dim x 4 bytes (fp32), the ledger's formula of DESIGN.md section 5.
#include <cstdint>
#include <vector>

#include "dsp/core/tensor.hpp"

namespace dsp::serve {

class KvCache {
 public:
  /// k and v of each layer are [batch, capacity, kv_heads_local, head_dim], zero-filled.
  KvCache(std::int64_t layers, std::int64_t batch, std::int64_t capacity, std::int64_t kv_heads_local,
          std::int64_t head_dim)
      : batch_(batch), capacity_(capacity) {
    for (std::int64_t l = 0; l < layers; ++l) {
      k_.emplace_back(Shape{batch, capacity, kv_heads_local, head_dim});
      v_.emplace_back(Shape{batch, capacity, kv_heads_local, head_dim});
    }
  }

  Tensor& k(std::int64_t layer) { return k_.at(static_cast<std::size_t>(layer)); }
  Tensor& v(std::int64_t layer) { return v_.at(static_cast<std::size_t>(layer)); }
  std::int64_t batch() const { return batch_; }
  /// Longest sequence (prompt + generated tokens) a row can hold, in tokens.
  std::int64_t capacity() const { return capacity_; }
  /// Bytes held by this cache on this rank.
  std::int64_t bytes() const {
    std::int64_t n = 0;
    for (const auto& t : k_) n += 2 * t.numel() * static_cast<std::int64_t>(sizeof(float));
    return n;
  }

 private:
  std::int64_t batch_, capacity_;
  std::vector<Tensor> k_, v_;
};

}  // namespace dsp::serve
