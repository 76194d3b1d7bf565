#pragma once
// Saving and resuming training: parameters, AdamW moments and step (hence the LR position)
// and the data position, so a resumed run continues with exactly the losses of an
// uninterrupted one.
// - Parameters (with mixed precision the fp32 master weights) are saved as TP shards by
//   data-parallel replica 0, one model file per (TP rank, pipeline rank) holding that rank's
//   layers under their global names: what serving, merging and resharding read. Routed experts
//   split over an expert-parallel group are sent to its first rank (DP rank 0) before writing,
//   so the model files hold every expert. At ZeRO 3 the parameters are all-gathered first.
// - The AdamW moments ("optimizer.exp_avg.<name>", "optimizer.exp_avg_sq.<name>", split like
//   the parameter) are saved per partition: every rank writes the slices it owns to its own
//   partition file (checkpoint/save.hpp), from ZeRO 1 each DP rank its 1/DP of every
//   parameter, at ZeRO 0 the first rank holding each parameter the whole of it. No rank gathers
//   a moment, and partition padding is never saved.
// Loading works at any TP, PP, DP and expert-parallel size and ZeRO stage: the manifest holds
// every split and which elements each file holds; each rank reads the parameters of the layers
// it holds and exactly the moment elements it owns (at another TP size, from the assembled
// global tensor).
#include <algorithm>
#include <deque>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dsp/checkpoint/hf_import.hpp"
#include "dsp/checkpoint/iterations.hpp"
#include "dsp/checkpoint/model_io.hpp"
#include "dsp/checkpoint/save.hpp"
#include "dsp/core/space_buffer.hpp"
#include "dsp/train/trainer.hpp"

