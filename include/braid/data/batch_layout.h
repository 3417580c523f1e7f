#pragma once
// Which samples a data-parallel rank reads: Megatron's MegatronPretrainingSampler.
//
// From `consumed_samples` on, the samples are cut into groups of micro_batch_size * dp_size;
// DP rank r's microbatch is slice r (micro_batch_size consecutive samples) of each group. A
// global batch is num_microbatches = global_batch_size / (micro_batch_size * dp_size) groups, so
// global batch g is samples [g * global_batch_size, (g + 1) * global_batch_size) whatever the
// DP size: resuming on another number of ranks reads the same samples per step. Ranks of one
// tensor-parallel group pass the same dp_rank and read the same batches.

#include <cstdint>

namespace braid::data {

struct BatchLayout {
  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 1;
  int64_t dp_rank = 0;
  int64_t dp_size = 1;

  // ConfigError unless sizes are positive, 0 <= dp_rank < dp_size and micro_batch_size * dp_size
  // divides global_batch_size.
  void validate() const;
  int64_t num_microbatches() const { return global_batch_size / (micro_batch_size * dp_size); }
  // This rank's rows in one step: num_microbatches * micro_batch_size.
  int64_t rows_per_step() const { return global_batch_size / dp_size; }
  // The sample in row `row` of microbatch `microbatch` of the step that starts at
  // `consumed_samples`.
  int64_t sample(int64_t consumed_samples, int64_t microbatch, int64_t row) const {
    return consumed_samples + microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size +
           row;
  }
};

}  // namespace braid::data
