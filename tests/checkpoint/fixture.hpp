#pragma once
// Shared pieces of the checkpoint tests: a self-removing temporary directory, a small fake
// model covering every ShardKind (with optimizer moments), and per-rank states cut from its
// global tensors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "dsp/checkpoint/manifest.hpp"
#include "dsp/checkpoint/state.hpp"
#include "dsp/core/tensor.hpp"
#include "dsp/parallel/sharded_tensor.hpp"
#include "../temp_dir.hpp"

namespace checkpoint_test {

namespace fs = std::filesystem;
using dsp::Shape;
using dsp::ShardedTensor;
using dsp::Tensor;
using dsp::checkpoint::ShardEntry;
using dsp::checkpoint::State;

using dsp::test::TempDir;

inline const std::string qkv_name = "model.layers.0.self_attn.qkv_proj.weight";
inline const std::string gate_up_name = "model.layers.0.mlp.gate_up_proj.weight";

/// hidden 6; vocab 65 (not divisible by 2 or 4); 4 query heads, 2 KV heads of dim 3 (at TP 4
/// each KV head is on two ranks); ffn 8; a row-parallel (dim 1) and a replicated tensor; Adam
/// moments of the two fused tensors, split like them.
inline std::vector<ShardedTensor> fake_specs() {
  const std::string attn = "model.layers.0.self_attn.", mlp = "model.layers.0.mlp.";
  std::vector<ShardedTensor> specs = {
      ShardedTensor::vocab("model.embed_tokens.weight", {65, 6}),
      ShardedTensor::qkv(qkv_name, 6, 4, 2, 3,
                         {attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"}),
      ShardedTensor::split(attn + "o_proj.weight", {6, 12}, 1),
      ShardedTensor::gate_up(gate_up_name, 6, 8, {mlp + "gate_proj.weight", mlp + "up_proj.weight"}),
      ShardedTensor::split(mlp + "down_proj.weight", {6, 8}, 1),
      ShardedTensor::replicated("model.norm.weight", {6}),
  };
  for (const std::string_view moment : {"exp_avg.", "exp_avg_sq."})
    for (const std::string& param : {qkv_name, gate_up_name}) {
      ShardedTensor s = *std::find_if(specs.begin(), specs.end(), [&](const auto& t) { return t.name == param; });
      s.name = "optimizer." + std::string(moment) + param;
      specs.push_back(s);
    }
  return specs;
}

/// Global tensors with distinct values: element i of spec k is 10000 k + i (exact in fp32).
inline std::map<std::string, Tensor> fake_globals(const std::vector<ShardedTensor>& specs) {
  std::map<std::string, Tensor> out;
  for (std::size_t k = 0; k < specs.size(); ++k) {
    Tensor t(specs[k].global_shape);
    for (std::int64_t i = 0; i < t.numel(); ++i)
      t[i] = static_cast<float>(10000 * k + static_cast<std::size_t>(i));
    out.emplace(specs[k].name, std::move(t));
  }
  return out;
}

/// One TP rank's tensors and the State pointing at them. Movable, not copyable (the State
/// points into `locals`).
struct RankState {
  std::vector<Tensor> locals;
  State state;
  RankState() = default;
  RankState(RankState&&) = default;
  RankState& operator=(RankState&&) = default;
};

/// Rank `rank` of `tp`: shard_of every global, or zeros of the local shape when globals is null.
inline RankState make_rank_state(const std::vector<ShardedTensor>& specs,
                                 const std::map<std::string, Tensor>* globals, int tp, int rank) {
  RankState r;
  r.locals.reserve(specs.size());
  for (const ShardedTensor& s : specs) {
    r.locals.push_back(globals ? dsp::shard_of(s, globals->at(s.name), tp, rank) : Tensor(s.local_shape(tp)));
    r.state.push_back({s, &r.locals.back()});
  }
  return r;
}

/// The states of all `tp` ranks, cut from globals.
inline std::vector<RankState> make_tp_states(const std::vector<ShardedTensor>& specs,
                                             const std::map<std::string, Tensor>& globals, int tp) {
  std::vector<RankState> out;
  for (int r = 0; r < tp; ++r) out.push_back(make_rank_state(specs, &globals, tp, r));
  return out;
}

inline std::vector<State> states_of(const std::vector<RankState>& ranks) {
  std::vector<State> out;
  for (const RankState& r : ranks) out.push_back(r.state);
  return out;
}

inline dsp::checkpoint::CheckpointMeta fake_meta(int tp, int dp = 1) {
  dsp::checkpoint::CheckpointMeta meta;
  meta.model_config = {{"model_type", "deepseek_v3"}, {"hidden_size", 6}, {"vocab_size", 65}};
  meta.layout = {.tensor = tp, .pipeline = 1, .data = dp, .expert = 1};
  meta.iteration = 1234;
  meta.extra = {{"lr_step", 1234}, {"rng", {{"seed", 7}}}, {"data_position", {{"dp0", 99}, {"dp1", 100}}}};
  return meta;
}

/// Exact equality of shape and every element.
inline bool same(const Tensor& a, const Tensor& b) { return a.shape() == b.shape() && a.values() == b.values(); }

/// The message of the E thrown by f; fails the test (and returns "") when f does not throw E.
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception");
  return "";
}

/// Flips every bit of the byte at `offset` from the end of the file.
inline void corrupt_byte(const fs::path& file, std::uintmax_t offset_from_end) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  const auto at = static_cast<std::streamoff>(fs::file_size(file) - offset_from_end);
  f.seekg(at);
  const char c = static_cast<char>(f.get());
  f.seekp(at);
  f.put(static_cast<char>(~c));
}

}  // namespace checkpoint_test
