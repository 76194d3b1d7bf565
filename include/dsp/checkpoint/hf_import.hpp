#pragma once
// Importing a Hugging Face model folder: config.json (hf_config.hpp) and its weights, one
// `model.safetensors` or the shards that `model.safetensors.index.json` lists
// ({"weight_map": {"<tensor>": "<file>", ...}}). Tensors may be F32, BF16, F16 (widened exactly)
// or F8_E4M3 with a block scale `<tensor>_scale_inv` (DeepSeek-V3: "weight_scale_inv"
// [ceil(rows / 128), ceil(cols / 128)] fp32, 128 x 128 from quantization_config's
// weight_block_size), dequantised on import as w[r][c] x scale[r / 128][c / 128] in fp32: the
// product transformers and DeepSeek's inference code compute.
//
// Names are dsp's (the Hugging Face ones, ShardedTensor); a fused tensor (qkv_proj, gate_up_proj)
// is read from its parts (q_proj, k_proj, v_proj; gate_proj, up_proj), the rows merge.hpp cuts it
// into, stacked in the same order. Each rank reads only its shard: the byte ranges of the rows
// (or row pieces) it holds. Experts are read per expert (`experts.{e}.gate_proj.weight`, as
// transformers saves them) or from the fused tensors transformers 5 holds in memory
// (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), each expert a slice.
#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/checkpoint/file_io.hpp"
#include "dsp/checkpoint/hf_config.hpp"
#include "dsp/checkpoint/manifest.hpp"
#include "dsp/checkpoint/safetensors.hpp"
#include "dsp/checkpoint/state.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/tensor.hpp"
#include "dsp/model/config.hpp"
#include "dsp/parallel/sharded_tensor.hpp"

namespace dsp::checkpoint {

/// Name of a Hugging Face model folder's single weights file.
inline constexpr std::string_view hf_weights_file = "model.safetensors";
/// Name of the index of a sharded Hugging Face model folder.
inline constexpr std::string_view hf_index_file = "model.safetensors.index.json";
/// Suffix of an FP8 tensor's block scale ("<tensor>_scale_inv").
inline constexpr std::string_view hf_scale_suffix = "_scale_inv";

/// Dequantises elements [first, first + out.size()) (flattened row-major) of the block-scaled
/// matrix `entry` [rows, cols], whose values `out` holds as stored (an F8_E4M3 value widened
/// exactly): element (r, c) is multiplied by scale[r / block rows][c / block cols] in fp32, the
/// product torch computes for w.float() * scale expanded over the blocks (DeepSeek-V3's
/// weight_dequant: one rounding, so the result is the same bits). `scale` must be
/// [ceil(rows / block rows), ceil(cols / block cols)]. Throws CheckpointError naming `file` and
/// the tensor when `entry` is not a matrix or the scale has another shape (both shapes given).
inline void apply_block_scale(const std::string& file, const SafetensorsEntry& entry, const Tensor& scale,
                              std::pair<std::int64_t, std::int64_t> block, std::int64_t first, std::span<float> out) {
  DSP_CHECK_AS(CheckpointError, entry.shape.size() == 2, file, ": block-scaled tensor '", entry.name,
               "' has shape ", shape_str(entry.shape), ", not a matrix");
  const std::int64_t rows = entry.shape[0], cols = entry.shape[1];
  const auto [b_rows, b_cols] = block;
  const Shape want{(rows + b_rows - 1) / b_rows, (cols + b_cols - 1) / b_cols};
  DSP_CHECK_AS(CheckpointError, scale.shape() == want, file, ": tensor '", entry.name, "' of shape ",
               shape_str(entry.shape), " in ", b_rows, " x ", b_cols, " blocks needs a block scale of shape ",
               shape_str(want), ", its '", entry.name, hf_scale_suffix, "' has shape ", shape_str(scale.shape()));
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::int64_t e = first + static_cast<std::int64_t>(i), r = e / cols, c = e % cols;
    out[i] *= scale.data()[(r / b_rows) * want[1] + c / b_cols];
  }
}

