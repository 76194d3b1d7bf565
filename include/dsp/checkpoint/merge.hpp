#pragma once
// Merging a sharded checkpoint into one Hugging Face model directory:
//   model.safetensors  every non-optimizer tensor, global (padding removed), fp32, metadata
//                      {"format": "pt"}; fused tensors split by rows into their parts
//                      (qkv_proj -> q_proj, k_proj, v_proj; gate_up_proj -> gate_proj, up_proj)
//   config.json        the manifest's model_config (a Hugging Face config, supplied at save)
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dsp/checkpoint/atomic_dir.hpp"
#include "dsp/checkpoint/file_io.hpp"
#include "dsp/checkpoint/load.hpp"
#include "dsp/checkpoint/safetensors.hpp"
#include "dsp/checkpoint/state.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/tensor.hpp"
#include "dsp/parallel/sharded_tensor.hpp"

namespace dsp::checkpoint {

/// Name of the merged weights file.
inline constexpr std::string_view merged_model_file = "model.safetensors";
/// Name of the merged config file.
inline constexpr std::string_view merged_config_file = "config.json";

/// The Hugging Face tensors of one global tensor: (part name, rows) pieces in order when the
/// spec lists parts, else the tensor itself under the spec's name. Throws CheckpointError
/// naming the tensor when its parts' rows do not add up to its first dimension.
inline std::vector<std::pair<std::string, Tensor>> hugging_face_tensors(const ShardedTensor& spec, Tensor global) {
  std::vector<std::pair<std::string, Tensor>> out;
  if (spec.parts.empty()) {
    out.emplace_back(spec.name, std::move(global));
    return out;
  }
  std::int64_t rows = 0;
  for (const TensorPart& p : spec.parts) rows += p.rows;
  DSP_CHECK_AS(CheckpointError, !global.shape().empty() && rows == global.dim(0), "tensor ", spec.name,
               ": parts have ", rows, " rows in all, the tensor has shape ", shape_str(global.shape()));
  const std::int64_t row_size = global.dim(0) == 0 ? 0 : global.numel() / global.dim(0);
  std::int64_t first_row = 0;
  for (const TensorPart& p : spec.parts) {
    Shape shape = global.shape();
    shape[0] = p.rows;
    Tensor part(std::move(shape));
    std::copy_n(global.data() + first_row * row_size, p.rows * row_size, part.data());
    first_row += p.rows;
    out.emplace_back(p.name, std::move(part));
  }
  return out;
}

/// Writes the checkpoint in `dir` (verified first) to `out_dir` as model.safetensors +
/// config.json, atomically (an existing `out_dir` is replaced only on success). Tensors whose
/// name starts with optimizer_prefix are left out. Throws CheckpointError when the checkpoint
/// is invalid (see CheckpointReader), a fused tensor's parts do not fit, two tensors end up with
/// the same name, or writing fails.
inline void merge(const std::filesystem::path& dir, const std::filesystem::path& out_dir) {
  const CheckpointReader reader(dir);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const ShardedTensor& spec : reader.manifest().tensors) {
    if (spec.name.starts_with(optimizer_prefix)) continue;
    for (auto& piece : hugging_face_tensors(spec, reader.global_tensor(spec.name)))
      tensors.push_back(std::move(piece));
  }
  std::vector<std::pair<std::string, const Tensor*>> refs;
  for (const auto& [name, t] : tensors) refs.emplace_back(name, &t);

  AtomicDir staging(out_dir);
  write_safetensors(staging.tmp_path() / merged_model_file, refs, {{"format", "pt"}});
  write_text(staging.tmp_path() / merged_config_file, reader.manifest().meta.model_config.dump(2) + "\n");
  staging.commit();
}

}  // namespace dsp::checkpoint
