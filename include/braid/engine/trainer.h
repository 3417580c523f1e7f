#pragma once
// Trainer: one training step on one process - gradient accumulation over microbatches,
// global-norm clipping, AdamW with the learning-rate schedule, and the step's figures.

#include <cstdint>

#include "braid/core/tensor.h"
#include "braid/engine/adamw.h"
#include "braid/engine/lr_schedule.h"
#include "braid/model/gpt_model.h"

namespace braid::engine {

struct StepStats {
  float loss = 0;       // mean of the microbatches' mean losses
  float grad_norm = 0;  // global gradient norm before clipping
  float lr = 0;         // learning rate of this step
  double seconds = 0;
  double tokens_per_second = 0;
  int64_t peak_memory_bytes = 0;  // the device allocator's peak during the step
};

class Trainer {
 public:
  Trainer(model::GPTModel& model, AdamWConfig optimizer, LRSchedule schedule);

  // ids, targets [B, S] i32 (any device). Splits B into num_microbatches equal parts, runs
  // forward and backward on each with grad_scale 1/num_microbatches, then clips and steps
  // with lr = schedule.lr_at(iteration()).
  StepStats train_step(const Tensor& ids, const Tensor& targets, int num_microbatches = 1);

  int64_t iteration() const { return iteration_; }  // steps completed
  model::GPTModel& model() { return model_; }
  AdamW& optimizer() { return optimizer_; }
  const LRSchedule& schedule() const { return schedule_; }

 private:
  model::GPTModel& model_;
  AdamW optimizer_;
  LRSchedule schedule_;
  int64_t iteration_ = 0;
};

}  // namespace braid::engine
