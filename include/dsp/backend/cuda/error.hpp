#pragma once
// CUDA and cuBLAS errors: DSP_CUDA_CHECK / DSP_CUBLAS_CHECK turn a failed call into a
// dsp::CudaError naming the call, the error and the file and line. An error that poisons the
// CUDA context (a kernel's illegal address, a device-side assert, ...: every later call in the
// process fails with it) aborts instead, after printing the same message: no caller can
// recover from it, and unwinding would only run destructors that fail again (Kokkos does the
// same). Library code never calls exit.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "dsp/core/error.hpp"

namespace dsp {

/// A CUDA runtime or cuBLAS call that failed without poisoning the context (out of memory, an
/// invalid argument, no device, ...). The message names the call, the error and file:line.
class CudaError : public Error {
 public:
  using Error::Error;
};

}  // namespace dsp

namespace dsp::backend::detail {

/// True for the errors after which the CUDA context is unusable ("sticky" errors): the 13 whose
/// documentation in CUDA 13's driver_types.h (all of them exist from CUDA 12.8, the oldest
/// toolkit CMake accepts) says the process is left in an inconsistent state
/// or "must be terminated and relaunched".
constexpr bool cuda_error_is_sticky(cudaError_t e) {
  switch (e) {
    case cudaErrorContained:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
      return true;
    default:
      return false;
  }
}

/// "cudaMalloc(&p, n) failed: cudaErrorMemoryAllocation (out of memory) at file.hpp:12".
inline std::string cuda_error_message(cudaError_t e, const char* call, const char* file, int line) {
  return dsp::detail::concat(call, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ") at ", file,
                             ":", line);
}

/// DSP_CUDA_CHECK's body: nothing on cudaSuccess; prints and aborts on a sticky error; else
/// throws CudaError.
inline void cuda_check(cudaError_t e, const char* call, const char* file, int line) {
  if (e == cudaSuccess) return;
  const std::string message = cuda_error_message(e, call, file, line);
  if (cuda_error_is_sticky(e)) {
    std::fprintf(stderr, "dsp: fatal CUDA error, the context is unusable: %s\n", message.c_str());
    std::abort();
  }
  (void)cudaGetLastError();  // a failed call also sets the runtime's last error: not the next op's
  throw CudaError(message);
}

/// For destructors (which must not throw): a sticky error aborts as in cuda_check; any other
/// is printed to stderr and otherwise ignored.
inline void cuda_check_nothrow(cudaError_t e, const char* call, const char* file, int line) noexcept {
  if (e == cudaSuccess) return;
  try {
    cuda_check(e, call, file, line);
  } catch (const CudaError& error) {
    std::fprintf(stderr, "dsp: ignored in a destructor: %s\n", error.what());
  }
}

/// DSP_CUBLAS_CHECK's body: throws CudaError unless `s` is CUBLAS_STATUS_SUCCESS. (cuBLAS
/// reports a poisoned context as CUBLAS_STATUS_EXECUTION_FAILED; the next CUDA runtime call
/// then aborts through cuda_check.)
inline void cublas_check(cublasStatus_t s, const char* call, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw CudaError(dsp::detail::concat(call, " failed: ", cublasGetStatusName(s), " (", cublasGetStatusString(s),
                                      ") at ", file, ":", line));
}

}  // namespace dsp::backend::detail

/// Checks a CUDA runtime call: throws dsp::CudaError on failure, aborts on a context-poisoning
/// error (both with the call, the error's name and text, and file:line).
#define DSP_CUDA_CHECK(call) ::dsp::backend::detail::cuda_check((call), #call, __FILE__, __LINE__)
/// DSP_CUDA_CHECK for destructors: never throws (prints a non-sticky error, aborts on a sticky one).
#define DSP_CUDA_CHECK_NOTHROW(call) ::dsp::backend::detail::cuda_check_nothrow((call), #call, __FILE__, __LINE__)
/// Checks a cuBLAS call: throws dsp::CudaError with the status's name and text and file:line.
#define DSP_CUBLAS_CHECK(call) ::dsp::backend::detail::cublas_check((call), #call, __FILE__, __LINE__)
