#pragma once
// The learning-rate schedule of Megatron-LM (OptimizerParamScheduler.get_lr), in iterations:
//   iteration <= warmup_iters (warmup_iters > 0):  lr * iteration / warmup_iters
//   constant:                                      lr
//   iteration > decay_iters:                       min_lr
//   otherwise, r = (iteration - warmup_iters) / (decay_iters - warmup_iters):
//     linear:  min_lr + (lr - min_lr) * (1 - r)
//     cosine:  min_lr + (lr - min_lr) * 0.5 * (cos(pi * r) + 1)
// `iteration` counts the optimizer steps already taken, so step 0 uses lr_at(0) - which is
// 0 during warmup, exactly as in Megatron. warmup_iters and decay_iters may be fractional: a
// sample-based schedule (--lr-warmup-samples, --lr-decay-samples) over global batches that do
// not divide it is Megatron's samples / global batch, exactly.

#include <cstdint>
#include <string_view>

namespace braid::engine {

enum class LRDecayStyle { constant, linear, cosine };

// "constant", "linear", "cosine"; ConfigError on unknown names.
const char* to_string(LRDecayStyle style);
LRDecayStyle lr_decay_style_from_string(std::string_view name);

struct LRSchedule {
  float lr = 0.0f;  // peak (max) learning rate
  float min_lr = 0.0f;
  double warmup_iters = 0;
  double decay_iters = 0;  // linear and cosine: must exceed warmup_iters
  LRDecayStyle style = LRDecayStyle::cosine;

  void validate() const;  // ConfigError naming the field
  float lr_at(int64_t iteration) const;
};

}  // namespace braid::engine
