#pragma once
// The learning-rate schedule of Megatron-LM (OptimizerParamScheduler.get_lr), in iterations:
//   iteration <= warmup_iters (warmup_iters > 0):
//                      warmup_init + (lr - warmup_init) * iteration / warmup_iters
//   constant:                                      lr
//   iteration > decay_iters:                       min_lr
//   inverse-square-root: max(min_lr, lr * sqrt(max(warmup_iters, s) / max(iteration, s))), with
//              s = iterations_per_sample: Megatron counts samples and clamps both at one
//   otherwise min_lr + (lr - min_lr) * c, with r = (iteration - warmup_iters) /
//   (decay_iters - warmup_iters):
//     linear:  c = 1 - r
//     cosine:  c = 0.5 * (cos(pi * r) + 1)
//     WSD (warmup-stable-decay): c = 1 until the last wsd_decay_iters before decay_iters, then
//              with q the fraction of those done, by wsd_style: exponential 2 * 0.5^q - 1,
//              linear 1 - q, cosine 0.5 * (cos(pi * q) + 1), minus_sqrt 1 - sqrt(q)
// `iteration` counts the optimizer steps already taken, so step 0 uses lr_at(0) - which is
// 0 during warmup, exactly as in Megatron. It may be fractional: Megatron's schedule counts
// samples, so a step of a ramped-up batch (--rampup-batch-size) advances it by its share of a
// full one (Trainer). warmup_iters and decay_iters may be fractional: a
// sample-based schedule (--lr-warmup-samples, --lr-decay-samples) over global batches that do
// not divide it is Megatron's samples / global batch, exactly.
//
// Megatron's decoupled learning rate (--decoupled-lr, --decoupled-min-lr): the embedding's and
// the output layer's own peak and floor on the same warmup and decay (its
// is_embedding_or_output_parameter group; the warmup still starts from warmup_init).

#include <cstdint>
#include <optional>
#include <string_view>

namespace braid::engine {

enum class LRDecayStyle { constant, linear, cosine, inverse_square_root, wsd };
enum class WSDDecayStyle { exponential, linear, cosine, minus_sqrt };

// Megatron's names: "constant", "linear", "cosine", "inverse-square-root", "WSD"; and
// "exponential", "linear", "cosine", "minus_sqrt". ConfigError on unknown names.
const char* to_string(LRDecayStyle style);
LRDecayStyle lr_decay_style_from_string(std::string_view name);
const char* to_string(WSDDecayStyle style);
WSDDecayStyle wsd_decay_style_from_string(std::string_view name);

struct LRSchedule {
  float lr = 0.0f;  // peak (max) learning rate
  float min_lr = 0.0f;
  double warmup_iters = 0;
  double decay_iters = 0;  // all but constant: must exceed warmup_iters
  LRDecayStyle style = LRDecayStyle::cosine;
  float warmup_init = 0.0f;    // --lr-warmup-init: where the warmup starts
  double wsd_decay_iters = 0;  // WSD: the annealing's length, in (0, decay_iters - warmup_iters]
  WSDDecayStyle wsd_style = WSDDecayStyle::exponential;
  double iterations_per_sample = 1.0;  // 1 / global batch (inverse-square-root's clamp)
  // The embedding's and output layer's peak and floor; none: lr, and min_lr.
  std::optional<float> decoupled_lr, decoupled_min_lr;

  void validate() const;  // ConfigError naming the field
  float lr_at(double iteration) const { return lr_between(iteration, lr, min_lr); }
  // The embedding's and output layer's: lr_at's with the decoupled peak and floor (lr_at's own
  // without a decoupled_lr).
  float decoupled_lr_at(double iteration) const;

 private:
  float lr_between(double iteration, float peak, float floor) const;
};

// Megatron's weight-decay schedule (OptimizerParamScheduler.get_wd, --start-weight-decay,
// --end-weight-decay, --weight-decay-incr-style), in iterations like the learning rate's:
//   iteration > incr_iters: end;  otherwise, r = iteration / incr_iters:
//     linear: start + (end - start) * r;  cosine: start + (end - start) * 0.5 * (cos(pi (1 - r)) +
//     1)
enum class WDIncrStyle { linear, cosine };
const char* to_string(WDIncrStyle style);
WDIncrStyle wd_incr_style_from_string(std::string_view name);  // "linear", "cosine"

struct WeightDecaySchedule {
  float start = 0.0f;
  float end = 0.0f;
  double incr_iters = 0;  // > 0: the training iterations, in Megatron
  WDIncrStyle style = WDIncrStyle::linear;

  void validate() const;  // ConfigError naming the field
  float weight_decay_at(double iteration) const;
};

}  // namespace braid::engine
