#pragma once
// Internals shared by the host ops that call OpenBLAS through CBLAS.
#include <cblas.h>

#include <cstdint>
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

/// Makes OpenBLAS use dsp::threads_per_rank() threads. Call before every CBLAS call: ranks
/// running as threads change threads_per_rank(), and OpenBLAS's thread count is process-wide.
/// The last value set is cached behind a mutex so that openblas_set_num_threads (which
/// rebuilds OpenBLAS's pool) runs only when the value changes.
inline void use_blas_threads() {
  static std::mutex mutex;
  static int current = 0;
  const int wanted = threads_per_rank();
  const std::lock_guard lock(mutex);
  if (wanted != current) {
    openblas_set_num_threads(wanted);
    current = wanted;
  }
}

}  // namespace dsp::backend::detail
