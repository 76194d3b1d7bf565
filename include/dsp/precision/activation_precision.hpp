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
#include <utility>
#include <vector>

#include "dsp/backend/host/convert.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/core/space_buffer.hpp"
#include "dsp/core/tensor.hpp"

namespace dsp::precision {

/// What training activations are kept in.
enum class ActivationPrecision { Fp32, Bf16, Fp16 };

/// Rounds x [n] (where Backend's ops read it) to `p` in place with Backend's round_to (to
/// nearest, ties to even; fp16 overflows to infinity past 65504); nothing for Fp32.
template <class Backend>
void round_activations(Backend b, ActivationPrecision p, float* x, std::int64_t n) {
  if (p == ActivationPrecision::Bf16) round_to(b, n, x, bf16{});
  else if (p == ActivationPrecision::Fp16) round_to(b, n, x, fp16{});
}
/// The same for every element of a tensor, wherever it lives.
template <class Backend>
void round_activations(Backend b, ActivationPrecision p, Tensor& x) {
  round_activations(b, p, x.data(), x.numel());
}

/// Tensors kept for backward, stored in 16 bits while packed. pack() narrows each tensor (its
/// values already rounded to the precision: lossless) with Backend's convert into a 16-bit
/// buffer in the current memory space, counted in the calling thread's current memory
/// category, and frees the fp32 storage; unpack(), given the same tensors in the same order
/// (they may have moved meanwhile), gives each its fp32 values back (in the current space and
/// category). With Fp32 both do nothing.
class PackedTensors {
 public:
  template <class Backend>
  void pack(Backend b, ActivationPrecision p, const std::vector<Tensor*>& tensors) {
    precision_ = p;
    if (p == ActivationPrecision::Fp32) return;
    for (Tensor* t : tensors) {
      Packed& k = packed_.emplace_back(Packed{t->shape(), {}, {}});
      if (p == ActivationPrecision::Bf16) k.as_bf16 = narrow<bf16>(b, *t);
      else k.as_fp16 = narrow<fp16>(b, *t);
      *t = Tensor{};
    }
  }
  template <class Backend>
  void unpack(Backend b, const std::vector<Tensor*>& tensors) {
    if (precision_ == ActivationPrecision::Fp32) return;
    DSP_CHECK(tensors.size() == packed_.size(), "activations: ", tensors.size(), " tensors to unpack, ",
              packed_.size(), " packed");
    for (std::size_t j = 0; j < tensors.size(); ++j) {
      Packed& k = packed_[j];
      if (k.as_bf16.empty() && k.as_fp16.empty()) continue;  // an empty tensor stays empty
      Tensor& t = *tensors[j];
      t = Tensor(std::move(k.shape));
      if (precision_ == ActivationPrecision::Bf16) convert(b, t.numel(), k.as_bf16.data(), t.data());
      else convert(b, t.numel(), k.as_fp16.data(), t.data());
      k = Packed{};  // one tensor at a time in both forms
    }
    packed_.clear();
  }

 private:
  struct Packed {
    Shape shape;
    SpaceBuffer<bf16> as_bf16;  // the one of the precision holds the elements
    SpaceBuffer<fp16> as_fp16;
  };
  template <class T, class Backend>
  static SpaceBuffer<T> narrow(Backend b, const Tensor& t) {
    SpaceBuffer<T> out(static_cast<std::size_t>(t.numel()), memory::current_category());
    convert(b, t.numel(), t.data(), out.data());
    return out;
  }
  ActivationPrecision precision_ = ActivationPrecision::Fp32;
  std::vector<Packed> packed_;
};

}  // namespace dsp::precision
