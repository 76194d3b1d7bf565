#pragma once
// Causal attention on the GPU: the backend-generic attention_forward / attention_backward
// (backend/attention.hpp) instantiated with the CUDA ops (cuBLAS GEMMs per (batch, q head)
// around the causal softmax kernel), so it has the Host op's contract exactly: q, k, v, out,
// probs, dq, dk, dv and q_positions in device memory. The probabilities are materialised
// ([batch, q_heads, q_len, kv_len]); a tiled kernel that keeps them on chip is still to come.
#if !defined(__CUDACC__)
#error "dsp/backend/cuda/attention.cuh defines CUDA kernels: include it from a .cu file compiled by nvcc"
#endif
#include "dsp/backend/attention.hpp"
#include "dsp/backend/cuda/gemm.hpp"
#include "dsp/backend/cuda/gemm_rounded.cuh"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/backend/cuda/softmax.cuh"
