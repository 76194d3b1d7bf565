// Every CUDA op in one more translation unit of dsp_cuda_tests: the test files include the same
// kernel headers, so a kernel that cannot be defined in two .cu files of one program (launch.hpp)
// fails this binary's link. No tests of its own.
#include "dsp/backend/cuda.hpp"
