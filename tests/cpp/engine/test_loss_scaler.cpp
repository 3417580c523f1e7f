#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "braid/core/error.h"
#include "braid/engine/loss_scaler.h"

namespace braid::engine {
namespace {

LossScaleConfig dynamic_config(float initial, float min, int window, int hysteresis) {
  LossScaleConfig c;
  c.dynamic = true;
  c.initial_loss_scale = initial;
  c.min_loss_scale = min;
  c.loss_scale_window = window;
  c.hysteresis = hysteresis;
  return c;
}

void expect_state(const LossScaler& s, float scale, int growth, int hysteresis, int step) {
  const LossScaler::State st = s.state();
  EXPECT_EQ(s.scale(), scale) << "step " << step;
  EXPECT_EQ(st.scale, scale) << "step " << step;
  EXPECT_EQ(st.growth_tracker, growth) << "step " << step;
  EXPECT_EQ(st.hysteresis_tracker, hysteresis) << "step " << step;
}

// Expects ConfigError whose message names `field`.
template <typename F>
void expect_config_error(F&& f, const std::string& field) {
  try {
    f();
    ADD_FAILURE() << "expected ConfigError naming " << field;
  } catch (const ConfigError& e) {
    EXPECT_NE(e.message().find(field), std::string::npos) << e.message();
  }
}

TEST(LossScaler, DynamicStartsAtInitialScale) {
  LossScaler s(dynamic_config(65536.0f, 1.0f, 1000, 2));
  EXPECT_TRUE(s.dynamic());
  expect_state(s, 65536.0f, 0, 2, 0);
}

// window 3, hysteresis 2, initial 1024. Each row: the step's input and the state after it
// (scale, growth tracker, hysteresis tracker), worked out by hand from Megatron's rules.
TEST(LossScaler, DynamicScriptedSequence) {
  LossScaler s(dynamic_config(1024.0f, 1.0f, 3, 2));
  struct Step {
    bool non_finite;
    float scale;
    int growth, hysteresis;
  };
  const std::vector<Step> script = {
      {false, 1024, 1, 2},  // 1: finite, g 1
      {false, 1024, 2, 2},  // 2: finite, g 2
      {false, 2048, 0, 2},  // 3: g reaches window 3: scale 1024*2, g 0, h reset to 2
      {true, 2048, 0, 1},   // 4: non-finite, h 2->1 > 0: absorbed by hysteresis
      {true, 1024, 0, 0},   // 5: non-finite, h 1->0 <= 0: scale 2048*0.5
      {true, 512, 0, 0},    // 6: h not reset after backoff: shrinks again, 1024*0.5
      {false, 512, 1, 0},   // 7: finite, g 1; h stays 0 (only growth resets it)
      {true, 256, 0, 0},    // 8: non-finite, g 0, h still <= 0: 512*0.5
      {false, 256, 1, 0},   // 9
      {false, 256, 2, 0},   // 10
      {false, 512, 0, 2},   // 11: g reaches 3: 256*2, h reset to 2
      {true, 512, 0, 1},    // 12: h 2->1: absorbed
      {false, 512, 1, 1},   // 13: finite, g 1, h stays 1 (not consecutive-only)
      {true, 256, 0, 0},    // 14: h 1->0: the earlier non-finite step still counts: 512*0.5
      {false, 256, 1, 0},   // 15: the growth tracker restarted at step 14
  };
  for (size_t i = 0; i < script.size(); ++i) {
    const Step& st = script[i];
    EXPECT_EQ(s.update(st.non_finite), st.non_finite) << "step " << i + 1;
    expect_state(s, st.scale, st.growth, st.hysteresis, int(i + 1));
  }
}

TEST(LossScaler, DynamicBackoffStopsAtMinLossScale) {
  // min 3 is not a power-of-two fraction of 8: the floor is max(scale/2, min), not "stop
  // halving before going below".
  LossScaler s(dynamic_config(8.0f, 3.0f, 100, 1));
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 4.0f);  // 8*0.5
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 3.0f);  // max(2, 3)
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(s.update(true));
    EXPECT_EQ(s.scale(), 3.0f);  // max(1.5, 3)
  }
  // Growth from the floor is an ordinary doubling.
  LossScaler g(dynamic_config(8.0f, 3.0f, 2, 1));
  for (int i = 0; i < 4; ++i) g.update(true);
  EXPECT_EQ(g.scale(), 3.0f);
  g.update(false);
  g.update(false);
  EXPECT_EQ(g.scale(), 6.0f);
}

TEST(LossScaler, DynamicGrowthStaysFinite) {
  LossScaler s(dynamic_config(1024.0f, 1.0f, 1, 2));
  const float big = std::ldexp(1.0f, 127);  // largest power of two in float
  s.load_state({big, 0, 2});
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), big);
  EXPECT_TRUE(std::isfinite(s.scale()));
  s.load_state({big / 2, 0, 2});
  s.update(false);
  EXPECT_EQ(s.scale(), big);
}

TEST(LossScaler, ConstantNeverChanges) {
  LossScaleConfig c;
  c.loss_scale = 128.0f;
  c.loss_scale_window = 1;  // ignored without dynamic
  c.hysteresis = 1;
  LossScaler s(c);
  EXPECT_FALSE(s.dynamic());
  EXPECT_EQ(s.scale(), 128.0f);
  for (int i = 0; i < 5; ++i) {
    EXPECT_FALSE(s.update(false));
    EXPECT_EQ(s.scale(), 128.0f);
  }
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(s.update(true));
    EXPECT_EQ(s.scale(), 128.0f);
  }
  const LossScaler::State st = s.state();
  EXPECT_EQ(st.scale, 128.0f);
  EXPECT_EQ(st.growth_tracker, 0);
  EXPECT_EQ(st.hysteresis_tracker, 0);
  // The config decides a constant scale; a restored state does not change it.
  s.load_state({4.0f, 3, 1});
  EXPECT_EQ(s.scale(), 128.0f);
}

