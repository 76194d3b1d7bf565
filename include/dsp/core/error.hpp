#pragma once
// Error family and DSP_CHECK. Library code reports failures by throwing; it never exits.
#include <sstream>
#include <stdexcept>
#include <string>

namespace dsp {

/// Base of every error dsp throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
/// A configuration or layout that cannot work (does not divide, out of range).
class ConfigError : public Error {
 public:
  using Error::Error;
};
/// A checkpoint that is missing, truncated, corrupted or of another model.
class CheckpointError : public Error {
 public:
  using Error::Error;
};
/// A collective or point-to-point operation that failed, timed out or was aborted.
class CommError : public Error {
 public:
  using Error::Error;
};
/// A collective that waited longer than the communicator's timeout.
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};
/// Raised on ranks whose pending operation was cancelled because another rank failed.
class AbortedError : public CommError {
 public:
  using CommError::CommError;
};
/// Bad input data (missing file, prompt longer than the sequence length, ...).
class InputError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace dsp

/// Throws ErrorType with the streamed message when cond is false.
#define DSP_CHECK_AS(ErrorType, cond, ...)                                  \
  do {                                                                      \
    if (!(cond)) throw ErrorType(::dsp::detail::concat(__VA_ARGS__));       \
  } while (0)

/// Throws dsp::Error with the streamed message (e.g. DSP_CHECK(a % b == 0, "a=", a)).
#define DSP_CHECK(cond, ...) DSP_CHECK_AS(::dsp::Error, cond, __VA_ARGS__)
