#pragma once
// Resharding a checkpoint to another tensor-parallel size: a pure function of the manifest
// and the target layout. Every global tensor is assembled from the source shards (of every
// TP rank and pipeline stage) and cut again with shard_of for the target TP; the result is a
// checkpoint like any other (pipeline 1: the serving layout; training loads a checkpoint at
// any PP directly), loadable with load_into at the target TP or at any other the specs allow.
// The tensors are written in global_model_order, so the result does not depend on the
// source's pipeline layout.
#include <filesystem>
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

/// Writes the checkpoint in `src_dir` (saved at any TP and PP) to `dst_dir` (atomically; an
/// existing `dst_dir` is replaced only on success) with layout TP target_tp, PP 1, DP
/// target_dp, its tensors in global_model_order (optimizer state included), and the same
/// model_config, iteration and extra; extra["resharded_from"] names the original checkpoint
/// and its layout (kept from the source when it was itself resharded). Before reading any tensor, throws ConfigError naming the
/// numbers when target_tp or target_dp is < 1 or some tensor cannot be split target_tp ways
/// (nothing is written). Throws CheckpointError when the source is invalid (see
/// CheckpointReader) or writing fails. Memory: the whole global model plus one target rank's
/// shards.
inline void reshard(const std::filesystem::path& src_dir, const std::filesystem::path& dst_dir, int target_tp,
                    int target_dp) {
  std::error_code ec;
  DSP_CHECK_AS(ConfigError, !std::filesystem::equivalent(src_dir, dst_dir, ec), "cannot reshard ", src_dir.string(),
               " onto itself: --save must name another directory");
  DSP_CHECK_AS(ConfigError, target_tp >= 1 && target_dp >= 1, "cannot reshard ", src_dir.string(), " to TP ",
               target_tp, " / DP ", target_dp, ": sizes must be >= 1");
  for (const ShardedTensor& spec : read_manifest(src_dir).tensors) {
    try {
      spec.validate(target_tp);
    } catch (const ConfigError& e) {
      throw ConfigError(dsp::detail::concat("cannot reshard ", src_dir.string(), " to TP ", target_tp, ": tensor ",
                                            spec.name, ": ", e.what()));
    }
  }
  const GlobalCheckpoint source = load_global(src_dir);
  CheckpointMeta meta = source.manifest.meta;
  const ParallelLayout& from = meta.layout;
  if (!meta.extra.contains("resharded_from"))  // provenance: the checkpoint training wrote
    meta.extra["resharded_from"] = {{"checkpoint", std::filesystem::absolute(src_dir).lexically_normal().string()},
                                    {"tensor", from.tensor}, {"pipeline", from.pipeline}, {"data", from.data}};
  meta.layout = {.tensor = target_tp, .pipeline = 1, .data = target_dp, .expert = 1};

  const std::vector<ShardedTensor> specs = global_model_order(source.manifest.tensors);
  AtomicDir staging(dst_dir);
  for (int rank = 0; rank < target_tp; ++rank) {
    std::vector<Tensor> shards;
    shards.reserve(specs.size());
    State state;
    for (const ShardedTensor& spec : specs) {
      shards.push_back(shard_of(spec, source.tensors.at(spec.name), target_tp, rank));
      state.push_back({spec, &shards.back()});
    }
    write_shard_file(staging.tmp_path(), state, target_tp, rank, 0);
  }
  write_manifest_and_commit(staging, meta);
}

}  // namespace dsp::checkpoint
