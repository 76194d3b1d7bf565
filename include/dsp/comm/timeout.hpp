#pragma once
// The communicators' default timeout: how long one operation waits for its peers.
#include <chrono>
#include <cstdlib>

#include "dsp/core/error.hpp"

namespace dsp::comm {

/// 300 s, or the environment variable DSP_COMM_TIMEOUT_S (seconds, fractions allowed). Throws
/// ConfigError when the variable is not a positive number.
inline std::chrono::milliseconds default_timeout() {
  const char* s = std::getenv("DSP_COMM_TIMEOUT_S");
  if (!s) return std::chrono::seconds(300);
  char* end = nullptr;
  const double seconds = std::strtod(s, &end);
  DSP_CHECK_AS(ConfigError, end != s && *end == '\0' && seconds > 0,
               "DSP_COMM_TIMEOUT_S must be a positive number of seconds, got '", s, "'");
  return std::chrono::milliseconds(static_cast<long>(seconds * 1000));
}

}  // namespace dsp::comm
