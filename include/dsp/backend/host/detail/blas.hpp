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

/// A cap on OpenBLAS's threads from the value of OPENBLAS_NUM_THREADS (nullptr: unset): the
/// number when it is positive, else 0 (no cap). dsp honours it, as OpenBLAS users expect.
inline int blas_threads_cap(const char* value) {
  const int n = value != nullptr ? std::atoi(value) : 0;
  return n > 0 ? n : 0;
}

/// BLAS threads for this rank: threads_per_rank(), at most OPENBLAS_NUM_THREADS (read once).
inline int blas_threads() {
  static const int cap = blas_threads_cap(std::getenv("OPENBLAS_NUM_THREADS"));
  return cap > 0 ? std::min(threads_per_rank(), cap) : threads_per_rank();
}

/// Makes OpenBLAS use blas_threads() threads. Call before
/// every CBLAS call: ranks running as threads change threads_per_rank(), and OpenBLAS's thread
/// count is process-wide. The last value set is cached behind a mutex so that
/// openblas_set_num_threads (which rebuilds OpenBLAS's pool) runs only when the value changes.
inline void use_blas_threads() {
  static std::mutex mutex;
  static int current = 0;
  const int wanted = blas_threads();
  const std::lock_guard lock(mutex);
  if (wanted != current) {
    openblas_set_num_threads(wanted);
    current = wanted;
  }
}

}  // namespace dsp::backend::detail
