#pragma once
// Umbrella header: everything a trainer or server built from dsp needs. The types every user
// touches live in dsp:: directly (Policy, ParallelLayout, DeviceMesh, ShardedTensor).
#include "dsp/backend/host.hpp"
#include "dsp/checkpoint/merge.hpp"
#include "dsp/checkpoint/model_io.hpp"
#include "dsp/checkpoint/reshard.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/model/moe_layer.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/parallel/sharded_tensor.hpp"
#include "dsp/policy.hpp"
#include "dsp/serve/consistency.hpp"
#include "dsp/serve/engine.hpp"
#include "dsp/train/checkpointing.hpp"
#include "dsp/train/metrics.hpp"
#include "dsp/train/trainer.hpp"
