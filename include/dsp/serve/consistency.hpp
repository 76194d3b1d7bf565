#pragma once
// Helpers of the training-vs-serving consistency check: the same prompts run through the
// training layout's model and through the served (possibly resharded, KV-cached) one must
// give the same logits. Tokens are bytes (the char-level demo's vocabulary of 256).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/core/tensor.hpp"
#include "dsp/serve/byte_text.hpp"

namespace dsp::serve {

/// Largest |a[i] - b[i]| over every element of every pair of tensors (0 for empty lists).
/// NaN when any pair of elements differs by NaN, so a `<= tolerance` check fails. Throws
/// Error when the lists differ in length or a pair differs in shape.
inline double max_abs_logit_diff(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  DSP_CHECK(a.size() == b.size(), "max_abs_logit_diff: ", a.size(), " tensors against ", b.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    DSP_CHECK(a[i].shape() == b[i].shape(), "max_abs_logit_diff: tensor ", i, " is ", shape_str(a[i].shape()),
              " against ", shape_str(b[i].shape()));
    for (std::int64_t j = 0; j < a[i].numel(); ++j) {
      const double d = std::abs(static_cast<double>(a[i][j]) - b[i][j]);
      if (std::isnan(d)) return std::numeric_limits<double>::quiet_NaN();
      worst = std::max(worst, d);
    }
  }
  return worst;
}

/// Fixed byte-level text prompts of clearly different lengths (1 to 58 characters), plain
/// ASCII (every byte < 127, so a model with a vocabulary of 127 or more can read them).
inline std::vector<std::string> default_prompts() {
  return {"\n",
          "ROMEO:",
          "To be, or not",
          "JULIET:\nO Romeo, Romeo!",
          "First Citizen:\nBefore we proceed",
          "KING HENRY V:\nOnce more unto the breach",
          "MENENIUS:\nWhat work's, my countrymen, in hand?",
          "KING RICHARD III:\nNow is the winter of our discontent",
          "JAQUES:\nAll the world's a stage,\nAnd all the men and women"};
}

}  // namespace dsp::serve
