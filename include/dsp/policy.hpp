#pragma once
// dsp::Policy: the compile-time bundle of backend, communicator and precision that a whole
// trainer or inference model is built from.
#include "dsp/comm/communicator.hpp"
#include "dsp/precision/fp32.hpp"
#include "dsp/precision/mixed.hpp"

namespace dsp {

/// A precision policy (precision::Fp32, Bf16Mixed, Fp16Mixed) names the element type parameters
/// and gradients are stored in (master weights and Adam moments are always fp32) and whether
/// training needs dynamic loss scaling.
template <class P>
concept PrecisionPolicy = requires {
  typename P::storage_type;
  { P::dynamic_loss_scaling } -> std::convertible_to<bool>;
  { P::name } -> std::convertible_to<const char*>;
};

/// Policy<Backend, Comm, Precision>: e.g. Policy<backend::Host, comm::ThreadComm, precision::Fp32>.
template <class BackendT, comm::Communicator CommT, PrecisionPolicy PrecisionT = precision::Fp32>
struct Policy {
  using Backend = BackendT;
  using Comm = CommT;
  using Precision = PrecisionT;
};

}  // namespace dsp
