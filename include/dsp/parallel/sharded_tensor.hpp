#pragma once
// ShardedTensor: the one description of how a parameter's global tensor is split over the
// tensor-parallel ranks. Initialisation, gradient norms, checkpoints, merge and reshard
// all read it; none re-derives a split.
//
// The split is described by an index map along `split_dim`: local index i on TP rank t holds
// global index map(t)[i] (or padding, -1). Kinds:
//   Replicated  every rank holds the whole tensor.
//   Split       contiguous equal blocks along split_dim (ColumnParallel: dim 0 of [out, in];
//               RowParallel: dim 1).
//   Vocab       dim 0 padded up to a multiple of TP; rows >= vocab are padding (-1).
//   Qkv         fused [q; k; v] rows (Hugging Face q_proj, k_proj, v_proj concatenated):
//               query heads split evenly; key/value heads split per KV group when
//               kv_heads >= TP, else each KV head is replicated on TP / kv_heads ranks.
//   GateUp      fused [gate; up] rows, each half split evenly (SwiGLU).
#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/core/divide.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/tensor.hpp"

namespace dsp {

enum class ShardKind { Replicated, Split, Vocab, Qkv, GateUp };

NLOHMANN_JSON_SERIALIZE_ENUM(ShardKind, {{ShardKind::Replicated, "replicated"},
                                         {ShardKind::Split, "split"},
                                         {ShardKind::Vocab, "vocab"},
                                         {ShardKind::Qkv, "qkv"},
                                         {ShardKind::GateUp, "gate_up"}})

/// A named part of a fused tensor: `rows` consecutive rows of the global tensor that form
/// the Hugging Face tensor `name` (e.g. q_proj inside qkv_proj).
struct TensorPart {
  std::string name;
  std::int64_t rows = 0;
  bool operator==(const TensorPart&) const = default;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(TensorPart, name, rows)

/// Global shape and TP split of one parameter.
struct ShardedTensor {
  std::string name;           ///< global name (Hugging Face layout, global layer index)
  Shape global_shape;         ///< unpadded global shape
  ShardKind kind = ShardKind::Replicated;
  int split_dim = -1;         ///< dimension that is split (-1 when replicated)
  std::int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;  ///< Qkv only
  std::vector<TensorPart> parts;  ///< fused tensors: their Hugging Face parts, in row order

  static ShardedTensor replicated(std::string name, Shape shape) {
    return {std::move(name), std::move(shape), ShardKind::Replicated, -1, 0, 0, 0, {}};
  }
  /// Contiguous split of dim (0: column-parallel [out, in]; 1: row-parallel).
  static ShardedTensor split(std::string name, Shape shape, int dim) {
    return {std::move(name), std::move(shape), ShardKind::Split, dim, 0, 0, 0, {}};
  }
  /// Vocabulary-parallel [vocab, hidden], padded to a multiple of TP.
  static ShardedTensor vocab(std::string name, Shape shape) {
    return {std::move(name), std::move(shape), ShardKind::Vocab, 0, 0, 0, 0, {}};
  }
  /// Fused [q; k; v] projection of shape [(heads + 2 kv_heads) * head_dim, hidden].
  static ShardedTensor qkv(std::string name, std::int64_t hidden, std::int64_t heads, std::int64_t kv_heads,
                           std::int64_t head_dim, std::vector<std::string> part_names) {
    return {std::move(name), {(heads + 2 * kv_heads) * head_dim, hidden}, ShardKind::Qkv, 0, heads, kv_heads,
            head_dim,
            {{part_names.at(0), heads * head_dim}, {part_names.at(1), kv_heads * head_dim},
             {part_names.at(2), kv_heads * head_dim}}};
  }
  /// Fused [gate; up] projection of shape [2 * ffn, hidden].
  static ShardedTensor gate_up(std::string name, std::int64_t hidden, std::int64_t ffn,
                               std::vector<std::string> part_names) {
    return {std::move(name), {2 * ffn, hidden}, ShardKind::GateUp, 0, 0, 0, 0,
            {{part_names.at(0), ffn}, {part_names.at(1), ffn}}};
  }

  /// Throws ConfigError, naming the numbers, when this tensor cannot be split tp ways.
  void validate(int tp) const {
    const std::string what = "tensor " + name;
    switch (kind) {
      case ShardKind::Replicated:
      case ShardKind::Vocab: return;
      case ShardKind::Split:
        divide(global_shape.at(split_dim), tp, what + " dim " + std::to_string(split_dim), "tensor-model-parallel-size");
        return;
      case ShardKind::GateUp: divide(global_shape[0] / 2, tp, what + " ffn size", "tensor-model-parallel-size"); return;
      case ShardKind::Qkv:
        divide(num_heads, tp, "number of attention heads", "tensor-model-parallel-size");
        DSP_CHECK_AS(ConfigError, num_kv_heads % tp == 0 || tp % num_kv_heads == 0, "number of query groups (",
                     num_kv_heads, ") and tensor-model-parallel-size (", tp, ") must divide one another");
        return;
    }
  }

