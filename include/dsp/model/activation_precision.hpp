#pragma once
// The precision of training activations (Bf16Mixed / Fp16Mixed keep them in 16 bits; Micikevicius
// et al., "Mixed Precision Training", ICLR 2018, section 3; Megatron's bf16 activations):
//   - every tensor a layer keeps for backward, and every hidden state passed between blocks and
//     pipeline stages, is rounded to the 16-bit type where it is produced (round_activations),
//     so the forward goes on with exactly the values backward will read, and recomputation
//     (full or selective) re-creates them bitwise;
//   - the arithmetic stays fp32 (GEMMs accumulate in fp32; RMSNorm's statistics, the softmax,
//     the router and the loss compute in fp32 from 16-bit inputs);
//   - between a block's forward and its backward its kept tensors are stored in 16 bits
//     (PackedTensors): what the activation memory of a 16-bit model is.
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "dsp/core/dtype.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/core/tensor.hpp"

namespace dsp::model {

/// What training activations are kept in.
enum class ActivationPrecision { Fp32, Bf16, Fp16 };

/// Rounds every element of x to `p` in place (to nearest, ties to even; fp16 overflows to
/// infinity past 65504); nothing for Fp32.
inline void round_activations(ActivationPrecision p, std::span<float> x) {
  if (p == ActivationPrecision::Bf16)
    for (float& v : x) v = bf16::to_float(bf16::from_float(v));
  else if (p == ActivationPrecision::Fp16)
    for (float& v : x) v = fp16::to_float(fp16::from_float(v));
}
/// The same for a tensor; nothing for Fp32 wherever x lives. Throws Error for 16-bit
/// activations of a tensor not in host memory (no device rounding op yet).
inline void round_activations(ActivationPrecision p, Tensor& x) {
  if (p != ActivationPrecision::Fp32) round_activations(p, x.span());
}

/// Tensors kept for backward, stored in 16 bits while packed. pack() narrows each tensor (its
/// values already rounded to the precision: lossless) into a 16-bit buffer counted in the
/// calling thread's current memory category and frees the fp32 storage; unpack(), given the
/// same tensors in the same order (they may have moved meanwhile), gives each its fp32 values
/// back (in the current category). With Fp32 both do nothing.
class PackedTensors {
 public:
  void pack(ActivationPrecision p, const std::vector<Tensor*>& tensors) {
    precision_ = p;
    if (p == ActivationPrecision::Fp32) return;
    for (Tensor* t : tensors) {
      Packed& k = packed_.emplace_back(Packed{t->shape(), Bits(static_cast<std::size_t>(t->numel()))});
      const float* x = t->span().data();  // host tensors only: span() throws for the others
      for (std::size_t i = 0; i < k.bits.size(); ++i)
        k.bits[i] = p == ActivationPrecision::Bf16 ? bf16::from_float(x[i]) : fp16::from_float(x[i]);
      *t = Tensor{};
    }
  }
  void unpack(const std::vector<Tensor*>& tensors) {
    if (precision_ == ActivationPrecision::Fp32) return;
    DSP_CHECK(tensors.size() == packed_.size(), "activations: ", tensors.size(), " tensors to unpack, ",
              packed_.size(), " packed");
    for (std::size_t j = 0; j < tensors.size(); ++j) {
      Packed& k = packed_[j];
      if (k.bits.empty()) continue;  // an empty tensor stays empty
      *tensors[j] = Tensor(std::move(k.shape));
      float* x = tensors[j]->data();
      for (std::size_t i = 0; i < k.bits.size(); ++i)
        x[i] = precision_ == ActivationPrecision::Bf16 ? bf16::to_float(k.bits[i]) : fp16::to_float(k.bits[i]);
      Bits().swap(k.bits);  // one tensor at a time in both forms
    }
    packed_.clear();
  }

 private:
  using Bits = std::vector<std::uint16_t, memory::CountingAllocator<std::uint16_t>>;
  struct Packed {
    Shape shape;
    Bits bits;
  };
  ActivationPrecision precision_ = ActivationPrecision::Fp32;
  std::vector<Packed> packed_;
};

}  // namespace dsp::model
