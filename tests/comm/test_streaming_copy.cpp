// streaming_copy (non-temporal stores) against the bytes a plain copy gives, at every alignment
// of source and destination and at lengths around the 16-byte store and the 64-byte line.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dsp/comm/detail/streaming_copy.hpp"

namespace comm_streaming_copy_test {

TEST_CASE("streaming_copy writes exactly the bytes of the source, at any alignment and length") {
  // Destination guard bytes (0xee) around the copied range must stay untouched.
  std::vector<std::uint8_t> src(4096 + 64), dst(4096 + 128);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 131 + 7);
  std::int64_t wrong = 0;
  for (std::size_t so = 0; so < 16; ++so)
    for (std::size_t d_off = 0; d_off < 16; ++d_off)
      for (std::size_t len : {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 130, 1000, 4096}) {
        std::fill(dst.begin(), dst.end(), std::uint8_t{0xee});
        dsp::comm::detail::streaming_copy(dst.data() + 32 + d_off, src.data() + so, len);
        for (std::size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= 32 + d_off && i < 32 + d_off + len;
          wrong += dst[i] != (inside ? src[i - 32 - d_off + so] : std::uint8_t{0xee});
        }
      }
  CHECK(wrong == 0);
}

}  // namespace comm_streaming_copy_test