  /// Extent of split_dim on every rank (padding included).
  std::int64_t local_extent(int tp) const {
    if (kind == ShardKind::Replicated) return global_shape.empty() ? 1 : global_shape[0];
    return static_cast<std::int64_t>(index_map(tp, 0).size());
  }
  /// Shape of the local shard on any rank (all ranks' shards have the same shape).
  Shape local_shape(int tp) const {
    Shape s = global_shape;
    if (kind != ShardKind::Replicated) s[static_cast<std::size_t>(split_dim)] = local_extent(tp);
    return s;
  }

  /// For each local index along split_dim on rank `rank` of `tp`, the global index (-1 for
  /// padding). Replicated tensors map the identity along dim 0.
  std::vector<std::int64_t> index_map(int tp, int rank) const {
    validate(tp);
    std::vector<std::int64_t> m;
    auto range = [&](std::int64_t offset, std::int64_t begin, std::int64_t count) {
      for (std::int64_t i = 0; i < count; ++i) m.push_back(offset + begin + i);
    };
    switch (kind) {
      case ShardKind::Replicated: range(0, 0, global_shape.empty() ? 1 : global_shape[0]); break;
      case ShardKind::Split: {
        const std::int64_t n = global_shape[static_cast<std::size_t>(split_dim)] / tp;
        range(0, n * rank, n);
        break;
      }
      case ShardKind::Vocab: {
        const std::int64_t n = round_up(global_shape[0], tp) / tp;
        for (std::int64_t i = n * rank; i < n * (rank + 1); ++i) m.push_back(i < global_shape[0] ? i : -1);
        break;
      }
      case ShardKind::GateUp: {
        const std::int64_t ffn = global_shape[0] / 2, n = ffn / tp;
        range(0, n * rank, n);
        range(ffn, n * rank, n);
        break;
      }
      case ShardKind::Qkv: {
        const std::int64_t d = head_dim, q_heads = num_heads / tp;
        range(0, q_heads * rank * d, q_heads * d);
        const std::int64_t kv_local = num_kv_heads >= tp ? num_kv_heads / tp : 1;
        const std::int64_t kv_first = num_kv_heads >= tp ? kv_local * rank : rank * num_kv_heads / tp;
        range(num_heads * d, kv_first * d, kv_local * d);
        range((num_heads + num_kv_heads) * d, kv_first * d, kv_local * d);
        break;
      }
    }
    return m;
  }

  /// 1 where this rank is the lowest TP rank holding that global index (so a global sum
  /// counts every element once), 0 elsewhere and on padding. Indexed like index_map.
  std::vector<char> owned(int tp, int rank) const {
    const auto mine = index_map(tp, rank);
    std::vector<char> own(mine.size(), 0);
    if (kind == ShardKind::Replicated) {
      std::fill(own.begin(), own.end(), rank == 0);
      return own;
    }
    for (std::size_t i = 0; i < mine.size(); ++i) {
      if (mine[i] < 0) continue;
      bool earlier = false;
      for (int r = 0; r < rank && !earlier; ++r) {
        const auto other = index_map(tp, r);
        earlier = std::find(other.begin(), other.end(), mine[i]) != other.end();
      }
      own[i] = !earlier;
    }
    return own;
  }

  /// True when some split element lives on more than one TP rank (K/V heads replicated
  /// because kv_heads < TP): those gradients are partial and must be summed over TP.
  bool has_partial_replicas(int tp) const { return kind == ShardKind::Qkv && num_kv_heads < tp; }

