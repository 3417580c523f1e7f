#include "braid/engine/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "braid/core/error.h"

namespace braid::engine {

namespace {

template <typename Style, size_t N>
Style style_from_string(std::string_view name, const char* what, const Style (&all)[N]) {
  std::string valid;
  for (Style s : all) {
    if (name == to_string(s)) return s;
    valid += std::string(valid.empty() ? "" : ", ") + to_string(s);
  }
  throw ConfigError(
      detail::concat("unknown ", what, " '", name, "' (expected one of: ", valid, ")"), __FILE__,
      __LINE__);
}

}  // namespace

const char* to_string(LRDecayStyle style) {
  switch (style) {
    case LRDecayStyle::constant:
      return "constant";
    case LRDecayStyle::linear:
      return "linear";
    case LRDecayStyle::cosine:
      return "cosine";
    case LRDecayStyle::inverse_square_root:
      return "inverse-square-root";
    case LRDecayStyle::wsd:
      return "WSD";
  }
  return "?";
}

const char* to_string(WSDDecayStyle style) {
  switch (style) {
    case WSDDecayStyle::exponential:
      return "exponential";
    case WSDDecayStyle::linear:
      return "linear";
    case WSDDecayStyle::cosine:
      return "cosine";
    case WSDDecayStyle::minus_sqrt:
      return "minus_sqrt";
  }
  return "?";
}

const char* to_string(WDIncrStyle style) {
  return style == WDIncrStyle::linear ? "linear" : "cosine";
}

WDIncrStyle wd_incr_style_from_string(std::string_view name) {
  static constexpr WDIncrStyle kAll[] = {WDIncrStyle::linear, WDIncrStyle::cosine};
  return style_from_string(name, "weight decay increment style", kAll);
}

void WeightDecaySchedule::validate() const {
  BRAID_CONFIG_CHECK(std::isfinite(start) && start >= 0,
                     "WeightDecaySchedule.start must be >= 0, got ", start);
  BRAID_CONFIG_CHECK(std::isfinite(end) && end >= 0, "WeightDecaySchedule.end must be >= 0, got ",
                     end);
  BRAID_CONFIG_CHECK(std::isfinite(incr_iters) && incr_iters > 0,
                     "WeightDecaySchedule.incr_iters must be > 0, got ", incr_iters);
}

float WeightDecaySchedule::weight_decay_at(double iteration) const {
  BRAID_CHECK(iteration >= 0, "WeightDecaySchedule: negative iteration ", iteration);
  if (iteration > incr_iters) return end;
  const double r = iteration / incr_iters;
  const double coeff =
      style == WDIncrStyle::linear ? r : 0.5 * (std::cos(std::numbers::pi * (1.0 - r)) + 1.0);
  return float(double(start) + coeff * (double(end) - double(start)));
}

LRDecayStyle lr_decay_style_from_string(std::string_view name) {
  static constexpr LRDecayStyle kAll[] = {LRDecayStyle::constant, LRDecayStyle::linear,
                                          LRDecayStyle::cosine, LRDecayStyle::inverse_square_root,
                                          LRDecayStyle::wsd};
  return style_from_string(name, "lr decay style", kAll);
}

WSDDecayStyle wsd_decay_style_from_string(std::string_view name) {
  static constexpr WSDDecayStyle kAll[] = {WSDDecayStyle::exponential, WSDDecayStyle::linear,
                                           WSDDecayStyle::cosine, WSDDecayStyle::minus_sqrt};
  return style_from_string(name, "WSD decay style", kAll);
}

void LRSchedule::validate() const {
  BRAID_CONFIG_CHECK(std::isfinite(lr) && lr >= 0, "LRSchedule.lr must be >= 0, got ", lr);
  BRAID_CONFIG_CHECK(std::isfinite(min_lr) && min_lr >= 0 && min_lr <= lr,
                     "LRSchedule.min_lr must be in [0, lr = ", lr, "], got ", min_lr);
  BRAID_CONFIG_CHECK(std::isfinite(warmup_iters) && warmup_iters >= 0,
                     "LRSchedule.warmup_iters must be >= 0, got ", warmup_iters);
  BRAID_CONFIG_CHECK(std::isfinite(decay_iters), "LRSchedule.decay_iters must be finite, got ",
                     decay_iters);
  BRAID_CONFIG_CHECK(std::isfinite(iterations_per_sample) && iterations_per_sample > 0 &&
                         iterations_per_sample <= 1,
                     "LRSchedule.iterations_per_sample must be in (0, 1], got ",
                     iterations_per_sample);
  BRAID_CONFIG_CHECK(std::isfinite(warmup_init) && warmup_init >= 0 && warmup_init <= lr,
                     "LRSchedule.warmup_init must be in [0, lr = ", lr, "], got ", warmup_init);
  if (style != LRDecayStyle::constant) {
    BRAID_CONFIG_CHECK(decay_iters > warmup_iters, "LRSchedule.decay_iters (", decay_iters,
                       ") must exceed warmup_iters (", warmup_iters, ") for ", to_string(style),
                       " decay");
  }
  BRAID_CONFIG_CHECK(!decoupled_min_lr || decoupled_lr,
                     "LRSchedule.decoupled_min_lr needs decoupled_lr");
  if (decoupled_lr) {
    const float floor = decoupled_min_lr.value_or(min_lr);
    BRAID_CONFIG_CHECK(std::isfinite(*decoupled_lr) && *decoupled_lr >= 0,
                       "LRSchedule.decoupled_lr must be >= 0, got ", *decoupled_lr);
    BRAID_CONFIG_CHECK(std::isfinite(floor) && floor >= 0 && floor <= *decoupled_lr,
                       "LRSchedule's decoupled floor (decoupled_min_lr, else min_lr) must be in "
                       "[0, decoupled_lr = ",
                       *decoupled_lr, "], got ", floor);
  }
  if (style == LRDecayStyle::wsd) {
    BRAID_CONFIG_CHECK(
        std::isfinite(wsd_decay_iters) && wsd_decay_iters > 0 && wsd_decay_iters <= decay_iters,
        "LRSchedule.wsd_decay_iters must be in (0, decay_iters = ", decay_iters,
        "] for WSD decay, got ", wsd_decay_iters);
  }
}

float LRSchedule::decoupled_lr_at(double iteration) const {
  if (!decoupled_lr) return lr_at(iteration);
  return lr_between(iteration, *decoupled_lr, decoupled_min_lr.value_or(min_lr));
}

float LRSchedule::lr_between(double iteration, float peak, float floor) const {
  BRAID_CHECK(iteration >= 0, "LRSchedule: negative iteration ", iteration);
  const double it = iteration;
  if (warmup_iters > 0 && it <= warmup_iters)
    return float(double(warmup_init) + (double(peak) - warmup_init) * it / warmup_iters);
  if (style == LRDecayStyle::constant) return peak;
  if (it > decay_iters) return floor;
  if (style == LRDecayStyle::inverse_square_root) {
    const double one = iterations_per_sample;  // Megatron's max(steps, 1), steps in samples
    const double value = peak * std::sqrt(std::max(warmup_iters, one) / std::max(it, one));
    return float(std::max(double(floor), value));
  }
  const double ratio = (it - warmup_iters) / (decay_iters - warmup_iters);
  double coeff = 0;
  switch (style) {
    case LRDecayStyle::linear:
      coeff = 1.0 - ratio;
      break;
    case LRDecayStyle::cosine:
      coeff = 0.5 * (std::cos(std::numbers::pi * ratio) + 1);
      break;
    case LRDecayStyle::wsd: {
      const double anneal_start = decay_iters - wsd_decay_iters;
      if (it <= anneal_start) {
        coeff = 1.0;
        break;
      }
      const double q = (it - anneal_start) / wsd_decay_iters;
      switch (wsd_style) {
        case WSDDecayStyle::exponential:
          coeff = 2.0 * std::pow(0.5, q) - 1.0;
          break;
        case WSDDecayStyle::linear:
          coeff = 1.0 - q;
          break;
        case WSDDecayStyle::cosine:
          coeff = 0.5 * (std::cos(std::numbers::pi * q) + 1);
          break;
        case WSDDecayStyle::minus_sqrt:
          coeff = 1.0 - std::sqrt(q);
          break;
      }
      break;
    }
    case LRDecayStyle::constant:
    case LRDecayStyle::inverse_square_root:
      break;  // returned above
  }
  return float(double(floor) + coeff * (double(peak) - double(floor)));
}

}  // namespace braid::engine
