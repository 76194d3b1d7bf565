#pragma once
// BpeTokenizer: the byte-level BPE of GPT-2 as a Hugging Face `tokenizer.json` describes it
// (model "BPE", pre_tokenizer and decoder "ByteLevel"), giving the ids the `tokenizers`
// library gives with add_special_tokens=False. Format facts from the `tokenizers` docs:
//   - added_tokens (e.g. <|endoftext|>) are matched in the raw text first, longest match;
//     the text between them is pre-tokenized and encoded on its own;
//   - ByteLevel pre-tokenizer: with add_prefix_space a ' ' is put before each such piece that
//     does not start with one; with use_regex the piece is split by GPT-2's pattern
//     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//     (implemented by hand over UTF-8 code points, see detail::split_gpt2);
//   - each byte of a split is shown as one code point (GPT-2's bytes_to_unicode: the
//     printable bytes ! .. ~, ¡ .. ¬, ® .. ÿ as themselves, the other 68 as U+0100 + n in
//     byte order); vocab keys and merges are written in that alphabet;
//   - BPE: merge the adjacent pair of lowest rank (the line of `merges`), leftmost first,
//     until no pair has a rank. merges are "a b" strings or [a, b] arrays.
// Limitation: \p{L} and \p{N} come from a small classifier, exact for U+0000-U+024F
// (ASCII, Latin-1, Latin Extended-A/B) and covering the main letter/digit blocks of Greek,
// Cyrillic, Armenian, Hebrew, Arabic, Devanagari, Thai, Hangul, kana and CJK; other
// scripts' letters count as punctuation, which can split them differently from `tokenizers`
// (the ids still decode to the same text). Normalizers, post-processor templates (BOS/EOS),
// dropout, continuing_subword_prefix and end_of_word_suffix are not supported.
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <queue>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/core/error.hpp"

