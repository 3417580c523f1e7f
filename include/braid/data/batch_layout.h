#pragma once
// Which samples a data-parallel rank reads: Megatron's MegatronPretrainingSampler.
//
// From `consumed_samples` on, the samples are cut into groups of micro_batch_size * dp_size;
// DP rank r's microbatch is slice r (micro_batch_size consecutive samples) of each group. A
// global batch is num_microbatches = global_batch_size / (micro_batch_size * dp_size) groups, so
// global batch g is samples [g * global_batch_size, (g + 1) * global_batch_size) whatever the
// DP size: resuming on another number of ranks reads the same samples per step. Ranks of one
// tensor-parallel group pass the same dp_rank and read the same batches.
//
// With a ramp (Megatron's --rampup-batch-size) a step's global batch is global_batch_size_at
// the samples consumed before it; the step still reads the next consecutive samples, so a
// ramped run reads the same samples in the same order as a constant one, in shorter steps.

#include <cstdint>
#include <optional>

namespace braid::data {

// --rampup-batch-size START INCREMENT SAMPLES, Megatron's RampupBatchsizeNumMicroBatches: the
// global batch starts at `start` and grows by `increment` each time another
// samples / ((global_batch_size - start) / increment) samples have been consumed; past `samples`
// consumed samples it is global_batch_size.
struct BatchRampup {
  int64_t start = 1;
  int64_t increment = 1;
  int64_t samples = 0;
};

struct BatchLayout {
  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 1;  // after the ramp, if there is one
  int64_t dp_rank = 0;
  int64_t dp_size = 1;
  std::optional<BatchRampup> rampup = std::nullopt;

  // ConfigError unless sizes are positive, 0 <= dp_rank < dp_size and micro_batch_size * dp_size
  // divides global_batch_size and, with a ramp, every batch of it: its start and increment
  // (--rampup-batch-size's rules, named so in the message).
  void validate() const;
  int64_t num_microbatches() const { return global_batch_size / (micro_batch_size * dp_size); }
  // This rank's rows in one step: num_microbatches * micro_batch_size.
  int64_t rows_per_step() const { return global_batch_size / dp_size; }
  // The global batch of the step that starts after `consumed_samples` (Megatron's arithmetic,
  // in doubles as there, so the steps change at the same sample counts).
  int64_t global_batch_size_at(int64_t consumed_samples) const;
  // The whole steps from `consumed_samples` that end at or before sample `end`; from 0 to
  // --train-samples that is Megatron's training iterations (update_train_iters), a partial
  // last step dropped.
  int64_t steps_between(int64_t consumed_samples, int64_t end) const;
  // The samples consumed after the first `steps` steps from sample 0.
  int64_t samples_after(int64_t steps) const;
  // The sample in row `row` of microbatch `microbatch` of the step that starts at
  // `consumed_samples`.
  int64_t sample(int64_t consumed_samples, int64_t microbatch, int64_t row) const {
    return consumed_samples + microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size +
           row;
  }
};

}  // namespace braid::data
