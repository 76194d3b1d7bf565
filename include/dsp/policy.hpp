#pragma once
// dsp::Policy: the compile-time bundle of backend, communicator and precision that a whole
// trainer or inference model is built from.
#include "dsp/comm/communicator.hpp"
#include "dsp/precision/fp32.hpp"

namespace dsp {

/// A precision policy names the dtypes of parameters, compute, gradients, communication and
/// master weights (DESIGN.md section 3).
template <class P>
concept PrecisionPolicy = requires {
  P::param_dtype;
  P::compute_dtype;
  P::grad_dtype;
  P::comm_dtype;
  P::master_dtype;
};

/// Policy<Backend, Comm, Precision>: e.g. Policy<backend::Host, comm::ThreadComm, precision::Fp32>.
template <class BackendT, comm::Communicator CommT, PrecisionPolicy PrecisionT = precision::Fp32>
struct Policy {
  using Backend = BackendT;
  using Comm = CommT;
  using Precision = PrecisionT;
};

}  // namespace dsp
