#pragma once
// Fp32 precision policy: everything in fp32 (the reference for layout-invariance tests).
// The mixed-precision policies are in precision/mixed.hpp.

namespace dsp::precision {

struct Fp32 {
  using storage_type = float;  ///< parameters and gradients
  static constexpr bool dynamic_loss_scaling = false;
  static constexpr const char* name = "fp32";
};

}  // namespace dsp::precision