namespace dsp::data {

namespace detail {

/// Class of a code point for GPT-2's split: letter (\p{L}), number (\p{N}), white space
/// (\s, the Unicode White_Space property) or other.
enum class CharClass : std::uint8_t { Letter, Number, Space, Other };

inline CharClass char_class(char32_t c) {
  auto in = [c](char32_t lo, char32_t hi) { return c >= lo && c <= hi; };
  if (c < 0x80) {
    if (in('a', 'z') || in('A', 'Z')) return CharClass::Letter;
    if (in('0', '9')) return CharClass::Number;
    if (in(0x09, 0x0D) || c == 0x20) return CharClass::Space;
    return CharClass::Other;
  }
  if (c == 0x85 || c == 0xA0 || c == 0x1680 || in(0x2000, 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
      c == 0x205F || c == 0x3000)
    return CharClass::Space;
  if (c == 0xB2 || c == 0xB3 || c == 0xB9 || in(0xBC, 0xBE) || in(0x660, 0x669) || in(0x6F0, 0x6F9) ||
      in(0x966, 0x96F) || in(0xE50, 0xE59) || in(0x2070, 0x2079) || in(0x2080, 0x2089) || in(0x2150, 0x2189) ||
      in(0x2460, 0x249B) || in(0x24EA, 0x24FF) || in(0x2776, 0x2793) || c == 0x3007 || in(0x3021, 0x3029) ||
      in(0xFF10, 0xFF19))
    return CharClass::Number;
  if (c == 0xAA || c == 0xB5 || c == 0xBA || in(0xC0, 0xD6) || in(0xD8, 0xF6) || in(0xF8, 0x2C1) ||
      in(0x2C6, 0x2D1) || in(0x2E0, 0x2E4) || c == 0x2EC || c == 0x2EE ||                       // Latin, IPA
      in(0x370, 0x374) || in(0x376, 0x377) || in(0x37A, 0x37D) || c == 0x37F || c == 0x386 ||  // Greek
      in(0x388, 0x3F5) || in(0x3F7, 0x481) || in(0x48A, 0x52F) ||                             // Cyrillic
      in(0x531, 0x556) || in(0x560, 0x588) || in(0x5D0, 0x5EA) || in(0x5EF, 0x5F2) ||         // Armenian, Hebrew
      in(0x620, 0x64A) || in(0x66E, 0x66F) || in(0x671, 0x6D3) || c == 0x6D5 ||               // Arabic
      in(0x904, 0x939) || c == 0x93D || c == 0x950 || in(0x958, 0x961) ||                     // Devanagari
      in(0xE01, 0xE30) || in(0xE32, 0xE33) || in(0xE40, 0xE46) ||                             // Thai
      in(0x1100, 0x11FF) || in(0x1E00, 0x1FBC) || in(0x3041, 0x3096) || in(0x309D, 0x309F) || in(0x30A1, 0x30FA) ||
      in(0x30FC, 0x30FF) || in(0x3131, 0x318E) || in(0x3400, 0x4DBF) || in(0x4E00, 0x9FFF) || in(0xAC00, 0xD7A3) ||
      in(0xF900, 0xFAFF) || in(0xFF21, 0xFF3A) || in(0xFF41, 0xFF5A) || in(0xFF66, 0xFFDC) || in(0x20000, 0x3134A))
    return CharClass::Letter;
  return CharClass::Other;
}

/// Decodes the code point at text[pos] into cp and returns its length in bytes; a byte that
/// does not start a valid UTF-8 sequence is one code point of class Other (cp = 0xFFFD).
inline std::size_t next_code_point(std::string_view text, std::size_t pos, char32_t& cp) {
  const auto b0 = static_cast<unsigned char>(text[pos]);
  std::size_t len = b0 < 0x80 ? 1 : (b0 >> 5) == 0x6 ? 2 : (b0 >> 4) == 0xE ? 3 : (b0 >> 3) == 0x1E ? 4 : 0;
  if (len == 1) return cp = b0, 1;
  if (len == 0 || pos + len > text.size()) return cp = 0xFFFD, 1;
  char32_t v = b0 & (0x7F >> len);
  for (std::size_t k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(text[pos + k]);
    if ((b >> 6) != 0x2) return cp = 0xFFFD, 1;
    v = (v << 6) | (b & 0x3F);
  }
  cp = v;
  return len;
}

/// Splits `text` as GPT-2's pattern (header comment) does; returns the pieces' [begin, end)
/// byte offsets, which cover the text without gaps.
inline std::vector<std::pair<std::size_t, std::size_t>> split_gpt2(std::string_view text) {
  std::vector<char32_t> cps;
  std::vector<std::size_t> off;  // byte offset of each code point, plus the end
  std::vector<CharClass> cls;
  for (std::size_t pos = 0; pos < text.size();) {
    char32_t cp;
    off.push_back(pos);
    pos += next_code_point(text, pos, cp);
    cps.push_back(cp);
    cls.push_back(char_class(cp));
  }
  const std::size_t n = cps.size();
  off.push_back(text.size());
  std::vector<std::pair<std::size_t, std::size_t>> pieces;
  for (std::size_t i = 0; i < n;) {
    std::size_t j = i;
    const char32_t c = cps[i];
    if (c == U'\'' && i + 1 < n &&
        (cps[i + 1] == U's' || cps[i + 1] == U't' || cps[i + 1] == U'm' || cps[i + 1] == U'd')) {
      j = i + 2;
    } else if (c == U'\'' && i + 2 < n &&
               ((cps[i + 1] == U'r' && cps[i + 2] == U'e') || (cps[i + 1] == U'v' && cps[i + 2] == U'e') ||
                (cps[i + 1] == U'l' && cps[i + 2] == U'l'))) {
      j = i + 3;
    } else if (cls[i] != CharClass::Space || (c == U' ' && i + 1 < n && cls[i + 1] != CharClass::Space)) {
      // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional ' ' then a run of one class.
      const std::size_t start = cls[i] == CharClass::Space ? i + 1 : i;
      j = start;
      while (j < n && cls[j] == cls[start]) ++j;
    } else {
      // `\s+(?!\S)` then `\s+`: a white-space run, less its last code point when a non-space follows.
      while (j < n && cls[j] == CharClass::Space) ++j;
      if (j < n && j - i >= 2) --j;
      else if (j < n) j = i + 1;
    }
    pieces.emplace_back(off[i], off[j]);
    i = j;
  }
  return pieces;
}

/// GPT-2's bytes_to_unicode: the code point that shows each byte in vocab keys.
inline const std::vector<char32_t>& byte_to_code_point() {
  static const std::vector<char32_t> table = [] {
    std::vector<char32_t> t(256);
    char32_t extra = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[static_cast<std::size_t>(b)] = printable ? static_cast<char32_t>(b) : extra++;
    }
    return t;
  }();
  return table;
}

/// Maps a vocab key (bytes shown as code points) back to the bytes; nullopt when the key
/// holds a code point outside the 256 of byte_to_code_point (e.g. an added token " x").
inline std::optional<std::string> unicode_to_bytes(std::string_view key) {
  static const std::unordered_map<char32_t, unsigned char> inverse = [] {
    std::unordered_map<char32_t, unsigned char> m;
    for (int b = 0; b < 256; ++b) m[byte_to_code_point()[static_cast<std::size_t>(b)]] = static_cast<unsigned char>(b);
    return m;
  }();
  std::string out;
  for (std::size_t pos = 0; pos < key.size();) {
    char32_t cp;
    pos += next_code_point(key, pos, cp);
    const auto it = inverse.find(cp);
    if (it == inverse.end()) return std::nullopt;
    out.push_back(static_cast<char>(it->second));
  }
  return out;
}

}  // namespace detail

class BpeTokenizer {
 public:
  /// Reads a Hugging Face tokenizer.json. Throws InputError naming the file when it is
  /// missing or unreadable, is not JSON, or is not a byte-level BPE this class supports
  /// (model.type other than "BPE", a normalizer, a pre-tokenizer or decoder other than
  /// ByteLevel, merges naming tokens missing from the vocab).
  static BpeTokenizer from_file(const std::filesystem::path& path) {
    std::error_code ec;
    DSP_CHECK_AS(InputError, !std::filesystem::is_directory(path, ec), "tokenizer file '", path.string(),
                 "' is a directory: give the tokenizer.json inside it");
    std::ifstream in(path, std::ios::binary);
    DSP_CHECK_AS(InputError, in.good(), "tokenizer file '", path.string(), "' cannot be opened (missing?)");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    nlohmann::json spec;
    try {
      spec = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw InputError(::dsp::detail::concat("tokenizer file '", path.string(), "' is not valid JSON: ", e.what()));
    }
    return from_json(spec, path.string());
  }

