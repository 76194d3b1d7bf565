#pragma once
// Token embedding lookup, vocab-parallel aware (Megatron-LM VocabParallelEmbedding): this rank
// holds table rows [row_offset, row_offset + rows); ids outside that range give zero rows,
// which another rank supplies (the layer all-reduces the outputs over the tensor group).
#include <cstdint>

#include "dsp/backend/host/elementwise.hpp"
#include "dsp/backend/host/host.hpp"

namespace dsp::backend {

/// out [tokens, hidden] = table [rows, hidden] [ids[t] - row_offset] for ids [tokens] in this
/// rank's range, zero rows for the others. Overwrites out.
inline void embedding_forward(Host h, const std::int32_t* ids, std::int64_t tokens, const float* table,
                              std::int64_t rows, std::int64_t row_offset, std::int64_t hidden, float* out) {
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int64_t row = ids[t] - row_offset;
    float* dst = out + t * hidden;
    if (row >= 0 && row < rows) copy(h, hidden, table + row * hidden, dst);
    else fill(h, hidden, 0.0f, dst);
  }
}

/// dtable [rows, hidden] [ids[t] - row_offset] += dout [tokens, hidden] [t] for ids [tokens] in
/// this rank's range (repeated ids add up); other ids are skipped. Accumulates into dtable.
inline void embedding_backward(Host h, const std::int32_t* ids, std::int64_t tokens, const float* dout,
                               std::int64_t rows, std::int64_t row_offset, std::int64_t hidden, float* dtable) {
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int64_t row = ids[t] - row_offset;
    if (row >= 0 && row < rows) add(h, hidden, dout + t * hidden, dtable + row * hidden);
  }
}

}  // namespace dsp::backend
