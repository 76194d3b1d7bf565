#pragma once
// The Communicator concept every communicator (ThreadComm; MpiComm and NcclComm later) meets.
#include <concepts>
#include <cstdint>
#include <span>
#include <vector>

#include "dsp/comm/reduce_op.hpp"
#include "dsp/comm/work.hpp"
#include "dsp/core/dtype.hpp"

namespace dsp::comm {

/// A group of ranks with the collective set of DESIGN.md section 3. Checked with float, bf16
/// and fp16 payloads (16-bit reductions accumulate in fp32); every operation also has a
/// `*_async` form returning Work.
template <class C>
concept Communicator = std::movable<C> && requires(C c, std::span<float> f, std::span<const float> cf,
                                                   std::span<bf16> b, std::span<fp16> h,
                                                   std::vector<std::int64_t> counts) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.all_reduce(f, ReduceOp::Sum);
  c.all_reduce(b, ReduceOp::Sum);
  c.all_reduce(h, ReduceOp::Sum);
  { c.all_reduce_async(f, ReduceOp::Sum) } -> std::same_as<Work>;
  c.reduce_scatter(cf, f, ReduceOp::Sum);
  c.all_gather(cf, f);
  c.broadcast(f, 0);
  c.send(cf, 0, 0);
  c.recv(f, 0, 0);
  c.all_to_all_v(cf, counts, f, counts);
  c.barrier();
  { c.split(0, 0) } -> std::same_as<C>;
};

}  // namespace dsp::comm
