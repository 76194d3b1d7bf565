#pragma once
// The training settings the layout-comparison tests share with the small model.
#include <cstdint>

#include "dsp/train/trainer.hpp"

namespace dsp::test {

/// Micro-batches of 2 sequences, `global_batch` per step, lr 3e-3 after 2 warm-up steps of a
/// `steps`-step schedule, 4000-byte gradient buckets (several per stage of the small model).
inline train::TrainConfig small_train_config(std::int64_t global_batch, int steps) {
  train::TrainConfig tc;
  tc.micro_batch_size = 2;
  tc.global_batch_size = global_batch;
  tc.train_iters = steps;
  tc.lr = 3e-3f;
  tc.lr_warmup_iters = 2;
  tc.ddp.bucket_size_bytes = 4000;
  return tc;
}

}  // namespace dsp::test