namespace dsp::train {

namespace detail {
// While it lives, every parameter's fp32 values are whole (ZeroOptimizer::gather_for_checkpoint).
// take_loaded() partitions them again taking the (loaded) whole values: it copies, possibly in
// device memory, so its errors propagate from there, not from a destructor. Otherwise (also
// when that or anything before it throws) its end partitions them again, discarding them.
template <class Optimizer>
struct WholeParameters {
  explicit WholeParameters(Optimizer& o) : optimizer(o) { optimizer.gather_for_checkpoint(); }
  ~WholeParameters() {
    if (!partitioned) optimizer.partition_after_checkpoint(false);
  }
  WholeParameters(const WholeParameters&) = delete;
  WholeParameters& operator=(const WholeParameters&) = delete;
  void take_loaded() {
    optimizer.partition_after_checkpoint(true);
    partitioned = true;
  }
  Optimizer& optimizer;
  bool partitioned = false;
};

// Calls f(spec, begin, n, moment) for both AdamW moments of optimizer parameter i: the spec is
// the parameter's renamed "optimizer.exp_avg.<name>" / "optimizer.exp_avg_sq.<name>", the first
// n elements of `moment` (ZeroOptimizer::exp_avg, wherever it lives) the valid elements of the
// part this rank owns (no padding; n = 0 for a rank past the end of a small parameter),
// elements [begin, begin + n) of the TP-local shard.
template <class Optimizer, class F>
void for_each_moment(Optimizer& opt, std::size_t i, F&& f) {
  const dp::ShardRange r = opt.range(i);
  for (auto [prefix, moment] : {std::pair{"exp_avg.", &opt.exp_avg(i)}, std::pair{"exp_avg_sq.", &opt.exp_avg_sq(i)}}) {
    ShardedTensor spec = opt.parameters()[i]->spec;
    spec.name = std::string(checkpoint::optimizer_prefix) + prefix + spec.name;
    f(spec, r.begin, r.valid(), *moment);
  }
}
}  // namespace detail

/// The moment elements this rank saves, with their place in the TP-local shard: from ZeRO 1
/// the owned slice of every parameter (its valid elements: no padding); at ZeRO 0 the whole
/// moments of the parameters whose partition group (data-parallel, or expert-data-parallel for
/// a routed expert) this rank is rank 0 of. Tied copies are left out (their owner saves them).
/// The values are the optimizer's, or for moments in a memory space (device memory) those of
/// host copies kept in `host_copies`.
template <class Policy>
checkpoint::Partition optimizer_partition(Trainer<Policy>& t, std::deque<Tensor>& host_copies) {
  auto& opt = t.optimizer();
  checkpoint::Partition out;
  for (std::size_t i = 0; i < opt.parameters().size(); ++i) {
    if (opt.parameters()[i]->tied_copy || (opt.stage() == 0 && opt.group(i).rank() != 0)) continue;
    detail::for_each_moment(opt, i, [&](const ShardedTensor& spec, std::int64_t begin, std::int64_t n, Tensor& moment) {
      if (n == 0) return;
      Tensor& host = moment.on_host() ? moment : host_copies.emplace_back(moment.to_host());
      out.push_back({spec, begin, host.span().first(static_cast<std::size_t>(n))});
    });
  }
  return out;
}

/// `state` with every routed-expert entry (a name holding ".mlp.experts.{e}.") replaced, on
/// rank 0 of the expert-parallel group `ep`, by the same entry of every rank of the group
/// (received one tensor at a time, renamed to their global expert index; rank q holds experts
/// [q n, (q + 1) n) for n = num_local_experts), kept in `storage` (in the current memory space,
/// where the communicator reads and writes); the other ranks send theirs and get the state
/// without experts. Collective over `ep`.
template <comm::Communicator Comm>
checkpoint::State with_all_experts(const checkpoint::State& state, Comm& ep, std::int64_t num_local_experts,
                                   std::deque<Tensor>& storage) {
  if (ep.size() == 1) return state;
  constexpr int tag = 7;  // expert tensors to the checkpoint writer
  checkpoint::State out;
  for (const auto& entry : state) {
    const auto g = model::expert_index(entry.spec.name);
    if (!g) {
      out.push_back(entry);
      continue;
    }
    if (ep.rank() != 0) {
      ep.send(std::span<const float>(entry.local->raw_span()), 0, tag);  // wherever it lives
      continue;
    }
    const std::int64_t local = *g - num_local_experts * ep.rank();
    out.push_back(entry);
    for (int q = 1; q < ep.size(); ++q) {
      Tensor& t = storage.emplace_back(entry.local->shape());
      ep.recv(t.raw_span(), q, tag);
      out.push_back({model::with_expert_index(entry.spec, q * num_local_experts + local), &t});
    }
  }
  return out;
}

/// Writes the training state to `dir` atomically (an existing checkpoint there is replaced
/// only once the new one is complete). Collective over the whole mesh: the ranks of DP
/// replica 0 write the model files and every rank its partition file of moments
/// (optimizer_partition), in parallel; global rank 0 then writes the manifest (which records
/// the ZeRO stage in "extra") and commits. Throws CheckpointError naming the file when writing
/// fails.
template <class Policy>
void save_checkpoint(const std::filesystem::path& dir, Trainer<Policy>& t) {
  auto& mesh = t.mesh();
  detail::WholeParameters whole(t.optimizer());
  std::deque<Tensor> gathered;
  checkpoint::State weights;
  if (mesh.dp_rank() < mesh.ep_size()) {  // the expert group of DP replica 0
    const std::int64_t local_experts = t.model_config().num_experts / mesh.ep_size();
    weights = with_all_experts(checkpoint::parameter_state(t.state_parameters(), checkpoint::StateUse::Save),
                               mesh.expert_group(), local_experts, gathered);
  }
  auto& mp = mesh.model_group();  // the TP x PP ranks of one replica; replica 0's rank 0 is global rank 0
  auto& dp = mesh.data_group();   // its rank 0 is in replica 0
  std::optional<checkpoint::AtomicDir> staging;
  std::string tmp;
  if (mesh.global_rank() == 0) {
    staging.emplace(dir);
    tmp = staging->tmp_path().string();
  }
  const auto broadcast = [&](auto& group) {
    std::vector<std::int64_t> len{static_cast<std::int64_t>(tmp.size())};
    group.broadcast(std::span(len), 0);
    tmp.resize(static_cast<std::size_t>(len[0]));
    group.broadcast(std::span(tmp.data(), tmp.size()), 0);
  };
  if (mesh.dp_rank() == 0) broadcast(mp);
  broadcast(dp);
  if (mesh.dp_rank() == 0) checkpoint::write_shard_file(tmp, weights, mesh.tp_size(), mesh.tp_rank(), mesh.pp_rank());
  std::deque<Tensor> moment_copies;
  if (const checkpoint::Partition moments = optimizer_partition(t, moment_copies); !moments.empty())
    checkpoint::write_partition_file(tmp, moments, mesh.tp_size(), mesh.tp_rank(), mesh.pp_rank(), mesh.dp_rank());
  dp.barrier();  // every replica's files of this (TP, PP) rank are written
  if (mesh.dp_rank() == 0) {
    mp.barrier();
    if (mesh.global_rank() == 0) {
      checkpoint::CheckpointMeta meta;
      meta.model_config = t.model_config().to_hf_json();
      meta.layout = mesh.layout();
      meta.iteration = t.iteration();
      meta.extra = {{"sampler", t.sampler().state()}, {"seed", t.config().seed}, {"zero_stage", t.optimizer().stage()}};
      if (auto* scaler = t.loss_scaler()) meta.extra["loss_scaler"] = scaler->state();
      checkpoint::write_manifest_and_commit(*staging, meta);
    }
    mp.barrier();
  }
  dp.barrier();  // nobody reads `dir` before it is complete
}

namespace detail {
// Runs f on global rank 0 while every rank waits until it is done (over the model and data
// groups: the mesh has no world group).
template <class Comm, class F>
void on_rank0_then_all(DeviceMesh<Comm>& mesh, F&& f) {
  if (mesh.dp_rank() == 0) {
    if (mesh.global_rank() == 0) f();
    mesh.model_group().barrier();
  }
  mesh.data_group().barrier();
}
}  // namespace detail

/// Saves the training state as Megatron lays out a run's checkpoints (checkpoint/
/// iterations.hpp): `root`/iter_<iteration> written atomically (save_checkpoint), then, on
/// global rank 0, the tracker `root`/latest_checkpointed_iteration.txt replaced atomically,
/// the leftovers of interrupted saves removed and only the newest `retain` iterations kept
/// (retain <= 0: all). Collective over the whole mesh; returns the iteration folder. Throws
/// CheckpointError naming the file when writing fails (the tracker then still names the
/// previous, complete iteration).
template <class Policy>
std::filesystem::path save_iteration(const std::filesystem::path& root, Trainer<Policy>& t, std::int64_t retain = 0) {
  const std::filesystem::path dir = root / checkpoint::iteration_folder_name(t.iteration());
  save_checkpoint(dir, t);
  detail::on_rank0_then_all(t.mesh(), [&] {
    checkpoint::write_tracker(root, t.iteration());
    checkpoint::remove_leftovers(root);
    checkpoint::retain_newest(root, retain);
  });
  return dir;
}

/// Resumes from `path` (saved at any TP, PP, DP and expert-parallel size and ZeRO stage):
/// parameters, moments (each rank reads the elements it owns), optimizer step, data position
/// and the loss scaler's state (when both runs scale the loss). Throws CheckpointError for a
/// missing, truncated or corrupted checkpoint, one of another model config or seed, or one
/// without optimizer state. `path` is one checkpoint or a folder of iter_* checkpoints, read at
/// the iteration its tracker names (checkpoint::resolve_checkpoint).
template <class Policy>
void load_checkpoint(const std::filesystem::path& path, Trainer<Policy>& t) {
  const std::filesystem::path dir = checkpoint::resolve_checkpoint(path);
  const checkpoint::Manifest m = checkpoint::read_manifest(dir);  // the reader verifies every file
  checkpoint::check_model_config(dir, m, t.model_config());
  DSP_CHECK_AS(CheckpointError, m.meta.extra.contains("sampler") && m.meta.extra.value("seed", std::uint64_t{0}) == t.config().seed,
               "checkpoint ", dir.string(), " holds no training state for seed ", t.config().seed);
  DSP_CHECK_AS(CheckpointError,
               std::any_of(m.tensors.begin(), m.tensors.end(),
                           [](const ShardedTensor& s) { return checkpoint::is_optimizer_state(s.name); }),
               "checkpoint ", dir.string(), " holds no optimizer state (a serving checkpoint, as dsp-reshard ",
               "--no-save-optim writes): resume from a checkpoint training saved");
  const checkpoint::CheckpointReader reader(dir);
  auto& opt = t.optimizer();
  const int tp = t.mesh().tp_size(), tp_rank = t.mesh().tp_rank();
  for (std::size_t i = 0; i < opt.parameters().size(); ++i)  // every check before anything is written
    detail::for_each_moment(opt, i, [&](const ShardedTensor& spec, std::int64_t, std::int64_t, Tensor&) {
      reader.check_matches(spec);
    });
  {
    detail::WholeParameters whole(opt);
    checkpoint::load_into(reader, checkpoint::parameter_state(t.state_parameters(), checkpoint::StateUse::Load), tp,
                          tp_rank);
    whole.take_loaded();
  }
  for (std::size_t i = 0; i < opt.parameters().size(); ++i)
    detail::for_each_moment(opt, i, [&](const ShardedTensor& spec, std::int64_t begin, std::int64_t n, Tensor& moment) {
      if (n == 0) return;
      if (moment.on_host())
        return reader.read_local(spec.name, tp, tp_rank, begin, moment.span().first(static_cast<std::size_t>(n)));
      std::vector<float> host(static_cast<std::size_t>(n));  // read on the host, copied into the moment's space
      reader.read_local(spec.name, tp, tp_rank, begin, host);
      copy_elements(moment.space(), moment.data(), host.data(), host.size());
    });
  opt.set_steps(m.meta.iteration);
  t.sampler().set_state(m.meta.extra.at("sampler").get<dp::DataSampler::State>());
  if (auto* scaler = t.loss_scaler(); scaler && m.meta.extra.contains("loss_scaler"))
    scaler->set_state(m.meta.extra.at("loss_scaler").get<precision::DynamicLossScaler::State>());
}

/// Starts training from the weights of the Hugging Face model folder `dir`
/// (checkpoint/hf_import.hpp): every rank fills the TP shards of the parameters it holds (its
/// stages' layers, its experts), reading only those slices; the optimizer state, iteration and
/// data position stay fresh. Collective over the data-parallel group at ZeRO 3 (the parameters
/// are whole while they are filled, as in load_checkpoint). Throws CheckpointError naming the
/// file and the tensor when the folder lacks one of the model's tensors or holds it with
/// another shape (the model being the trainer's: its config is not compared with config.json),
/// ConfigError as read_hf_config.
template <class Policy>
void load_hugging_face(const std::filesystem::path& dir, Trainer<Policy>& t) {
  const checkpoint::HfFolder folder(dir);
  detail::WholeParameters whole(t.optimizer());
  checkpoint::load_into(folder, checkpoint::parameter_state(t.state_parameters(), checkpoint::StateUse::Load),
                        t.mesh().tp_size(), t.mesh().tp_rank());
  whole.take_loaded();
}

}  // namespace dsp::train
