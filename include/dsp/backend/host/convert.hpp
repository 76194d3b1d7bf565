#pragma once
// Conversions between fp32 and the 16-bit element types (bf16, fp16; core/dtype.hpp): what the
// gradient buckets use to send gradients in 16 bits (--grad-reduce-dtype), mixed precision to
// store parameters and packed activations in 16 bits, and round_to to round fp32 activations to
// 16-bit values (precision/activation_precision.hpp), wherever they live.
// fp32 -> 16 bits rounds to nearest, ties to even (fp16: infinity from 65520 up; NaN stays a
// quiet NaN); 16 bits -> fp32 is exact. The CUDA ops (backend/cuda/convert.cuh) apply the same
// functions per element, so both backends give the same bits.
#include <cstdint>

#include "dsp/backend/host/host.hpp"
#include "dsp/core/dtype.hpp"

namespace dsp::backend {

/// y [n] = x [n] rounded to bf16.
inline void convert(Host, std::int64_t n, const float* x, bf16* y) {
  for (std::int64_t i = 0; i < n; ++i) y[i].bits = bf16::from_float(x[i]);
}
/// y [n] = x [n] rounded to fp16.
inline void convert(Host, std::int64_t n, const float* x, fp16* y) {
  for (std::int64_t i = 0; i < n; ++i) y[i].bits = fp16::from_float(x[i]);
}
/// y [n] = x [n] widened to fp32 (exact).
inline void convert(Host, std::int64_t n, const bf16* x, float* y) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = bf16::to_float(x[i].bits);
}
/// y [n] = x [n] widened to fp32 (exact).
inline void convert(Host, std::int64_t n, const fp16* x, float* y) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = fp16::to_float(x[i].bits);
}

/// x [n] rounded to bf16 in place, kept in fp32 (the widened bf16 value: convert there and back).
inline void round_to(Host, std::int64_t n, float* x, bf16) {
  for (std::int64_t i = 0; i < n; ++i) x[i] = bf16::to_float(bf16::from_float(x[i]));
}
/// x [n] rounded to fp16 in place, kept in fp32 (the widened fp16 value: convert there and back).
inline void round_to(Host, std::int64_t n, float* x, fp16) {
  for (std::int64_t i = 0; i < n; ++i) x[i] = fp16::to_float(fp16::from_float(x[i]));
}

}  // namespace dsp::backend
