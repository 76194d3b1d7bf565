// DSP_CUDA_CHECK and DSP_CUBLAS_CHECK without a device: the CUDA runtime names every error
// code without a driver, so the messages and the sticky classification are tested everywhere.
#include <doctest/doctest.h>

#include <string>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dsp/backend/cuda/error.hpp"

using dsp::backend::detail::cuda_error_is_sticky;

TEST_CASE("DSP_CUDA_CHECK throws CudaError naming the call, the error and file:line; success passes") {
  CHECK_NOTHROW(DSP_CUDA_CHECK(cudaSuccess));
  const int line = __LINE__ + 2;
  try {
    DSP_CUDA_CHECK(cudaErrorMemoryAllocation);
    FAIL("no exception");
  } catch (const dsp::CudaError& e) {
    const std::string m = e.what();
    CHECK(m.find("cudaErrorMemoryAllocation failed: cudaErrorMemoryAllocation") != std::string::npos);
    CHECK(m.find("out of memory") != std::string::npos);
    CHECK(m.find("test_error.cpp:" + std::to_string(line)) != std::string::npos);
  }
  // A CudaError is a dsp::Error: callers that catch the family catch it.
  CHECK_THROWS_AS(DSP_CUDA_CHECK(cudaErrorInvalidValue), dsp::Error);
}

TEST_CASE("DSP_CUBLAS_CHECK throws CudaError with the status's name and file:line") {
  CHECK_NOTHROW(DSP_CUBLAS_CHECK(CUBLAS_STATUS_SUCCESS));
  try {
    DSP_CUBLAS_CHECK(CUBLAS_STATUS_INVALID_VALUE);
    FAIL("no exception");
  } catch (const dsp::CudaError& e) {
    const std::string m = e.what();
    CHECK(m.find("CUBLAS_STATUS_INVALID_VALUE") != std::string::npos);
    CHECK(m.find("test_error.cpp:") != std::string::npos);
  }
}

TEST_CASE("errors that poison the context are sticky; recoverable ones are not") {
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorAssert, cudaErrorMisalignedAddress,
                        cudaErrorIllegalInstruction, cudaErrorHardwareStackError, cudaErrorLaunchTimeout})
    CHECK_MESSAGE(cuda_error_is_sticky(e), cudaGetErrorName(e));
  for (cudaError_t e : {cudaSuccess, cudaErrorMemoryAllocation, cudaErrorInvalidValue, cudaErrorNoDevice,
                        cudaErrorInsufficientDriver, cudaErrorNotReady, cudaErrorInvalidDevice})
    CHECK_MESSAGE(!cuda_error_is_sticky(e), cudaGetErrorName(e));
}

TEST_CASE("DSP_CUDA_CHECK aborts with the message on a sticky error, in a child process") {
  // doctest has no death tests: the child's stderr goes through a pipe to this process.
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    signal(SIGABRT, SIG_DFL);  // doctest's crash handler would report the abort as a failure
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    DSP_CUDA_CHECK(cudaErrorIllegalAddress);
    _exit(0);  // not reached when it aborts
  }
  close(fds[1]);
  std::string err;
  char buf[256];
  for (ssize_t r; (r = read(fds[0], buf, sizeof buf)) > 0;) err.append(buf, static_cast<std::size_t>(r));
  close(fds[0]);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGABRT);
  CHECK(err.find("fatal CUDA error") != std::string::npos);
  CHECK(err.find("cudaErrorIllegalAddress") != std::string::npos);
}
