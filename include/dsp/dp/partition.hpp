#pragma once
// How ZeRO stages 1-3 split one parameter's local shard over a data-parallel group
// (Rajbhandari et al., SC'20, section 5): the shard's n elements, flattened, are padded to a
// multiple of the group size N; rank r owns the contiguous slice [r s, (r + 1) s) with
// s = ceil(n / N). Elements at or past n are padding: zero in every buffer, never updated,
// never saved. Partitioning each parameter on its own (as DeepSpeed's stage 3 does) lets
// stage 3 gather one layer's parameters without touching any other layer's.
#include <algorithm>
#include <cstdint>

#include "dsp/core/divide.hpp"
#include "dsp/core/error.hpp"

namespace dsp::dp {

/// The slice of a parameter's flat local shard one data-parallel rank owns.
struct ShardRange {
  std::int64_t numel = 0;  ///< elements of the whole (unpartitioned) local shard
  std::int64_t size = 0;   ///< s = ceil(numel / N): elements per rank, padding included
  std::int64_t begin = 0;  ///< r s: first owned flat index
  /// One past the last owned element that is not padding (<= begin when all padding).
  std::int64_t end() const { return std::min(begin + size, numel); }
  /// Owned elements that are not padding (0 for a rank past the end).
  std::int64_t valid() const { return std::max<std::int64_t>(0, end() - begin); }
};

/// Rank `rank`'s slice of `numel` elements over `size` ranks. Throws Error when size < 1,
/// rank is outside [0, size) or numel < 0.
inline ShardRange shard_range(std::int64_t numel, int size, int rank) {
  DSP_CHECK(size >= 1 && rank >= 0 && rank < size && numel >= 0, "data-parallel partition: rank ", rank, " of ", size,
            " cannot own a slice of ", numel, " elements");
  const std::int64_t s = round_up(numel, size) / size;
  return {numel, s, s * rank};
}

}  // namespace dsp::dp
