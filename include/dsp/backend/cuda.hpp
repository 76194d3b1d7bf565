#pragma once
// The CUDA backend: the Cuda tag, errors, devices, streams and events, device memory, and
// every op it has. Ops whose kernels live in .cuh headers are included only when this is
// compiled by nvcc (a .cu file); from a host compiler this gives the rest.
#include "dsp/backend/cuda/cublas.hpp"
#include "dsp/backend/cuda/cuda.hpp"
#include "dsp/backend/cuda/device.hpp"
#include "dsp/backend/cuda/error.hpp"
#include "dsp/backend/cuda/gemm.hpp"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/backend/cuda/memory_space.hpp"
#include "dsp/backend/cuda/copy_columns.hpp"
#include "dsp/backend/cuda/stream.hpp"
#include "dsp/backend/linear.hpp"
#if defined(__CUDACC__)
#include "dsp/backend/cuda/adamw.cuh"
#include "dsp/backend/cuda/attention.cuh"
#include "dsp/backend/cuda/convert.cuh"
#include "dsp/backend/cuda/cross_entropy.cuh"
#include "dsp/backend/cuda/elementwise.cuh"
#include "dsp/backend/cuda/embedding.cuh"
#include "dsp/backend/cuda/flash_attention.cuh"
#include "dsp/backend/cuda/gemm_rounded.cuh"
#include "dsp/backend/cuda/moe_permute.cuh"
#include "dsp/backend/cuda/rms_norm.cuh"
#include "dsp/backend/cuda/rope.cuh"
#include "dsp/backend/cuda/rope_interleaved.cuh"
#include "dsp/backend/cuda/router.cuh"
#include "dsp/backend/cuda/sigmoid.cuh"
#include "dsp/backend/cuda/softmax.cuh"
#include "dsp/backend/cuda/swiglu.cuh"
#endif