TEST(LossScaler, DisabledIsScaleOneAndSkipsNonFinite) {
  LossScaler s(LossScaleConfig{});
  EXPECT_FALSE(s.dynamic());
  EXPECT_EQ(s.scale(), 1.0f);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 1.0f);
  for (int i = 0; i < 3000; ++i) EXPECT_FALSE(s.update(false));  // beyond the default window
  EXPECT_EQ(s.scale(), 1.0f);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 1.0f);
}

TEST(LossScaler, ValidateNamesTheBadField) {
  EXPECT_NO_THROW(LossScaleConfig{}.validate());
  EXPECT_NO_THROW(dynamic_config(65536.0f, 1.0f, 1000, 2).validate());
  EXPECT_NO_THROW(dynamic_config(4.0f, 4.0f, 1, 1).validate());  // min == initial is allowed

  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float bad : {-1.0f, inf, nan}) {
    LossScaleConfig c;
    c.loss_scale = bad;
    expect_config_error([&] { c.validate(); }, "LossScaleConfig.loss_scale ");
    expect_config_error([&] { LossScaler{c}; }, "LossScaleConfig.loss_scale ");
  }
  {
    LossScaleConfig c = dynamic_config(1024.0f, 1.0f, 10, 2);
    c.loss_scale = 8.0f;
    expect_config_error([&] { c.validate(); }, "LossScaleConfig.loss_scale ");
  }
  for (float bad : {0.0f, -2.0f, inf, nan}) {
    LossScaleConfig c = dynamic_config(bad, 1.0f, 10, 2);
    c.min_loss_scale = 1e-30f;  // so only initial_loss_scale is wrong where it is finite
    expect_config_error([&] { c.validate(); }, "LossScaleConfig.initial_loss_scale ");
  }
  for (float bad : {0.0f, -1.0f, 2048.0f, inf, nan}) {
    const LossScaleConfig c = dynamic_config(1024.0f, bad, 10, 2);
    expect_config_error([&] { c.validate(); }, "LossScaleConfig.min_loss_scale ");
  }
  for (int bad : {0, -1}) {
    const LossScaleConfig c = dynamic_config(1024.0f, 1.0f, bad, 2);
    expect_config_error([&] { c.validate(); }, "LossScaleConfig.loss_scale_window ");
    expect_config_error([&] { LossScaler{c}; }, "LossScaleConfig.loss_scale_window ");
  }
  for (int bad : {0, -3}) {
    const LossScaleConfig c = dynamic_config(1024.0f, 1.0f, 10, bad);
    expect_config_error([&] { c.validate(); }, "LossScaleConfig.hysteresis ");
  }
  // The dynamic fields mean nothing without dynamic and are not checked then.
  {
    LossScaleConfig c;
    c.loss_scale = 16.0f;
    c.hysteresis = 0;
    c.loss_scale_window = 0;
    c.min_loss_scale = 0;
    EXPECT_NO_THROW(c.validate());
  }
}

TEST(LossScaler, StateRoundTrip) {
  const LossScaleConfig c = dynamic_config(1024.0f, 1.0f, 3, 2);
  LossScaler a(c);
  for (bool nf : {false, false, false, true, false}) a.update(nf);
  // 3 finite: 2048, h 2; non-finite: h 1, g 0; finite: g 1.
  expect_state(a, 2048.0f, 1, 1, 5);

  LossScaler b(c);
  b.load_state(a.state());
  expect_state(b, 2048.0f, 1, 1, 5);
  // Both continue identically; the restored trackers matter: b grows after 2 more finite
  // steps (not 3) and shrinks on the next non-finite step (not the second).
  const std::vector<bool> rest = {false, false, true, true, false, false, false, true};
  for (size_t i = 0; i < rest.size(); ++i) {
    EXPECT_EQ(a.update(rest[i]), b.update(rest[i]));
    const LossScaler::State sa = a.state(), sb = b.state();
    EXPECT_EQ(sa.scale, sb.scale) << i;
    EXPECT_EQ(sa.growth_tracker, sb.growth_tracker) << i;
    EXPECT_EQ(sa.hysteresis_tracker, sb.hysteresis_tracker) << i;
  }
  LossScaler fresh(c);
  fresh.update(false);
  fresh.update(false);
  EXPECT_EQ(fresh.scale(), 1024.0f);  // a fresh scaler has not grown yet after 2 finite steps
  LossScaler restored(c);
  restored.load_state({2048.0f, 1, 1});
  restored.update(false);
  restored.update(false);
  EXPECT_EQ(restored.scale(), 4096.0f);
  restored.update(true);
  EXPECT_EQ(restored.scale(), 4096.0f);  // h reset to 2 by the growth: absorbed
}

TEST(LossScaler, LoadStateRejectsBadState) {
  LossScaler s(dynamic_config(1024.0f, 1.0f, 3, 2));
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float bad : {0.0f, -1.0f, inf, nan})
    expect_config_error([&] { s.load_state({bad, 0, 2}); }, "load_state: scale ");
  expect_config_error([&] { s.load_state({8.0f, -1, 2}); }, "load_state: growth_tracker ");
  expect_config_error([&] { s.load_state({8.0f, 0, -1}); }, "load_state: hysteresis_tracker ");
  expect_state(s, 1024.0f, 0, 2, 0);  // a rejected state leaves the scaler as it was
  LossScaler constant(LossScaleConfig{});
  expect_config_error([&] { constant.load_state({nan, 0, 0}); }, "load_state: scale ");
}

}  // namespace
}  // namespace braid::engine
