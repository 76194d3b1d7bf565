#pragma once
// DeviceMesh: a world communicator cut into the sub-groups of a ParallelLayout.
#include "dsp/comm/communicator.hpp"
#include "dsp/parallel/layout.hpp"

namespace dsp {

/// The sub-communicators a rank uses, built collectively from the world communicator:
/// - tensor group: the TP ranks of one (dp, pp) (adjacent global ranks, stay in a node);
/// - data group:   the DP replicas of one (tp, pp);
/// - pipeline group: the stages of one (tp, dp);
/// - model group:  all TP x PP ranks of one DP replica;
/// - expert group: the expert-model-parallel ranks of one (tp, pp): EP consecutive DP ranks
///   (expert rank = dp % EP), which split the routed experts and exchange tokens;
/// - expert-data group: the DP ranks of one (tp, pp) holding the same experts (dp % EP equal),
///   over which expert gradients reduce (Megatron's expert-data-parallel group).
/// Must be constructed by every rank of `world`. Throws ConfigError when the layout does not
/// fit the world size.
template <comm::Communicator Comm>
class DeviceMesh {
 public:
  DeviceMesh(Comm& world, ParallelLayout layout)
      : layout_(layout.resolved(world.size())),
        global_rank_(world.rank()),
        coord_(RankCoord::of(world.rank(), layout_)),
        tensor_(world.split(coord_.dp + layout_.data * coord_.pp, coord_.tp)),
        data_(world.split(coord_.tp + layout_.tensor * coord_.pp, coord_.dp)),
        pipeline_(world.split(coord_.tp + layout_.tensor * coord_.dp, coord_.pp)),
        model_(world.split(coord_.dp, coord_.tp + layout_.tensor * coord_.pp)),
        expert_(world.split(coord_.tp + layout_.tensor * (coord_.pp + layout_.pipeline * (coord_.dp / layout_.expert)),
                            coord_.dp % layout_.expert)),
        expert_data_(world.split(
            coord_.tp + layout_.tensor * (coord_.pp + layout_.pipeline * (coord_.dp % layout_.expert)),
            coord_.dp / layout_.expert)) {}

  const ParallelLayout& layout() const { return layout_; }
  int global_rank() const { return global_rank_; }
  const RankCoord& coord() const { return coord_; }
  int tp_rank() const { return coord_.tp; }
  int tp_size() const { return layout_.tensor; }
  int dp_rank() const { return coord_.dp; }
  int dp_size() const { return layout_.data; }
  int pp_rank() const { return coord_.pp; }
  int pp_size() const { return layout_.pipeline; }
  int ep_rank() const { return coord_.dp % layout_.expert; }
  int ep_size() const { return layout_.expert; }

  Comm& tensor_group() { return tensor_; }
  Comm& data_group() { return data_; }
  Comm& pipeline_group() { return pipeline_; }
  Comm& model_group() { return model_; }
  Comm& expert_group() { return expert_; }
  Comm& expert_data_group() { return expert_data_; }

 private:
  ParallelLayout layout_;
  int global_rank_;
  RankCoord coord_;
  Comm tensor_, data_, pipeline_, model_, expert_, expert_data_;
};

}  // namespace dsp