/// Whether `dir` is a Hugging Face model folder: it has a config.json and no dsp manifest.
inline bool is_hugging_face_folder(const std::filesystem::path& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(dir / hf_config_file, ec) &&
         !std::filesystem::exists(dir / manifest_file_name, ec);
}

/// A Hugging Face model folder opened for reading: its config and where each tensor lives.
/// File headers are read when a tensor of the file is first asked for (a rank opens only the
/// shards holding its tensors). Not thread-safe: each rank opens its own.
class HfFolder {
 public:
  /// Reads config.json (read_hf_config) and the index, or the single file's header. Throws
  /// CheckpointError naming the file: config.json or the weights missing, the index not valid
  /// JSON or without a "weight_map" of tensor -> file name inside the folder, a file the index
  /// lists missing (with a tensor it is listed for); ConfigError as read_hf_config.
  explicit HfFolder(std::filesystem::path dir) : dir_(std::move(dir)), config_(read_hf_config(dir_)) {
    const nlohmann::json j = nlohmann::json::parse(read_text(dir_ / hf_config_file), nullptr, false);
    if (j.contains("quantization_config") && j.at("quantization_config").contains("weight_block_size")) {
      const auto& b = j.at("quantization_config").at("weight_block_size");
      const bool ok = b.is_array() && b.size() == 2 && b[0].is_number_integer() && b[1].is_number_integer() &&
                      b[0].get<std::int64_t>() > 0 && b[1].get<std::int64_t>() > 0;
      if (!ok)
        throw ConfigError(dsp::detail::concat((dir_ / hf_config_file).string(),
                                              ": field 'quantization_config.weight_block_size' must be two positive "
                                              "integers, got ", b.dump()));
      block_ = {b[0].get<std::int64_t>(), b[1].get<std::int64_t>()};
    }
    map_files();
    add_fused_expert_views();
  }

  const std::filesystem::path& dir() const { return dir_; }
  /// The model config.json describes.
  const model::ModelConfig& config() const { return config_; }
  /// Whether the folder holds tensor `name`.
  bool contains(const std::string& name) const { return file_of_.count(name) != 0 || views_.count(name) != 0; }

  /// The header entry of tensor `name` (its dtype and shape) and the file holding it. Throws
  /// CheckpointError naming the weights file (or the index) and the tensor when absent.
  std::pair<const SafetensorsFile*, const SafetensorsEntry*> find(const std::string& name) const {
    if (const auto v = views_.find(name); v != views_.end())
      return {&open(file_of_.at(v->second.source)), &v->second.entry};
    const auto it = file_of_.find(name);
    if (it == file_of_.end()) {
      std::error_code ec;
      const bool indexed = std::filesystem::exists(dir_ / hf_index_file, ec);
      throw CheckpointError(dsp::detail::concat((dir_ / (indexed ? hf_index_file : hf_weights_file)).string(),
                                                ": no tensor '", name, "'", indexed ? " in weight_map" : ""));
    }
    const SafetensorsFile& file = open(it->second);
    if (!file.contains(name))
      throw CheckpointError(dsp::detail::concat(file.path().string(), ": no tensor '", name, "' (", hf_index_file,
                                                " maps it to this file)"));
    return {&file, &file.entry(name)};
  }

  /// Names of the tensors of layers `first_layer` and up (`model.layers.{i}.*`, i >=
  /// first_layer), in name order: with first_layer = num_hidden_layers, DeepSeek-V3's
  /// multi-token-prediction layers (num_nextn_predict_layers of them), which dsp does not train.
  std::vector<std::string> tensors_from_layer(std::int64_t first_layer) const {
    std::vector<std::string> out;
    constexpr std::string_view prefix = "model.layers.";
    for (const auto& [name, file] : file_of_) {
      if (!name.starts_with(prefix)) continue;
      const std::string rest = name.substr(prefix.size());
      const auto dot = rest.find('.');
      if (dot == std::string::npos || dot == 0 || rest.find_first_not_of("0123456789") != dot) continue;
      if (std::stoll(rest.substr(0, dot)) >= first_layer) out.push_back(name);
    }
    return out;
  }

