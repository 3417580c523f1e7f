#include "braid/engine/trainer.h"

#include <chrono>

#include "braid/core/stream.h"

namespace braid::engine {

Trainer::Trainer(model::GPTModel& model, AdamWConfig optimizer, LRSchedule schedule)
    : model_(model), optimizer_(model, optimizer), schedule_(schedule) {
  schedule_.validate();
}

StepStats Trainer::train_step(const Tensor& ids, const Tensor& targets, int num_microbatches) {
  BRAID_CONFIG_CHECK(ids.dim() == 2 && targets.shape() == ids.shape(),
                     "Trainer::train_step: ids and targets must both be [B, S], got ", ids.shape(),
                     " and ", targets.shape());
  BRAID_CONFIG_CHECK(num_microbatches > 0 && ids.size(0) % num_microbatches == 0,
                     "Trainer::train_step: batch size ", ids.size(0),
                     " is not divisible by num_microbatches = ", num_microbatches);
  const Device device = model_.device();
  synchronize(device);
  reset_peak_memory(device);
  const auto start = std::chrono::steady_clock::now();

  model_.zero_grad();
  const int64_t rows = ids.size(0) / num_microbatches;
  const float grad_scale = 1.0f / float(num_microbatches);
  double loss_sum = 0;
  for (int m = 0; m < num_microbatches; ++m) {
    loss_sum += model_.forward(ids.narrow(m * rows, rows), targets.narrow(m * rows, rows), m);
    model_.backward(m, grad_scale);
  }
  model_.finalize_grads();
  StepStats stats;
  stats.loss = float(loss_sum / num_microbatches);
  stats.lr = schedule_.lr_at(iteration_);
  stats.grad_norm = optimizer_.clip_and_step(stats.lr);
  ++iteration_;

  synchronize(device);
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats.tokens_per_second = stats.seconds > 0 ? double(ids.numel()) / stats.seconds : 0.0;
  stats.peak_memory_bytes = memory_stats(device).peak_bytes;
  return stats;
}

}  // namespace braid::engine
