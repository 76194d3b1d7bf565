#pragma once
// DSP_HOST_DEVICE marks a function that both backends share: an elementwise formula the Host
// op loops over and the CUDA kernel applies per thread, written once so the two cannot drift.
// Under nvcc it is `__host__ __device__`; under a host-only compiler it is nothing.
#if defined(__CUDACC__)
#define DSP_HOST_DEVICE __host__ __device__
#else
#define DSP_HOST_DEVICE
#endif