  /// Shape of tensor `name`; throws as find.
  const Shape& shape(const std::string& name) const { return find(name).second->shape; }

  /// Elements [first, first + out.size()) of tensor `name`, flattened row-major, as fp32: only
  /// their bytes are read; an F8_E4M3 tensor is multiplied by its block scale (read whole: one
  /// value per block). Throws CheckpointError naming the file and tensor as find, for an integer
  /// dtype or elements outside the tensor, and for an F8_E4M3 tensor without its scale tensor or
  /// with a scale of another shape than [ceil(rows / block rows), ceil(cols / block cols)].
  void read_elements(const std::string& name, std::int64_t first, std::span<float> out) const {
    const auto [file, entry] = find(name);
    if (const auto v = views_.find(name); v != views_.end()) {
      DSP_CHECK_AS(CheckpointError, first >= 0 && first + static_cast<std::int64_t>(out.size()) <= numel(entry->shape),
                   file->path().string(), ": elements [", first, ", ", first + static_cast<std::int64_t>(out.size()),
                   ") outside expert slice '", name, "' of '", v->second.source, "'");
      DSP_CHECK_AS(CheckpointError, entry->dtype != DType::F8_E4M3, file->path().string(), ": fused expert tensor '",
                   v->second.source, "' in F8_E4M3 (block scales of fused experts are not read)");
      return file->read_elements(v->second.source, v->second.offset + first, out);
    }
    file->read_elements(name, first, out);
    if (entry->dtype != DType::F8_E4M3) return;
    const std::string scale_name = name + std::string(hf_scale_suffix);
    if (!contains(scale_name))
      throw CheckpointError(dsp::detail::concat(file->path().string(), ": F8_E4M3 tensor '", name,
                                                "' has no block scale '", scale_name, "'"));
    const auto [scale_file, scale_entry] = find(scale_name);
    apply_block_scale(file->path().string(), *entry, scale_file->tensor(scale_name), block_, first, out);
  }

  /// Tensor `name` whole, as fp32 (dequantised as read_elements).
  Tensor tensor(const std::string& name) const {
    Tensor t = Tensor::host_zeros(shape(name));
    read_elements(name, 0, t.span());
    return t;
  }

 private:
  // file_of_ from the index, or from the single file's header.
  void map_files() {
    std::error_code ec;
    const std::filesystem::path index = dir_ / hf_index_file;
    if (!std::filesystem::exists(index, ec)) {
      const std::filesystem::path single = dir_ / hf_weights_file;
      if (!std::filesystem::exists(single, ec))
        throw CheckpointError(dsp::detail::concat(dir_.string(), ": no ", hf_weights_file, " and no ", hf_index_file,
                                                  " (the weights of a Hugging Face model folder)"));
      for (const SafetensorsEntry& e : open(std::string(hf_weights_file)).entries())
        file_of_[e.name] = std::string(hf_weights_file);
      return;
    }
    const auto fail = [&](const auto&... what) {
      return CheckpointError(dsp::detail::concat(index.string(), ": ", what...));
    };
    const nlohmann::json idx = nlohmann::json::parse(read_text(index), nullptr, false);
    if (idx.is_discarded()) throw fail("not valid JSON (truncated?)");
    if (!idx.is_object() || !idx.contains("weight_map") || !idx.at("weight_map").is_object())
      throw fail("has no \"weight_map\" object of tensor -> file");
    for (const auto& [tensor, file] : idx.at("weight_map").items()) {
      if (!file.is_string()) throw fail("weight_map maps tensor '", tensor, "' to ", file.dump(), ", not a file name");
      const std::string name = file.get<std::string>();
      if (std::filesystem::path(name).filename() != name || name == "." || name == "..")
        throw fail("weight_map maps tensor '", tensor, "' to '", name, "', not a file name inside the folder");
      if (!std::filesystem::is_regular_file(dir_ / name, ec))
        throw CheckpointError(dsp::detail::concat((dir_ / name).string(), ": missing (", hf_index_file,
                                                  " lists it for tensor '", tensor, "')"));
      file_of_[tensor] = name;
    }
  }