  /// Builds from a parsed tokenizer.json; `source` names it in errors (see from_file).
  static BpeTokenizer from_json(const nlohmann::json& spec, const std::string& source) {
    try {
      return build(spec, source);
    } catch (const nlohmann::json::exception& e) {
      throw InputError(::dsp::detail::concat("tokenizer file '", source, "' is malformed: ", e.what()));
    }
  }

  /// Number of ids (the largest id of the vocab and added tokens, plus one).
  std::int32_t vocab_size() const { return static_cast<std::int32_t>(bytes_.size()); }

  /// The ids of `text` (UTF-8; an invalid byte is encoded as itself), no BOS/EOS added.
  /// Words are encoded once per call and cached for the rest of it.
  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> ids;
    std::unordered_map<std::string, std::vector<std::int32_t>> cache;
    std::size_t seg_begin = 0;
    for (std::size_t pos = 0; pos < text.size();) {
      const auto m = match_added(text, pos);
      if (!m) {
        ++pos;
        continue;
      }
      encode_segment(text.substr(seg_begin, m->begin - seg_begin), ids, cache);
      ids.push_back(m->id);
      pos = seg_begin = m->end;
    }
    encode_segment(text.substr(seg_begin), ids, cache);
    return ids;
  }

  /// The bytes of `ids` (added tokens as their text; special tokens are kept). A token may
  /// be part of a UTF-8 sequence, so a slice of ids can give invalid UTF-8. Throws InputError
  /// for an id outside [0, vocab_size()) or one that no token has.
  std::string decode(const std::vector<std::int32_t>& ids) const {
    std::string out;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const auto id = ids[i];
      DSP_CHECK_AS(InputError, id >= 0 && id < vocab_size() && has_id_[static_cast<std::size_t>(id)], "tokenizer '",
                   source_, "': id ", id, " at position ", i, " is not in its vocabulary of ", vocab_size());
      out += bytes_[static_cast<std::size_t>(id)];
    }
    return out;
  }

  /// The id of a token as tokenizer.json writes it (a vocab key such as "Ġthe", or an added
  /// token such as "<|endoftext|>"); nullopt when there is none.
  std::optional<std::int32_t> find_token(std::string_view token) const {
    const auto it = token_ids_.find(std::string(token));
    if (it == token_ids_.end()) return std::nullopt;
    return it->second;
  }

  /// As find_token, but throws InputError naming the token and the file when it is missing.
  std::int32_t token_id(std::string_view token) const {
    const auto id = find_token(token);
    DSP_CHECK_AS(InputError, id.has_value(), "tokenizer '", source_, "' has no token '", token, "'");
    return *id;
  }

  /// The end-of-document id: the token "<|endoftext|>" (GPT-2's EOD, the one Megatron's GPT-2
  /// tokenizers append with --append-eod). Throws InputError naming the file when it has none.
  std::int32_t eod() const {
    const auto id = find_token("<|endoftext|>");
    DSP_CHECK_AS(InputError, id.has_value(), "tokenizer '", source_,
                 "' has no end-of-document token '<|endoftext|>' (needed by --append-eod and the document masks)");
    return *id;
  }

 private:
  struct AddedToken {
    std::string content;
    std::int32_t id;
    bool single_word, lstrip, rstrip;
  };
  struct Match {
    std::size_t begin, end;
    std::int32_t id;
  };
  struct MergeResult {
    std::int32_t rank, id;
  };
  static std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }
  static bool is_word_byte(unsigned char b) { return b >= 0x80 || b == '_' || std::isalnum(b); }
  static bool is_space_byte(char b) { return b == ' ' || (b >= '\t' && b <= '\r'); }

  static BpeTokenizer build(const nlohmann::json& spec, const std::string& source) {
    BpeTokenizer t;
    t.source_ = source;
    auto refuse = [&](bool ok, const auto&... what) {
      DSP_CHECK_AS(InputError, ok, "tokenizer file '", source, "': ", what...);
    };
    refuse(spec.is_object() && spec.contains("model") && spec["model"].is_object(), "no \"model\" object");
    const auto& model = spec["model"];
    const std::string type = model.value("type", std::string("(none)"));
    refuse(type == "BPE", "model type '", type, "' is not supported: BpeTokenizer reads byte-level BPE models");
    auto null_or_empty = [&](const char* key) {
      return !model.contains(key) || model[key].is_null() || model[key] == "";
    };
    refuse(null_or_empty("continuing_subword_prefix") && null_or_empty("end_of_word_suffix"),
           "continuing_subword_prefix / end_of_word_suffix are not supported (not a byte-level BPE)");
    refuse(!spec.contains("normalizer") || spec["normalizer"].is_null(), "normalizer '",
           spec.contains("normalizer") && spec["normalizer"].is_object() ? spec["normalizer"].value("type", std::string("?"))
                                                                   : std::string(),
           "' is not supported (only none)");
    refuse(spec.contains("pre_tokenizer") && spec["pre_tokenizer"].is_object() &&
               spec["pre_tokenizer"].value("type", std::string()) == "ByteLevel",
           "the pre_tokenizer is not ByteLevel (only ByteLevel is supported)");
    const auto& pre = spec["pre_tokenizer"];
    t.add_prefix_space_ = pre.value("add_prefix_space", false);
    t.use_regex_ = pre.value("use_regex", true);
    refuse(!spec.contains("decoder") || spec["decoder"].is_null() ||
               spec["decoder"].value("type", std::string()) == "ByteLevel",
           "the decoder is not ByteLevel (only ByteLevel is supported)");
    t.ignore_merges_ = model.contains("ignore_merges") && model["ignore_merges"].is_boolean() &&
                       model["ignore_merges"].get<bool>();

    auto add_id = [&](const std::string& key, std::int32_t id) {
      refuse(id >= 0, "token '", key, "' has the negative id ", id);
      if (static_cast<std::size_t>(id) >= t.bytes_.size()) {
        t.bytes_.resize(static_cast<std::size_t>(id) + 1);
        t.has_id_.resize(static_cast<std::size_t>(id) + 1, false);
      }
      t.token_ids_[key] = id;
      t.has_id_[static_cast<std::size_t>(id)] = true;
    };
    refuse(model.contains("vocab") && model["vocab"].is_object(), "model.vocab is not an object");
    for (const auto& [key, value] : model["vocab"].items()) {
      const auto id = value.get<std::int32_t>();
      add_id(key, id);
      const auto raw = detail::unicode_to_bytes(key);
      t.bytes_[static_cast<std::size_t>(id)] = raw ? *raw : key;
      if (raw) t.byte_ids_.emplace(*raw, id);
    }
    t.single_byte_.assign(256, -1);
    for (int b = 0; b < 256; ++b) {
      const auto it = t.byte_ids_.find(std::string(1, static_cast<char>(b)));
      if (it != t.byte_ids_.end()) t.single_byte_[static_cast<std::size_t>(b)] = it->second;
    }
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      const auto unk = model["unk_token"].get<std::string>();
      const auto it = t.token_ids_.find(unk);
      refuse(it != t.token_ids_.end(), "unk_token '", unk, "' is not in the vocab");
      t.unk_id_ = it->second;
    }

    refuse(model.contains("merges") && model["merges"].is_array(), "model.merges is not an array");
    std::int32_t rank = 0;
    for (const auto& m : model["merges"]) {
      std::string a, b;
      if (m.is_string()) {
        const auto s = m.get<std::string>();
        const auto sp = s.find(' ');
        refuse(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos, "merge ", rank, " '", s,
               "' is not two tokens separated by one space");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        refuse(m.is_array() && m.size() == 2, "merge ", rank, " is neither \"a b\" nor [a, b]");
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      }
      const auto ia = t.token_ids_.find(a), ib = t.token_ids_.find(b), iab = t.token_ids_.find(a + b);
      refuse(ia != t.token_ids_.end() && ib != t.token_ids_.end() && iab != t.token_ids_.end(), "merge ", rank,
             " ('", a, "', '", b, "') names a token missing from the vocab");
      t.merges_.emplace(pair_key(ia->second, ib->second), MergeResult{rank, iab->second});
      ++rank;
    }

    if (spec.contains("added_tokens") && spec["added_tokens"].is_array()) {
      for (const auto& a : spec["added_tokens"]) {
        AddedToken tok{a.at("content").get<std::string>(), a.at("id").get<std::int32_t>(),
                       a.value("single_word", false), a.value("lstrip", false), a.value("rstrip", false)};
        refuse(!tok.content.empty(), "added token ", tok.id, " is empty");
        add_id(tok.content, tok.id);
        t.bytes_[static_cast<std::size_t>(tok.id)] = tok.content;
        t.added_.push_back(std::move(tok));
      }
    }
    return t;
  }

  /// The longest added token starting at text[pos] (with its lstrip/rstrip white space),
  /// or nullopt.
  std::optional<Match> match_added(std::string_view text, std::size_t pos) const {
    const AddedToken* best = nullptr;
    for (const auto& a : added_) {
      if (a.content.size() <= text.size() - pos && text.compare(pos, a.content.size(), a.content) == 0 &&
          (!best || a.content.size() > best->content.size())) {
        if (a.single_word) {
          const auto end = pos + a.content.size();
          if ((pos > 0 && is_word_byte(static_cast<unsigned char>(text[pos - 1]))) ||
              (end < text.size() && is_word_byte(static_cast<unsigned char>(text[end]))))
            continue;
        }
        best = &a;
      }
    }
    if (!best) return std::nullopt;
    Match m{pos, pos + best->content.size(), best->id};
    if (best->lstrip)
      while (m.begin > 0 && is_space_byte(text[m.begin - 1])) --m.begin;
    if (best->rstrip)
      while (m.end < text.size() && is_space_byte(text[m.end])) ++m.end;
    return m;
  }

  /// Pre-tokenizes and encodes text between added tokens (a lstrip match may have moved
  /// its begin before the last segment's end: that segment is then shorter).
  void encode_segment(std::string_view seg, std::vector<std::int32_t>& ids,
                      std::unordered_map<std::string, std::vector<std::int32_t>>& cache) const {
    if (seg.empty()) return;
    std::string prefixed;
    if (add_prefix_space_ && seg.front() != ' ') {
      prefixed = " ";
      prefixed += seg;
      seg = prefixed;
    }
    auto encode_piece = [&](std::string_view piece) {
      auto it = cache.find(std::string(piece));
      if (it == cache.end()) {
        if (cache.size() > (1u << 20)) cache.clear();
        it = cache.emplace(std::string(piece), bpe(piece)).first;
      }
      ids.insert(ids.end(), it->second.begin(), it->second.end());
    };
    if (!use_regex_) return encode_piece(seg);
    for (const auto& [b, e] : detail::split_gpt2(seg)) encode_piece(seg.substr(b, e - b));
  }

  /// BPE of one pre-token (raw bytes): merges by lowest rank, leftmost first.
  std::vector<std::int32_t> bpe(std::string_view piece) const {
    if (ignore_merges_) {
      const auto it = byte_ids_.find(std::string(piece));
      if (it != byte_ids_.end()) return {it->second};
    }
    struct Symbol {
      std::int32_t id;
      int prev, next;
      bool alive;
    };
    std::vector<Symbol> sym;
    for (const char ch : piece) {
      const auto id = single_byte_[static_cast<unsigned char>(ch)];
      if (id >= 0) sym.push_back({id, static_cast<int>(sym.size()) - 1, static_cast<int>(sym.size()) + 1, true});
      else if (unk_id_ >= 0) sym.push_back({unk_id_, static_cast<int>(sym.size()) - 1, static_cast<int>(sym.size()) + 1, true});
      // else: a byte with no token is dropped, as `tokenizers` does without unk_token.
    }
    if (sym.empty()) return {};
    sym.back().next = -1;
    struct Candidate {
      std::int32_t rank;
      int pos;
      std::int32_t id;
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
    auto push = [&](int pos) {
      if (pos < 0 || sym[static_cast<std::size_t>(pos)].next < 0) return;
      const auto it = merges_.find(pair_key(sym[static_cast<std::size_t>(pos)].id,
                                            sym[static_cast<std::size_t>(sym[static_cast<std::size_t>(pos)].next)].id));
      if (it != merges_.end()) heap.push({it->second.rank, pos, it->second.id});
    };
    for (int i = 0; i + 1 < static_cast<int>(sym.size()); ++i) push(i);
    while (!heap.empty()) {
      const auto c = heap.top();
      heap.pop();
      auto& s = sym[static_cast<std::size_t>(c.pos)];
      if (!s.alive || s.next < 0) continue;
      auto& r = sym[static_cast<std::size_t>(s.next)];
      const auto it = merges_.find(pair_key(s.id, r.id));
      if (it == merges_.end() || it->second.id != c.id || it->second.rank != c.rank) continue;
      s.id = c.id;
      r.alive = false;
      s.next = r.next;
      if (s.next >= 0) sym[static_cast<std::size_t>(s.next)].prev = c.pos;
      push(s.prev);
      push(c.pos);
    }
    std::vector<std::int32_t> out;
    for (int i = 0; i >= 0; i = sym[static_cast<std::size_t>(i)].next) out.push_back(sym[static_cast<std::size_t>(i)].id);
    return out;
  }

  std::string source_;
  bool add_prefix_space_ = false, use_regex_ = true, ignore_merges_ = false;
  std::int32_t unk_id_ = -1;
  std::vector<std::string> bytes_;                             // id -> bytes it decodes to
  std::vector<bool> has_id_;                                   // id -> some token has it
  std::unordered_map<std::string, std::int32_t> token_ids_;    // key as in the file -> id
  std::unordered_map<std::string, std::int32_t> byte_ids_;     // vocab key as bytes -> id
  std::vector<std::int32_t> single_byte_;                      // byte -> id of its one-byte token, or -1
  std::unordered_map<std::uint64_t, MergeResult> merges_;      // (left id, right id) -> rank, merged id
  std::vector<AddedToken> added_;
};

}  // namespace dsp::data
