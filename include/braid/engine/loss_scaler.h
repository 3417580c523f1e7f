#pragma once
// The gradient loss scalers of Megatron-LM (megatron/core/optimizer/grad_scaler.py) for
// mixed-precision training. The loss gradient is multiplied by scale() before backward; the
// optimizer unscales, checks the gradients for inf/NaN, and calls update() once per step.
//
//   disabled (loss_scale 0, dynamic false): scale 1, never changes (bf16 / f32 training)
//   constant (loss_scale > 0):              Megatron --loss-scale, ConstantGradScaler
//   dynamic  (dynamic true):                Megatron --fp16 alone, DynamicGradScaler
//
// Every mode skips a step whose gradients are non-finite.

namespace braid::engine {

struct LossScaleConfig {
  // 0: no loss scaling (scale 1, never changes; bf16/f32 training: a non-finite step is skipped).
  // > 0 with dynamic=false: a constant scale (Megatron --loss-scale).
  float loss_scale = 0;
  bool dynamic = false;                      // Megatron --fp16 without --loss-scale
  float initial_loss_scale = 4294967296.0f;  // --initial-loss-scale (2^32)
  float min_loss_scale = 1.0f;               // --min-loss-scale
  int loss_scale_window = 1000;  // --loss-scale-window: finite steps before the scale grows
  int hysteresis = 2;            // --hysteresis: non-finite steps tolerated before it shrinks

  // ConfigError naming the field and the rule. The dynamic fields (initial_loss_scale onwards)
  // are checked only when dynamic is set, as Megatron only reads them then; dynamic with a
  // loss_scale > 0 is rejected as contradictory.
  void validate() const;
};

class LossScaler {
 public:
  explicit LossScaler(const LossScaleConfig& config);  // validates

  // What the loss gradient is multiplied by this step.
  float scale() const { return scale_; }

  // Called once per step with whether any gradient was non-finite; returns true when the step
  // must be skipped (found_non_finite). A dynamic scaler then updates as Megatron's
  // DynamicGradScaler does:
  //   non-finite: growth tracker = 0, hysteresis tracker -= 1, and when it is <= 0
  //               scale = max(scale * 0.5, min_loss_scale);
  //   finite:     growth tracker += 1, and when it reaches loss_scale_window
  //               scale *= 2, growth tracker = 0, hysteresis tracker = hysteresis.
  // Only growth resets the hysteresis tracker: after one backoff every further non-finite step
  // backs off again until the scale grows, and finite steps in between do not restore it.
  // Two deliberate, behaviour-preserving departures keep state() loadable by load_state():
  // the hysteresis tracker stops at 0 (Megatron lets it go negative; both shrink whenever it
  // is <= 0), and the scale never grows past the largest finite float.
  // Constant and disabled scalers never change the scale.
  bool update(bool found_non_finite);

  bool dynamic() const { return config_.dynamic; }

  // State for checkpoints: the scale and both trackers, and a way to restore them.
  struct State {
    float scale;
    int growth_tracker;
    int hysteresis_tracker;
  };
  // Constant and disabled scalers report {scale(), 0, 0}.
  State state() const;
  // ConfigError on a non-positive/non-finite scale or negative trackers. Constant and disabled
  // scalers check the state and otherwise ignore it - their scale comes from the config, as
  // in Megatron's ConstantGradScaler.
  void load_state(const State& s);

 private:
  LossScaleConfig config_;
  float scale_;
  int growth_tracker_ = 0;
  int hysteresis_tracker_ = 0;
};

}  // namespace braid::engine