  // The fused expert layout transformers 5 holds (DeepseekV3Experts / DeepseekV2Experts):
  // `<layer>.mlp.experts.gate_up_proj` [experts, 2 x moe_intermediate, hidden], each expert's
  // gate rows then its up rows, and `<layer>.mlp.experts.down_proj` [experts, hidden,
  // moe_intermediate]. Each expert's gate_proj / up_proj / down_proj `.weight` not in the folder
  // itself becomes a view of its rows, so a rank reads only its experts' bytes. Throws CheckpointError naming the file and
  // the tensor when a fused tensor's shape is not the config's.
  void add_fused_expert_views() {
    const std::int64_t experts = config_.num_experts, inter = config_.moe_ffn_hidden_size, hidden = config_.hidden_size;
    std::vector<std::pair<std::string, std::string>> fused;  // (name, its experts prefix)
    for (const auto& [name, file] : file_of_)
      for (const std::string_view suffix : {".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"})
        if (name.ends_with(suffix)) fused.emplace_back(name, name.substr(0, name.size() - suffix.size()) + ".mlp.experts.");
    for (const auto& [name, prefix] : fused) {
      const SafetensorsFile& file = open(file_of_.at(name));
      const SafetensorsEntry& e = file.entry(name);
      const bool gate_up = name.ends_with("gate_up_proj");
      const Shape want = gate_up ? Shape{experts, 2 * inter, hidden} : Shape{experts, hidden, inter};
      DSP_CHECK_AS(CheckpointError, e.shape == want, file.path().string(), ": fused expert tensor '", name,
                   "' has shape ", shape_str(e.shape), ", the model of ", hf_config_file, " expects ", shape_str(want));
      for (std::int64_t x = 0; x < experts; ++x) {
        const std::string expert = prefix + std::to_string(x) + ".";
        const auto view = [&](const std::string& part, std::int64_t offset, Shape shape) {
          SafetensorsEntry v = e;
          v.name = expert + part + ".weight";
          if (file_of_.count(v.name)) return;  // the per-expert tensor itself is in the folder
          v.shape = std::move(shape);
          views_[v.name] = {name, offset, v};
        };
        if (gate_up) {
          view("gate_proj", x * 2 * inter * hidden, {inter, hidden});
          view("up_proj", x * 2 * inter * hidden + inter * hidden, {inter, hidden});
        } else {
          view("down_proj", x * hidden * inter, {hidden, inter});
        }
      }
    }
  }

  // A tensor that is a slice of a fused one: its elements from `offset` of `source`.
  struct View {
    std::string source;
    std::int64_t offset = 0;
    SafetensorsEntry entry;  ///< the slice's name, shape and dtype
  };

  const SafetensorsFile& open(const std::string& file) const {
    auto it = files_.find(file);
    if (it == files_.end()) it = files_.emplace(file, read_safetensors(dir_ / file)).first;
    return it->second;
  }

  std::filesystem::path dir_;
  model::ModelConfig config_;
  std::pair<std::int64_t, std::int64_t> block_{128, 128};  // FP8 block scale: rows x cols
  std::map<std::string, std::string> file_of_;             // tensor -> file name
  std::map<std::string, View> views_;                      // per-expert slices of fused tensors
  mutable std::map<std::string, SafetensorsFile> files_;   // opened headers
};

