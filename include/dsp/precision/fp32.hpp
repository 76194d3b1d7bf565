#pragma once
// Fp32 precision policy: everything in fp32 (the reference for layout-invariance tests).
// Bf16Mixed and Fp16Mixed (with a dynamic loss scaler) come with the memory/precision issue.
#include "dsp/core/dtype.hpp"

namespace dsp::precision {

struct Fp32 {
  static constexpr DType param_dtype = DType::F32;
  static constexpr DType compute_dtype = DType::F32;
  static constexpr DType grad_dtype = DType::F32;
  static constexpr DType comm_dtype = DType::F32;
  static constexpr DType master_dtype = DType::F32;
};

}  // namespace dsp::precision
