#pragma once
// StopChecker: a request's generated text as it grows token by token, and the stop strings
// matched on it across token boundaries (a stop string may span several tokens). Text that
// could still turn out to be the start of a stop string is held back until it cannot (vLLM's
// stop buffer), so a stream never shows text that is later cut; the match and what follows
// it are never shown.
#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dsp::serve {

class StopChecker {
 public:
  explicit StopChecker(std::vector<std::string> stop = {}) : stop_(std::move(stop)) {
    for (const auto& s : stop_) longest_ = std::max(longest_, s.size());
  }

  /// Appends the bytes of one generated token. Returns true when a stop string now occurs in
  /// the text: the text is then cut before its first occurrence (the earliest-ending match
  /// wins, then the longest).
  bool append(std::string_view token_text) {
    const std::size_t before = text_.size();
    text_ += token_text;
    if (stop_.empty()) return false;
    // A new match must end in the new bytes: search from longest - 1 bytes before them.
    const std::size_t from = before >= longest_ ? before - longest_ + 1 : 0;
    std::optional<std::size_t> cut;
    std::size_t cut_end = 0;
    for (const auto& s : stop_) {
      const std::size_t at = text_.find(s, from);
      if (at == std::string::npos) continue;
      const std::size_t end = at + s.size();
      if (!cut || end < cut_end || (end == cut_end && at < *cut)) {
        cut = at;
        cut_end = end;
      }
    }
    if (!cut) return false;
    text_.resize(*cut);
    stopped_ = true;
    return true;
  }

  /// The text shown so far grows to: everything once finished (`finished`), else all but the
  /// bytes that could begin a stop string. Returns the newly released bytes.
  std::string release(bool finished) {
    std::size_t upto = text_.size();
    if (!finished && !stopped_ && longest_ > 1) upto = text_.size() >= longest_ - 1 ? text_.size() - (longest_ - 1) : 0;
    upto = std::max(upto, released_);
    std::string out = text_.substr(released_, upto - released_);
    released_ = upto;
    return out;
  }

  /// The generated text (cut before a stop string).
  const std::string& text() const { return text_; }

 private:
  std::vector<std::string> stop_;
  std::size_t longest_ = 0;
  std::string text_;
  std::size_t released_ = 0;
  bool stopped_ = false;
};

}  // namespace dsp::serve