/// Checks that `folder` holds the Hugging Face tensors of `spec` (its parts, or the tensor
/// itself) with the shapes the spec implies. Throws CheckpointError naming the file and the
/// tensor, with both shapes, otherwise (or as HfFolder::find).
inline void check_hf_tensor(const HfFolder& folder, const ShardedTensor& spec) {
  const auto check = [&](const std::string& name, const Shape& want) {
    const auto [file, entry] = folder.find(name);
    DSP_CHECK_AS(CheckpointError, entry->shape == want, file->path().string(), ": tensor '", name, "' has shape ",
                 shape_str(entry->shape), ", the model of ", hf_config_file, " expects ", shape_str(want));
  };
  if (spec.parts.empty()) return check(spec.name, spec.global_shape);
  for (const TensorPart& p : spec.parts) {
    Shape part = spec.global_shape;
    part.at(0) = p.rows;
    check(p.name, part);
  }
}

/// Fills TP rank `tp_rank` of `tp_size`'s shard of `spec` (`local`, shape spec.local_shape)
/// from `folder`: for every run of global elements the rank holds (for_each_shard_row, runs
/// that continue each other merged) the bytes of those elements, a fused tensor's from its
/// parts. Padding (vocabulary rows past the end) is left as it is. Throws as check_hf_tensor
/// and HfFolder::read_elements.
inline void read_hf_shard(const HfFolder& folder, const ShardedTensor& spec, int tp_size, int tp_rank,
                          std::span<float> local) {
  check_hf_tensor(folder, spec);
  // The parts stacked by rows: part i holds global elements [starts[i], starts[i + 1]).
  std::vector<std::pair<std::string, std::int64_t>> starts;
  const std::int64_t row = spec.global_shape.empty() || spec.global_shape[0] == 0
                               ? 0
                               : numel(spec.global_shape) / spec.global_shape[0];
  std::int64_t begin = 0;
  if (spec.parts.empty()) starts.emplace_back(spec.name, 0);
  for (const TensorPart& p : spec.parts) {
    starts.emplace_back(p.name, begin);
    begin += p.rows * row;
  }
  const auto read = [&](std::int64_t l, std::int64_t g, std::int64_t n) {
    while (n > 0) {  // split at part boundaries
      auto it = std::upper_bound(starts.begin(), starts.end(), g,
                                 [](std::int64_t v, const auto& s) { return v < s.second; });
      --it;
      const std::int64_t part_end = std::next(it) == starts.end() ? numel(spec.global_shape) : std::next(it)->second;
      const std::int64_t take = std::min(n, part_end - g);
      folder.read_elements(it->first, g - it->second,
                           local.subspan(static_cast<std::size_t>(l), static_cast<std::size_t>(take)));
      l += take;
      g += take;
      n -= take;
    }
  };
  std::optional<std::array<std::int64_t, 3>> run;  // (local, global, count) being merged
  for_each_shard_row(spec, tp_size, tp_rank, [&](std::int64_t l, std::int64_t g, std::int64_t n) {
    if (run && (*run)[0] + (*run)[2] == l && (*run)[1] + (*run)[2] == g) {
      (*run)[2] += n;
      return;
    }
    if (run) read((*run)[0], (*run)[1], (*run)[2]);
    run = std::array{l, g, n};
  });
  if (run) read((*run)[0], (*run)[1], (*run)[2]);
}

/// Fills every local tensor of `state` (TP rank tp_rank of tp_size) from the Hugging Face
/// folder: read_hf_shard of each entry, a tensor in a memory space (device memory) copied there
/// from the host. All tensors are checked (present, shapes) before any is written. Throws
/// ConfigError as check_state when the state does not fit; CheckpointError naming the file and
/// the tensor as check_hf_tensor and HfFolder::read_elements.
inline void load_into(const HfFolder& folder, const State& state, int tp_size, int tp_rank) {
  check_state(state, tp_size, tp_rank);
  for (const ShardEntry& e : state) check_hf_tensor(folder, e.spec);
  for (const ShardEntry& e : state) {
    Tensor local = Tensor::host_zeros(e.spec.local_shape(tp_size));
    read_hf_shard(folder, e.spec, tp_size, tp_rank, local.span());
    if (e.local->on_host()) *e.local = std::move(local);
    else e.local->copy_from_host(local.span());
  }
}

}  // namespace dsp::checkpoint
