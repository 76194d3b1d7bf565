#pragma once
// The host (CPU) backend tag.

namespace dsp::backend {

/// Tag of the CPU backend. Every host op takes `Host` as its first argument (tag dispatch):
/// layers call `gemm(B{}, ...)` and argument-dependent lookup picks the backend's overload.
/// Host ops work on fp32, row-major, contiguous host memory through raw pointers; scratch
/// memory they need is allocated per call (never per element).
struct Host {};

}  // namespace dsp::backend
