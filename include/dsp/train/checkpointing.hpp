#pragma once
// Saving and resuming training: parameters, AdamW moments and step (hence the LR position)
// and the data position, so a resumed run continues with exactly the losses of an
// uninterrupted one. Parameters and moments are saved as TP shards by data-parallel replica
// 0, one file per (TP rank, pipeline rank) holding that rank's layers under their global
// names; loading reads them at any TP and PP size (the manifest holds every split, and each
// rank reads the global tensors of the layers it holds). Routed experts split over an
// expert-parallel group are sent to its first rank (DP rank 0) before writing, so the files
// hold every expert and load at any expert-parallel size. With ZeRO (stages 1-3) the moments
// (and at stage 3 the parameters) are partitioned over data parallelism: every DP rank first
// all-gathers them into whole tensors, so the files are the same at every ZeRO stage and DP
// size and a checkpoint loads at any of them; the padding of the partitions is never saved.
#include <deque>
#include <filesystem>
#include <optional>
#include <span>
#include <string>

#include "dsp/checkpoint/model_io.hpp"
#include "dsp/checkpoint/save.hpp"
#include "dsp/train/trainer.hpp"

namespace dsp::train {

namespace detail {
// While it lives, the optimizer's partitioned state is whole (ZeroOptimizer::
// gather_for_checkpoint); at its end, also when an exception unwinds, partitioned again,
// taking the whole tensors' values when `loaded`.
template <class Optimizer>
struct WholeOptimizerState {
  explicit WholeOptimizerState(Optimizer& o) : optimizer(o) { optimizer.gather_for_checkpoint(); }
  ~WholeOptimizerState() { optimizer.partition_after_checkpoint(loaded); }
  WholeOptimizerState(const WholeOptimizerState&) = delete;
  WholeOptimizerState& operator=(const WholeOptimizerState&) = delete;
  Optimizer& optimizer;
  bool loaded = false;
};
}  // namespace detail

/// Parameters and both AdamW moments ("optimizer.exp_avg.<name>", "optimizer.exp_avg_sq.<name>",
/// split like the parameter) of this rank, all its pipeline chunks; for saving without tied
/// copies (their owner saves them), for loading with them.
template <class Policy>
checkpoint::State training_state(Trainer<Policy>& t, checkpoint::StateUse use) {
  checkpoint::State s = checkpoint::parameter_state(t.state_parameters(), use);
  auto& opt = t.optimizer();
  for (std::size_t i = 0; i < opt.parameters().size(); ++i) {
    const model::Parameter& p = *opt.parameters()[i];
    if (use == checkpoint::StateUse::Save && p.tied_copy) continue;
    for (auto [prefix, moment] : {std::pair{"exp_avg.", &opt.exp_avg(i)}, std::pair{"exp_avg_sq.", &opt.exp_avg_sq(i)}}) {
      ShardedTensor m = p.spec;
      m.name = std::string(checkpoint::optimizer_prefix) + prefix + p.spec.name;
      s.push_back({std::move(m), moment});
    }
  }
  return s;
}

/// `state` with every routed-expert entry (a name holding ".mlp.experts.{e}.", its moments too)
/// replaced, on rank 0 of the expert-parallel group `ep`, by the same entry of every rank of
/// the group (received one tensor at a time, renamed to their global expert index; rank q
/// holds experts [q n, (q + 1) n) for n = num_local_experts), kept in `storage`; the other
/// ranks send theirs and get the state without experts (they write nothing). Collective
/// over `ep`.
template <comm::Communicator Comm>
checkpoint::State with_all_experts(const checkpoint::State& state, Comm& ep, std::int64_t num_local_experts,
                                   std::deque<Tensor>& storage) {
  if (ep.size() == 1) return state;
  constexpr int tag = 7;  // expert tensors to the checkpoint writer
  checkpoint::State out;
  for (const auto& entry : state) {
    const auto g = ep::expert_index(entry.spec.name);
    if (!g) {
      out.push_back(entry);
      continue;
    }
    if (ep.rank() != 0) {
      ep.send(std::span<const float>(entry.local->span()), 0, tag);
      continue;
    }
    const std::int64_t local = *g - num_local_experts * ep.rank();
    out.push_back(entry);
    for (int q = 1; q < ep.size(); ++q) {
      Tensor& t = storage.emplace_back(entry.local->shape());
      ep.recv(t.span(), q, tag);
      out.push_back({ep::with_expert_index(entry.spec, q * num_local_experts + local), &t});
    }
  }
  return out;
}

/// Writes the training state to `dir` atomically (an existing checkpoint there is replaced
/// only once the new one is complete). Collective over the whole mesh: the ranks of DP
/// replica 0 write their shard files in parallel, global rank 0 writes the manifest and
/// commits (with expert parallelism the expert group of replica 0 first gathers the experts).
/// Throws CheckpointError naming the file when writing fails.
template <class Policy>
void save_checkpoint(const std::filesystem::path& dir, Trainer<Policy>& t) {
  auto& mesh = t.mesh();
  detail::WholeOptimizerState whole(t.optimizer());
  std::deque<Tensor> gathered;
  checkpoint::State state;
  if (mesh.dp_rank() < mesh.ep_size()) {  // the expert group of DP replica 0
    const std::int64_t local_experts = t.model_config().num_experts / mesh.ep_size();
    state = with_all_experts(training_state(t, checkpoint::StateUse::Save), mesh.expert_group(), local_experts, gathered);
  }
  if (mesh.dp_rank() == 0) {
    auto& mp = mesh.model_group();  // the TP x PP ranks of replica 0; its rank 0 is global rank 0
    std::optional<checkpoint::AtomicDir> staging;
    std::string tmp;
    if (mp.rank() == 0) {
      staging.emplace(dir);
      tmp = staging->tmp_path().string();
    }
    std::vector<std::int64_t> len{static_cast<std::int64_t>(tmp.size())};
    mp.broadcast(std::span(len), 0);
    tmp.resize(static_cast<std::size_t>(len[0]));
    mp.broadcast(std::span(tmp.data(), tmp.size()), 0);
    checkpoint::write_shard_file(tmp, state, mesh.tp_size(), mesh.tp_rank(), mesh.pp_rank());
    mp.barrier();
    if (mp.rank() == 0) {
      checkpoint::CheckpointMeta meta;
      meta.model_config = t.model_config().to_hf_json();
      meta.layout = mesh.layout();
      meta.iteration = t.iteration();
      meta.extra = {{"sampler", t.sampler().state()}, {"seed", t.config().seed}};
      if (auto* scaler = t.loss_scaler()) meta.extra["loss_scaler"] = scaler->state();
      checkpoint::write_manifest_and_commit(*staging, meta);
    }
    mp.barrier();
  }
  mesh.data_group().barrier();  // nobody reads `dir` before it is complete
}

/// Resumes from `dir` (saved at any TP, PP, DP size and ZeRO stage): parameters, moments,
/// optimizer step, data position and the loss scaler's state (when both runs scale the loss).
/// Throws CheckpointError for a missing, truncated or corrupted checkpoint or one of another
/// model config or seed.
template <class Policy>
void load_checkpoint(const std::filesystem::path& dir, Trainer<Policy>& t) {
  const checkpoint::Manifest m = checkpoint::read_manifest(dir);  // load_into verifies every file
  checkpoint::check_model_config(dir, m, t.model_config());
  DSP_CHECK_AS(CheckpointError, m.meta.extra.contains("sampler") && m.meta.extra.value("seed", std::uint64_t{0}) == t.config().seed,
               "checkpoint ", dir.string(), " holds no training state for seed ", t.config().seed);
  {
    detail::WholeOptimizerState whole(t.optimizer());
    checkpoint::load_into(dir, training_state(t, checkpoint::StateUse::Load), t.mesh().tp_size(), t.mesh().tp_rank());
    whole.loaded = true;
  }
  t.optimizer().set_steps(m.meta.iteration);
  t.sampler().set_state(m.meta.extra.at("sampler").get<dp::DataSampler::State>());
  if (auto* scaler = t.loss_scaler(); scaler && m.meta.extra.contains("loss_scaler"))
    scaler->set_state(m.meta.extra.at("loss_scaler").get<precision::DynamicLossScaler::State>());
}

}  // namespace dsp::train