  bool operator==(const ShardedTensor&) const = default;
};

inline void to_json(nlohmann::json& j, const ShardedTensor& t) {
  j = {{"name", t.name}, {"global_shape", t.global_shape}, {"kind", t.kind}, {"split_dim", t.split_dim}};
  if (t.kind == ShardKind::Qkv) {
    j["num_heads"] = t.num_heads;
    j["num_kv_heads"] = t.num_kv_heads;
    j["head_dim"] = t.head_dim;
  }
  if (!t.parts.empty()) j["parts"] = t.parts;
}
inline void from_json(const nlohmann::json& j, ShardedTensor& t) {
  t.name = j.at("name").get<std::string>();
  t.global_shape = j.at("global_shape").get<Shape>();
  t.kind = j.at("kind").get<ShardKind>();
  t.split_dim = j.at("split_dim").get<int>();
  t.num_heads = j.value("num_heads", std::int64_t{0});
  t.num_kv_heads = j.value("num_kv_heads", std::int64_t{0});
  t.head_dim = j.value("head_dim", std::int64_t{0});
  t.parts = j.value("parts", std::vector<TensorPart>{});
}

namespace detail {
// Views a tensor of `shape` as [outer, extent(dim), inner].
inline std::array<std::int64_t, 3> around(const Shape& shape, int dim) {
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; ++i) outer *= shape[static_cast<std::size_t>(i)];
  for (std::size_t i = static_cast<std::size_t>(dim) + 1; i < shape.size(); ++i) inner *= shape[i];
  return {outer, shape[static_cast<std::size_t>(dim)], inner};
}
}  // namespace detail

/// Calls fn(local_offset, global_offset, count) for every run of `count` contiguous elements
/// that rank `rank` of `tp` holds: local_offset into its shard (shape spec.local_shape(tp)),
/// global_offset into the global tensor (shape spec.global_shape). Padding is skipped. The
/// one walk over the index map that sharding, unsharding and initialisation share.
template <class Fn>
void for_each_shard_row(const ShardedTensor& spec, int tp, int rank, Fn fn) {
  const int dim = spec.kind == ShardKind::Replicated ? 0 : spec.split_dim;
  const auto map = spec.index_map(tp, rank);
  const auto [outer, g_ext, inner] = detail::around(spec.global_shape, dim);
  const auto l_ext = static_cast<std::int64_t>(map.size());
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t i = 0; i < l_ext; ++i) {
      const std::int64_t g = map[static_cast<std::size_t>(i)];
      if (g >= 0) fn((o * l_ext + i) * inner, (o * g_ext + g) * inner, inner);
    }
}

/// The local shard of `global` (shape spec.global_shape) for TP rank `rank` of `tp`;
/// padding is zero. A replicated tensor is returned as it is, wherever it lives; a split one
/// must be on the host and its shard is made in host memory. Throws Error when global has the
/// wrong shape or is split and not on the host.
inline Tensor shard_of(const ShardedTensor& spec, const Tensor& global, int tp, int rank) {
  DSP_CHECK(global.shape() == spec.global_shape, spec.name, ": global tensor has shape ",
            shape_str(global.shape()), ", expected ", shape_str(spec.global_shape));
  if (spec.kind == ShardKind::Replicated) return global;
  Tensor local = Tensor::host_zeros(spec.local_shape(tp));
  const std::span<const float> in = global.span();
  const std::span<float> out = local.span();
  for_each_shard_row(spec, tp, rank, [&](std::int64_t l, std::int64_t g, std::int64_t n) {
    std::copy_n(in.begin() + g, n, out.begin() + l);
  });
  return local;
}

/// Writes the elements of `local` (rank `rank`'s shard) into their places in `global` (made in
/// host memory when its shape is not the global one). A replicated `local` is assigned as it
/// is, wherever it lives; a split one must be on the host, as `global`. Throws Error when local
/// has the wrong shape or is split and either is not on the host.
inline void unshard_into(const ShardedTensor& spec, const Tensor& local, int tp, int rank, Tensor& global) {
  DSP_CHECK(local.shape() == spec.local_shape(tp), spec.name, ": shard has shape ", shape_str(local.shape()),
            ", expected ", shape_str(spec.local_shape(tp)));
  if (global.shape() != spec.global_shape) global = Tensor::host_zeros(spec.global_shape);
  if (spec.kind == ShardKind::Replicated) {
    global = local;
    return;
  }
  const std::span<const float> in = local.span();
  const std::span<float> out = global.span();
  for_each_shard_row(spec, tp, rank, [&](std::int64_t l, std::int64_t g, std::int64_t n) {
    std::copy_n(in.begin() + l, n, out.begin() + g);
  });
}

/// Per-element 0/1 weights of a local shard: 1 where this rank owns the element (see
/// ShardedTensor::owned). Used so a global norm counts every element once.
inline std::vector<float> ownership_weights(const ShardedTensor& spec, int tp, int rank) {
  const auto own = spec.owned(tp, rank);
  const Shape ls = spec.local_shape(tp);
  const int dim = spec.kind == ShardKind::Replicated ? 0 : spec.split_dim;
  const auto [outer, ext, inner] = detail::around(ls, dim);
  std::vector<float> w(static_cast<std::size_t>(numel(ls)));
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t i = 0; i < ext; ++i)
      std::fill_n(w.begin() + (o * ext + i) * inner, inner, own[static_cast<std::size_t>(i)] ? 1.0f : 0.0f);
  return w;
}

}  // namespace dsp
