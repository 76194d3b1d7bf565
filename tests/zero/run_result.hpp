#pragma once
// Test helpers shared by the ZeRO and mixed-precision comparisons: train a few steps, record
// rank 0's losses and gradient norms and every global parameter (mixed precision: master
// weight) and moment of DP replica 0, and compare two such runs.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "dsp/train/trainer.hpp"
#include "../gather_global.hpp"
#include "whole_moment.hpp"
#include "../relative_error.hpp"

namespace dsp::test {

using Params = std::map<std::string, Tensor>;  // global tensors by name

struct RunResult {
  std::vector<double> losses, grad_norms;
  Params final;  // parameters and both moments ("exp_avg.<name>", "exp_avg_sq.<name>")
};

/// Every global parameter and moment of DP replica 0 (its expert group, the first `ep` DP
/// ranks, for routed experts), made whole for the moment (parameters as a checkpoint does,
/// moments by whole_moment), merged into out.
/// Collective over the mesh.
template <class P, class Comm>
void collect_state(train::Trainer<P>& trainer, DeviceMesh<Comm>& mesh, int ep, std::mutex& mu, Params& out) {
  auto& opt = trainer.optimizer();
  opt.gather_for_checkpoint();
  Params mine;
  const auto params = opt.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto* p = params[i];
    if (p->tied_copy) continue;
    auto& tp = mesh.tensor_group();
    mine[p->spec.name] = gather_global(tp, p->spec, p->value);
    mine["exp_avg." + p->spec.name] = gather_global(tp, p->spec, whole_moment(opt, i, opt.exp_avg(i)));
    mine["exp_avg_sq." + p->spec.name] = gather_global(tp, p->spec, whole_moment(opt, i, opt.exp_avg_sq(i)));
  }
  opt.partition_after_checkpoint(false);
  std::lock_guard lk(mu);
  if (mesh.dp_rank() < ep && mesh.tp_rank() == 0) out.merge(mine);
}

/// `steps` train steps, then collect_state; global rank 0's losses and norms go to out.
template <class P, class Comm>
void train_and_collect(train::Trainer<P>& trainer, DeviceMesh<Comm>& mesh, int steps, int ep, std::mutex& mu,
                       RunResult& out) {
  std::vector<double> losses, norms;
  for (int s = 0; s < steps; ++s) {
    const auto r = trainer.train_step();
    losses.push_back(r.loss);
    norms.push_back(r.grad_norm);
  }
  collect_state(trainer, mesh, ep, mu, out.final);
  std::lock_guard lk(mu);
  if (mesh.global_rank() == 0) {
    out.losses = losses;
    out.grad_norms = norms;
  }
}

/// The same losses and norms step by step, and parameters and moments, within `tol` relative.
inline void check_same(const RunResult& r, const RunResult& ref, double tol = 1e-6) {
  REQUIRE(r.losses.size() == ref.losses.size());
  for (std::size_t s = 0; s < r.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(std::abs(r.losses[s] - ref.losses[s]) <= tol * std::abs(ref.losses[s]));
    CHECK(std::abs(r.grad_norms[s] - ref.grad_norms[s]) <= tol * std::abs(ref.grad_norms[s]));
  }
  CHECK(relative_error(r.final, ref.final) <= tol);
}

}  // namespace dsp::test
