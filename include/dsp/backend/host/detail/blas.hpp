#pragma once
// Internals shared by the host ops that call OpenBLAS through CBLAS.
#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <mutex>

#include "dsp/core/error.hpp"
#include "dsp/core/threads.hpp"

namespace dsp::backend::detail {

/// Narrows a size to CBLAS's integer type; throws Error when it does not fit.
inline blasint blas_int(std::int64_t v) {
  DSP_CHECK(v >= 0 && v <= std::numeric_limits<blasint>::max(), "size ", v, " does not fit a CBLAS integer");
  return static_cast<blasint>(v);
}

/// OpenBLAS's own cap on its threads: OPENBLAS_NUM_THREADS when set to a positive number, as
/// OpenBLAS users expect it to be honoured; otherwise none (0). Read once.
inline int blas_threads_cap() {
  static const int cap = [] {
    const char* v = std::getenv("OPENBLAS_NUM_THREADS");
    const int n = v != nullptr ? std::atoi(v) : 0;
    return n > 0 ? n : 0;
  }();
  return cap;
}

/// Makes OpenBLAS use dsp::threads_per_rank() threads, at most blas_threads_cap(). Call before
/// every CBLAS call: ranks running as threads change threads_per_rank(), and OpenBLAS's thread
/// count is process-wide. The last value set is cached behind a mutex so that
/// openblas_set_num_threads (which rebuilds OpenBLAS's pool) runs only when the value changes.
inline void use_blas_threads() {
  static std::mutex mutex;
  static int current = 0;
  const int wanted = blas_threads_cap() > 0 ? std::min(threads_per_rank(), blas_threads_cap()) : threads_per_rank();
  const std::lock_guard lock(mutex);
  if (wanted != current) {
    openblas_set_num_threads(wanted);
    current = wanted;
  }
}

}  // namespace dsp::backend::detail
