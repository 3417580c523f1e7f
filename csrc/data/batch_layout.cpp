#include "braid/data/batch_layout.h"

#include <algorithm>

#include "braid/core/error.h"

namespace braid::data {

void BatchLayout::validate() const {
  BRAID_CONFIG_CHECK(micro_batch_size > 0, "micro_batch_size must be positive, got ",
                     micro_batch_size);
  BRAID_CONFIG_CHECK(dp_size > 0, "dp_size must be positive, got ", dp_size);
  BRAID_CONFIG_CHECK(0 <= dp_rank && dp_rank < dp_size, "dp_rank ", dp_rank,
                     " out of range for dp_size ", dp_size);
  BRAID_CONFIG_CHECK(global_batch_size > 0 && global_batch_size % (micro_batch_size * dp_size) == 0,
                     "global_batch_size (", global_batch_size,
                     ") must be a positive multiple of micro_batch_size x dp_size (",
                     micro_batch_size, " x ", dp_size, ")");
  if (!rampup) return;
  const BatchRampup& r = *rampup;
  BRAID_CONFIG_CHECK(r.start > 0 && r.increment > 0 && r.samples > 0,
                     "--rampup-batch-size: the start (", r.start, "), increment (", r.increment,
                     ") and samples (", r.samples, ") must be positive");
  BRAID_CONFIG_CHECK(
      r.start <= global_batch_size && (global_batch_size - r.start) % r.increment == 0,
      "--rampup-batch-size: the ramp from ", r.start, " by ", r.increment,
      " does not reach the global batch size ", global_batch_size);
  const int64_t group = micro_batch_size * dp_size;
  const bool ramps = r.start != global_batch_size;
  const char* bad = r.start % group != 0                ? "the start"
                    : ramps && r.increment % group != 0 ? "the increment"
                                                        : nullptr;
  BRAID_CONFIG_CHECK(bad == nullptr, "--rampup-batch-size: every batch of the ramp (", r.start,
                     ", ", r.start + r.increment,
                     ", ...) must be a multiple of micro_batch_size x "
                     "dp_size (",
                     micro_batch_size, " x ", dp_size, "); ", bad, " is not");
}

int64_t BatchLayout::global_batch_size_at(int64_t consumed_samples) const {
  if (!rampup || consumed_samples > rampup->samples || rampup->start == global_batch_size)
    return global_batch_size;
  const int64_t increments = (global_batch_size - rampup->start) / rampup->increment;
  const double samples_per_increment = double(rampup->samples) / double(increments);
  const auto steps = int64_t(double(consumed_samples) / samples_per_increment);
  return std::min(global_batch_size, rampup->start + steps * rampup->increment);
}

int64_t BatchLayout::samples_after(int64_t steps) const {
  int64_t consumed = 0;
  for (; steps > 0 && rampup && consumed <= rampup->samples; --steps)
    consumed += global_batch_size_at(consumed);
  return consumed + steps * global_batch_size;
}

int64_t BatchLayout::steps_between(int64_t consumed_samples, int64_t end) const {
  int64_t steps = 0, consumed = consumed_samples;
  // Through the ramp one step at a time, then whole global batches.
  while (rampup && consumed <= rampup->samples) {
    const int64_t batch = global_batch_size_at(consumed);
    if (consumed + batch > end) return steps;
    consumed += batch;
    ++steps;
  }
  return end > consumed ? steps + (end - consumed) / global_batch_size : steps;
}

}  // namespace braid::data
