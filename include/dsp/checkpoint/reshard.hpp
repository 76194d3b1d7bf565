#pragma once
// Resharding a checkpoint to another tensor-parallel size: a pure function of the manifest,
// the target layout and whether the optimizer state is kept. Every global tensor is assembled
// from the source shards (of every TP rank and pipeline stage) and cut again with shard_of for
// the target TP; the result is a
// checkpoint like any other (pipeline 1: the serving layout; training loads a checkpoint at
// any PP directly), loadable with load_into at the target TP or at any other the specs allow.
// The tensors are written in global_model_order, so the result does not depend on the
// source's pipeline layout. As in a checkpoint training wrote, the model files hold the model
// alone and the AdamW moments go to partition files, so serving reads no optimizer state.
#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "dsp/checkpoint/atomic_dir.hpp"
#include "dsp/checkpoint/load.hpp"
#include "dsp/checkpoint/manifest.hpp"
#include "dsp/checkpoint/merge.hpp"
#include "dsp/checkpoint/save.hpp"
#include "dsp/checkpoint/state.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/tensor.hpp"
#include "dsp/parallel/sharded_tensor.hpp"

namespace dsp::checkpoint {

/// What reshard does with the optimizer state (tensors named optimizer_prefix + ...).
enum class OptimizerState {
  Keep,  ///< resharded too: a checkpoint training can resume from at the target layout
  Drop,  ///< left out: a serving checkpoint of a third of the size (training cannot resume from it)
};

/// Writes the checkpoint in `src_dir` (saved at any TP and PP) to `dst_dir` (atomically; an
/// existing `dst_dir` is replaced only on success) with layout TP target_tp, PP 1, DP
/// target_dp, and the same model_config, iteration and extra; extra["resharded_from"] names the
/// original checkpoint and its layout (kept from the source when it was itself resharded).
/// Target TP rank r's model tensors go to shard_file_name(r, 0) and, with OptimizerState::Keep,
/// its optimizer tensors (whole TP-local shards) to partition_file_name(r, 0, 0), which any
/// data-parallel size and ZeRO stage loads from; both in global_model_order. Before reading any
/// tensor, throws ConfigError naming the numbers when target_tp or target_dp is < 1 or some
/// tensor cannot be split target_tp ways (nothing is written). Throws CheckpointError when the
/// source is invalid (see CheckpointReader; with Drop its optimizer files are not read) or
/// writing fails. Memory: every global tensor written plus one target rank's shards.
inline void reshard(const std::filesystem::path& src_dir, const std::filesystem::path& dst_dir, int target_tp,
                    int target_dp, OptimizerState optimizer = OptimizerState::Keep) {
  std::error_code ec;
  const auto src = std::filesystem::weakly_canonical(src_dir, ec), dst = std::filesystem::weakly_canonical(dst_dir, ec);
  const bool inside = std::mismatch(dst.begin(), dst.end(), src.begin(), src.end()).first == dst.end();
  DSP_CHECK_AS(ConfigError, !inside, "cannot reshard ", src_dir.string(), " onto itself (--save ", dst_dir.string(),
               " is it or holds it): --save must name another directory");
  DSP_CHECK_AS(ConfigError, target_tp >= 1 && target_dp >= 1, "cannot reshard ", src_dir.string(), " to TP ",
               target_tp, " / DP ", target_dp, ": sizes must be >= 1");
  const bool keep = optimizer == OptimizerState::Keep;
  const auto written = [&](const ShardedTensor& spec) { return keep || !is_optimizer_state(spec.name); };
  for (const ShardedTensor& spec : read_manifest(src_dir).tensors) {
    if (!written(spec)) continue;
    try {
      spec.validate(target_tp);
    } catch (const ConfigError& e) {
      throw ConfigError(dsp::detail::concat("cannot reshard ", src_dir.string(), " to TP ", target_tp, ": tensor ",
                                            spec.name, ": ", e.what()));
    }
  }
  const CheckpointReader reader(src_dir, keep ? ReadScope::All : ReadScope::Model);
  CheckpointMeta meta = reader.manifest().meta;
  const ParallelLayout& from = meta.layout;
  if (!meta.extra.contains("resharded_from"))  // provenance: the checkpoint training wrote
    meta.extra["resharded_from"] = {{"checkpoint", std::filesystem::absolute(src_dir).lexically_normal().string()},
                                    {"tensor", from.tensor}, {"pipeline", from.pipeline}, {"data", from.data}};
  meta.layout = {.tensor = target_tp, .pipeline = 1, .data = target_dp, .expert = 1};

  std::vector<ShardedTensor> specs;
  std::map<std::string, Tensor> globals;
  for (ShardedTensor& spec : global_model_order(reader.manifest().tensors)) {
    if (!written(spec)) continue;
    globals.emplace(spec.name, reader.global_tensor(spec.name));
    specs.push_back(std::move(spec));
  }
  AtomicDir staging(dst_dir);
  for (int rank = 0; rank < target_tp; ++rank) {
    std::vector<Tensor> shards;
    shards.reserve(specs.size());
    State model;
    Partition moments;
    for (const ShardedTensor& spec : specs) {
      Tensor& shard = shards.emplace_back(shard_of(spec, globals.at(spec.name), target_tp, rank));
      if (is_optimizer_state(spec.name))
        moments.push_back({spec, 0, shard.span()});
      else
        model.push_back({spec, &shard});
    }
    write_shard_file(staging.tmp_path(), model, target_tp, rank, 0);
    if (!moments.empty()) write_partition_file(staging.tmp_path(), moments, target_tp, rank, 0, 0);
  }
  write_manifest_and_commit(staging, meta);
}

}  // namespace dsp::checkpoint
