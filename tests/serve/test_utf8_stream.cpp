// Utf8Stream: ill-formed UTF-8 replaced as the Unicode Standard recommends (its own example),
// well-formed text unchanged, and the text released independent of how the bytes are split.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>

#include "dsp/serve/utf8_stream.hpp"

using dsp::serve::Utf8Stream;

namespace {

const std::string fffd = "\xEF\xBF\xBD";

// UTF-8 of code point cp (a scalar value), from the definition (Table 3-6): n - 1
// continuation bytes of 6 bits each, low bits last, and a lead byte of n one bits, a zero, and
// the rest.
std::string encode(std::uint32_t cp) {
  const int n = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
  if (n == 1) return std::string(1, static_cast<char>(cp));
  std::string s(static_cast<std::size_t>(n), '\0');
  for (int i = n - 1; i > 0; --i, cp >>= 6) s[static_cast<std::size_t>(i)] = static_cast<char>(0x80 | (cp & 0x3F));
  s[0] = static_cast<char>(((0xFF00 >> n) & 0xFF) | cp);
  return s;
}

}  // namespace

TEST_CASE("Utf8Stream: the Unicode Standard's example of maximal subparts (Table 3-8)") {
  // 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64 -> a FFFD FFFD FFFD b FFFD c FFFD FFFD d
  const std::string in = "\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64";
  CHECK(Utf8Stream::sanitize(in) == "a" + fffd + fffd + fffd + "b" + fffd + "c" + fffd + fffd + "d");
  // Non-shortest forms and surrogates: every byte its own subpart (Table 3-7's second-byte ranges).
  CHECK(Utf8Stream::sanitize("\xC0\xAF") == fffd + fffd);
  CHECK(Utf8Stream::sanitize("\xE0\x80\xAF") == fffd + fffd + fffd);
  CHECK(Utf8Stream::sanitize("\xED\xA0\x80") == fffd + fffd + fffd);
  CHECK(Utf8Stream::sanitize("\xF4\x90\x80\x80") == fffd + fffd + fffd + fffd);
  CHECK(Utf8Stream::sanitize("\xFF") == fffd);
}

TEST_CASE("Utf8Stream: holds back an incomplete character until it completes or fails") {
  Utf8Stream s;
  const std::string euro = "\xE2\x82\xAC";  // U+20AC
  CHECK(s.push("a\xE2") == "a");
  CHECK(s.push("\x82") == "");
  CHECK(s.push("\xAC!") == euro + "!");
  CHECK(s.push("\xF0\x9F") == "");
  CHECK(s.push("x") == fffd + "x");  // the 4-byte sequence broke off: one U+FFFD for its subpart
  CHECK(s.push("\xC3") == "");
  CHECK(s.flush() == fffd);           // the end of the stream ends the incomplete character
  CHECK(s.flush() == "");
}

TEST_CASE("Utf8Stream: well-formed text passes unchanged; any split releases the same text") {
  std::mt19937 gen(5);
  for (int trial = 0; trial < 300; ++trial) {
    CAPTURE(trial);
    std::string valid;
    for (int i = 0; i < 40; ++i) {
      std::uint32_t cp = 0;
      switch (gen() % 4) {
        case 0: cp = gen() % 0x80; break;
        case 1: cp = 0x80 + gen() % (0x800 - 0x80); break;
        case 2: do cp = 0x800 + gen() % (0x10000 - 0x800); while (cp >= 0xD800 && cp <= 0xDFFF); break;
        default: cp = 0x10000 + gen() % (0x110000 - 0x10000);
      }
      valid += encode(cp);
    }
    CHECK(Utf8Stream::sanitize(valid) == valid);
    // Random bytes, biased to lead and continuation bytes, cut at random points.
    std::string bytes = valid;
    for (int i = 0; i < 20; ++i) bytes[gen() % bytes.size()] = static_cast<char>(gen() % 2 ? 0x80 + gen() % 0x40 : 0xC0 + gen() % 0x40);
    const std::string whole = Utf8Stream::sanitize(bytes);
    CHECK(Utf8Stream::sanitize(whole) == whole);  // the output is well-formed
    Utf8Stream s;
    std::string pieces;
    for (std::size_t i = 0; i < bytes.size();) {
      const std::size_t n = std::min<std::size_t>(bytes.size() - i, gen() % 5);
      pieces += s.push(std::string_view(bytes).substr(i, n));
      i += n;
    }
    pieces += s.flush();
    CHECK(pieces == whole);
  }
}
