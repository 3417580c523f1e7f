#include "braid/engine/lr_schedule.h"

#include <cmath>
#include <numbers>

#include "braid/core/error.h"

namespace braid::engine {

const char* to_string(LRDecayStyle style) {
  switch (style) {
    case LRDecayStyle::constant:
      return "constant";
    case LRDecayStyle::linear:
      return "linear";
    case LRDecayStyle::cosine:
      return "cosine";
  }
  return "?";
}

LRDecayStyle lr_decay_style_from_string(std::string_view name) {
  for (LRDecayStyle s : {LRDecayStyle::constant, LRDecayStyle::linear, LRDecayStyle::cosine})
    if (name == to_string(s)) return s;
  throw ConfigError(detail::concat("unknown lr decay style '", name,
                                   "' (expected one of: constant, linear, cosine)"),
                    __FILE__, __LINE__);
}

void LRSchedule::validate() const {
  BRAID_CONFIG_CHECK(std::isfinite(lr) && lr >= 0, "LRSchedule.lr must be >= 0, got ", lr);
  BRAID_CONFIG_CHECK(std::isfinite(min_lr) && min_lr >= 0 && min_lr <= lr,
                     "LRSchedule.min_lr must be in [0, lr = ", lr, "], got ", min_lr);
  BRAID_CONFIG_CHECK(std::isfinite(warmup_iters) && warmup_iters >= 0,
                     "LRSchedule.warmup_iters must be >= 0, got ", warmup_iters);
  BRAID_CONFIG_CHECK(std::isfinite(decay_iters), "LRSchedule.decay_iters must be finite, got ",
                     decay_iters);
  if (style != LRDecayStyle::constant) {
    BRAID_CONFIG_CHECK(decay_iters > warmup_iters, "LRSchedule.decay_iters (", decay_iters,
                       ") must exceed warmup_iters (", warmup_iters, ") for ", to_string(style),
                       " decay");
  }
}

float LRSchedule::lr_at(int64_t iteration) const {
  BRAID_CHECK(iteration >= 0, "LRSchedule::lr_at: negative iteration ", iteration);
  if (warmup_iters > 0 && double(iteration) <= warmup_iters)
    return float(double(lr) * double(iteration) / warmup_iters);
  if (style == LRDecayStyle::constant) return lr;
  if (double(iteration) > decay_iters) return min_lr;
  const double ratio = (double(iteration) - warmup_iters) / (decay_iters - warmup_iters);
  const double coeff =
      style == LRDecayStyle::linear ? 1.0 - ratio : 0.5 * (std::cos(std::numbers::pi * ratio) + 1);
  return float(double(min_lr) + coeff * (double(lr) - double(min_lr)));
}

}  // namespace braid::engine
