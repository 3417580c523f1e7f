#include "braid/engine/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "braid/core/error.h"

namespace braid::engine {

void LossScaleConfig::validate() const {
  BRAID_CONFIG_CHECK(std::isfinite(loss_scale) && loss_scale >= 0,
                     "LossScaleConfig.loss_scale must be finite and >= 0 (0: no constant scale), "
                     "got ",
                     loss_scale);
  if (!dynamic) return;
  BRAID_CONFIG_CHECK(loss_scale == 0,
                     "LossScaleConfig.loss_scale must be 0 when dynamic is set (a constant scale "
                     "and a dynamic one exclude each other), got ",
                     loss_scale);
  BRAID_CONFIG_CHECK(std::isfinite(initial_loss_scale) && initial_loss_scale > 0,
                     "LossScaleConfig.initial_loss_scale must be finite and > 0, got ",
                     initial_loss_scale);
  BRAID_CONFIG_CHECK(
      std::isfinite(min_loss_scale) && min_loss_scale > 0 && min_loss_scale <= initial_loss_scale,
      "LossScaleConfig.min_loss_scale must be in (0, initial_loss_scale = ", initial_loss_scale,
      "], got ", min_loss_scale);
  BRAID_CONFIG_CHECK(loss_scale_window > 0, "LossScaleConfig.loss_scale_window must be > 0, got ",
                     loss_scale_window);
  BRAID_CONFIG_CHECK(hysteresis > 0, "LossScaleConfig.hysteresis must be > 0, got ", hysteresis);
}

LossScaler::LossScaler(const LossScaleConfig& config) : config_(config) {
  config_.validate();
  if (config_.dynamic) {
    scale_ = config_.initial_loss_scale;
    hysteresis_tracker_ = config_.hysteresis;
  } else {
    scale_ = config_.loss_scale > 0 ? config_.loss_scale : 1.0f;
  }
}

bool LossScaler::update(bool found_non_finite) {
  if (!config_.dynamic) return found_non_finite;
  if (found_non_finite) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = std::max(hysteresis_tracker_ - 1, 0);
    if (hysteresis_tracker_ <= 0) scale_ = std::max(scale_ * 0.5f, config_.min_loss_scale);
  } else {
    // >= rather than Megatron's ==: the same for any reachable state, and a restored tracker
    // beyond a smaller window still lets the scale grow.
    if (++growth_tracker_ >= config_.loss_scale_window) {
      growth_tracker_ = 0;
      hysteresis_tracker_ = config_.hysteresis;
      if (scale_ <= std::numeric_limits<float>::max() / 2) scale_ *= 2.0f;
    }
  }
  return found_non_finite;
}

LossScaler::State LossScaler::state() const {
  return State{scale_, growth_tracker_, hysteresis_tracker_};
}

void LossScaler::load_state(const State& s) {
  BRAID_CONFIG_CHECK(std::isfinite(s.scale) && s.scale > 0,
                     "LossScaler::load_state: scale must be finite and > 0, got ", s.scale);
  BRAID_CONFIG_CHECK(s.growth_tracker >= 0,
                     "LossScaler::load_state: growth_tracker must be >= 0, got ", s.growth_tracker);
  BRAID_CONFIG_CHECK(s.hysteresis_tracker >= 0,
                     "LossScaler::load_state: hysteresis_tracker must be >= 0, got ",
                     s.hysteresis_tracker);
  if (!config_.dynamic) return;
  scale_ = s.scale;
  growth_tracker_ = s.growth_tracker;
  hysteresis_tracker_ = s.hysteresis_tracker;
}

}  // namespace braid::engine
