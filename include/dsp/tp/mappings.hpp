#pragma once
// Data movement into and out of the tensor-parallel region (Megatron-LM's mappings,
// Shoeybi et al. 2019, section 3). Each has a forward and the backward that makes it
// differentiable; names say direction and region:
//   copy_to_tp_region      forward identity            backward all-reduce
//   reduce_from_tp_region  forward all-reduce          backward identity
//   scatter_to_tp_region   forward keep my last-dim slice   backward all-gather last dim
//   gather_from_tp_region  forward all-gather last dim      backward keep my slice
// Tensors are [rows, cols]; all ranks of the TP group call each collective one.
#include <span>

#include "dsp/backend/host/copy_columns.hpp"
#include "dsp/comm/communicator.hpp"
#include "dsp/core/tensor.hpp"

namespace dsp::tp {

namespace detail {
// [rows, cols * tp] from every rank's [rows, cols] (rank-major along the last dim).
template <class Backend, comm::Communicator Comm>
Tensor gather_last_dim(Comm& tp, const Tensor& x) {
  const std::int64_t rows = x.dim(0), cols = x.dim(1), n = tp.size();
  if (n == 1) return x;
  Tensor blocks({n, rows, cols});
  tp.all_gather(std::span<const float>(x.raw_span()), blocks.raw_span());
  Tensor out({rows, cols * n});
  for (std::int64_t r = 0; r < n; ++r)
    copy_columns(Backend{}, blocks.data() + r * rows * cols, cols, 0, out.data(), cols * n, r * cols, rows, cols);
  return out;
}
// This rank's [rows, cols / tp] slice of [rows, cols].
template <class Backend, comm::Communicator Comm>
Tensor split_last_dim(Comm& tp, const Tensor& x) {
  if (tp.size() == 1) return x;
  const std::int64_t rows = x.dim(0), cols = x.dim(1) / tp.size();
  Tensor out({rows, cols});
  copy_columns(Backend{}, x.data(), x.dim(1), cols * tp.rank(), out.data(), cols, 0, rows, cols);
  return out;
}
}  // namespace detail

/// Forward identity; backward sums the gradient over the TP group (in place).
struct CopyToTpRegion {
  template <comm::Communicator Comm>
  static void forward(Comm&, Tensor&) {}
  template <comm::Communicator Comm>
  static void backward(Comm& tp, Tensor& grad) {
    if (tp.size() > 1) tp.all_reduce(grad.raw_span());
  }
};

/// Forward sums partial results over the TP group (in place); backward identity.
struct ReduceFromTpRegion {
  template <comm::Communicator Comm>
  static void forward(Comm& tp, Tensor& x) {
    if (tp.size() > 1) tp.all_reduce(x.raw_span());
  }
  template <comm::Communicator Comm>
  static void backward(Comm&, Tensor&) {}
};

/// Forward keeps this rank's slice of the last dim; backward all-gathers it.
/// x [rows, cols] -> [rows, cols / tp].
template <class Backend>
struct ScatterToTpRegion {
  template <comm::Communicator Comm>
  static Tensor forward(Comm& tp, const Tensor& x) { return detail::split_last_dim<Backend>(tp, x); }
  template <comm::Communicator Comm>
  static Tensor backward(Comm& tp, const Tensor& grad) { return detail::gather_last_dim<Backend>(tp, grad); }
};

/// Forward all-gathers the last dim; backward keeps this rank's slice.
/// x [rows, cols / tp] -> [rows, cols].
template <class Backend>
struct GatherFromTpRegion {
  template <comm::Communicator Comm>
  static Tensor forward(Comm& tp, const Tensor& x) { return detail::gather_last_dim<Backend>(tp, x); }
  template <comm::Communicator Comm>
  static Tensor backward(Comm& tp, const Tensor& grad) { return detail::split_last_dim<Backend>(tp, grad); }
};

}  // namespace dsp::tp
