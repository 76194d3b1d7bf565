#pragma once
// Utf8Stream: turns the bytes a byte-level model generates, a few at a time, into valid UTF-8
// text without ever splitting a character between two pieces of a stream.
//
// Every ill-formed part becomes U+FFFD as the Unicode Standard recommends ("substitution of
// maximal subparts", Unicode 15, section 3.9, U+FFFD Substitution of Maximal Subparts; the
// well-formed sequences are its Table 3-7). A piece of text is released as soon as it can no
// longer change: a lead byte and the continuation bytes seen so far are held back until the
// character completes or is known to be ill-formed. So the text released is the same however
// the bytes were split: push(a) + push(b) + flush() == push(a + b) + flush() for all a, b
// (tests/serve/test_utf8_stream.cpp checks it on random splits), which is what makes a
// streamed completion equal to the same completion not streamed.
#include <cstddef>
#include <string>
#include <string_view>

namespace dsp::serve {

class Utf8Stream {
 public:
  /// Appends `bytes` and returns the text that became final: valid UTF-8.
  std::string push(std::string_view bytes) {
    pending_.append(bytes);
    return take(false);
  }
  /// Ends the stream: returns what was held back (an incomplete sequence becomes U+FFFD).
  std::string flush() { return take(true); }
  /// `bytes` as valid UTF-8 (push + flush of a new stream).
  static std::string sanitize(std::string_view bytes) {
    Utf8Stream s;
    std::string out = s.push(bytes);
    return out + s.flush();
  }

 private:
  static constexpr std::string_view replacement = "\xEF\xBF\xBD";  // U+FFFD

  // Length of the well-formed sequence a lead byte starts (0: the byte cannot start one), and
  // the allowed range of the second byte (Table 3-7; the others are 80..BF).
  struct Lead {
    int length;
    unsigned char lo, hi;
  };
  static Lead lead(unsigned char b) {
    if (b < 0x80) return {1, 0, 0};
    if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
    if (b == 0xE0) return {3, 0xA0, 0xBF};
    if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) return {3, 0x80, 0xBF};
    if (b == 0xED) return {3, 0x80, 0x9F};
    if (b == 0xF0) return {4, 0x90, 0xBF};
    if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
    if (b == 0xF4) return {4, 0x80, 0x8F};
    return {0, 0, 0};
  }

  std::string take(bool final) {
    std::string out;
    std::size_t i = 0;
    const std::size_t n = pending_.size();
    while (i < n) {
      const auto b = static_cast<unsigned char>(pending_[i]);
      const Lead l = lead(b);
      if (l.length == 0) {  // a continuation byte or a byte that never occurs in UTF-8
        out += replacement;
        ++i;
        continue;
      }
      // Bytes of a well-formed prefix of the sequence starting at i.
      std::size_t k = 1;
      while (k < static_cast<std::size_t>(l.length) && i + k < n) {
        const auto c = static_cast<unsigned char>(pending_[i + k]);
        const bool ok = k == 1 ? (c >= l.lo && c <= l.hi) : (c >= 0x80 && c <= 0xBF);
        if (!ok) break;
        ++k;
      }
      if (k == static_cast<std::size_t>(l.length)) {
        out.append(pending_, i, k);
      } else if (i + k == n && !final) {
        break;  // may still complete: hold back
      } else {
        out += replacement;  // the maximal subpart pending_[i, i + k) is ill-formed
      }
      i += k;
    }
    pending_.erase(0, i);
    return out;
  }

  std::string pending_;  // an incomplete, so far well-formed sequence (at most 3 bytes)
};

}  // namespace dsp::serve
