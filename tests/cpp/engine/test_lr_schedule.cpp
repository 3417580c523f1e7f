#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <string>

#include "braid/core/error.h"
#include "braid/engine/lr_schedule.h"

namespace braid::engine {
namespace {

LRSchedule schedule(LRDecayStyle style) {
  LRSchedule s;
  s.lr = 6e-4f;
  s.min_lr = 6e-5f;
  s.warmup_iters = 10;
  s.decay_iters = 110;
  s.style = style;
  return s;
}

TEST(LRSchedule, LinearWarmupFromZero) {
  for (LRDecayStyle style : {LRDecayStyle::constant, LRDecayStyle::linear, LRDecayStyle::cosine}) {
    const LRSchedule s = schedule(style);
    EXPECT_EQ(s.lr_at(0), 0.0f);
    for (int64_t i = 1; i <= 10; ++i)
      EXPECT_FLOAT_EQ(s.lr_at(i), 6e-4f * float(i) / 10.0f) << to_string(style) << " " << i;
  }
}

TEST(LRSchedule, CosineDecayToMinLr) {
  const LRSchedule s = schedule(LRDecayStyle::cosine);
  for (int64_t i = 11; i <= 110; ++i) {
    const double r = double(i - 10) / 100.0;
    const double want = 6e-5 + (6e-4 - 6e-5) * 0.5 * (std::cos(std::numbers::pi * r) + 1.0);
    EXPECT_NEAR(s.lr_at(i), want, 1e-7 * 6e-4) << i;
  }
  EXPECT_NEAR(s.lr_at(60), 0.5 * (6e-4 + 6e-5), 1e-9);  // half way
  EXPECT_FLOAT_EQ(s.lr_at(110), 6e-5f);
  EXPECT_EQ(s.lr_at(111), 6e-5f);
  EXPECT_EQ(s.lr_at(100000), 6e-5f);
}

// Megatron's sample-based schedule (--lr-warmup-samples 183105 --lr-decay-samples 126953125,
// GPT-3's, over global batches of 1536): its scheduler counts samples, so at iteration i it is
// at i * 1536 samples. Fractional warmup/decay iterations give the same learning rates.
TEST(LRSchedule, SampleBasedScheduleAsFractionalIterations) {
  const double batch = 1536, warmup_samples = 183105, decay_samples = 126953125;
  LRSchedule s;
  s.lr = 6e-5f;
  s.min_lr = 6e-6f;
  s.warmup_iters = warmup_samples / batch;  // 119.2...
  s.decay_iters = decay_samples / batch;
  s.validate();
  for (int64_t i : {int64_t(1), int64_t(119), int64_t(120), int64_t(121), int64_t(50000),
                    int64_t(82652), int64_t(82653), int64_t(90000)}) {
    const double samples = double(i) * batch;
    double want;
    if (samples <= warmup_samples) {
      want = 6e-5 * samples / warmup_samples;
    } else if (samples > decay_samples) {
      want = 6e-6;
    } else {
      const double r = (samples - warmup_samples) / (decay_samples - warmup_samples);
      want = 6e-6 + (6e-5 - 6e-6) * 0.5 * (std::cos(std::numbers::pi * r) + 1.0);
    }
    EXPECT_NEAR(s.lr_at(i), want, 1e-6 * 6e-5) << "iteration " << i;
  }
}

TEST(LRSchedule, LinearDecayToMinLr) {
  const LRSchedule s = schedule(LRDecayStyle::linear);
  for (int64_t i = 11; i <= 110; ++i) {
    const double want = 6e-5 + (6e-4 - 6e-5) * (1.0 - double(i - 10) / 100.0);
    EXPECT_NEAR(s.lr_at(i), want, 1e-7 * 6e-4) << i;
  }
  EXPECT_EQ(s.lr_at(500), 6e-5f);
}

TEST(LRSchedule, ConstantAfterWarmup) {
  const LRSchedule s = schedule(LRDecayStyle::constant);
  for (int64_t i : {11, 110, 111, 100000}) EXPECT_EQ(s.lr_at(i), 6e-4f) << i;
  LRSchedule no_warmup = s;
  no_warmup.warmup_iters = 0;
  EXPECT_EQ(no_warmup.lr_at(0), 6e-4f);
}

TEST(LRSchedule, InvalidFieldsAreNamed) {
  auto expect_rejected = [](LRSchedule s, const std::string& field) {
    try {
      s.validate();
      ADD_FAILURE() << "accepted a bad " << field;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  LRSchedule s = schedule(LRDecayStyle::cosine);
  EXPECT_NO_THROW(s.validate());
  s.lr = -1;
  expect_rejected(s, "lr");
  s = schedule(LRDecayStyle::cosine);
  s.min_lr = 1e-3f;  // above lr
  expect_rejected(s, "min_lr");
  s = schedule(LRDecayStyle::linear);
  s.decay_iters = 10;  // not beyond warmup
  expect_rejected(s, "decay_iters");
  s = schedule(LRDecayStyle::cosine);
  s.warmup_iters = -1;
  expect_rejected(s, "warmup_iters");
  s = schedule(LRDecayStyle::constant);
  s.decay_iters = 0;  // irrelevant for a constant schedule
  EXPECT_NO_THROW(s.validate());
  s = schedule(LRDecayStyle::wsd);
  expect_rejected(s, "wsd_decay_iters");  // WSD needs its annealing length
  s.wsd_decay_iters = 111;                // longer than decay_iters
  expect_rejected(s, "wsd_decay_iters");
  s = schedule(LRDecayStyle::cosine);
  s.warmup_init = 1e-3f;  // above lr
  expect_rejected(s, "warmup_init");
}

// Megatron's --decoupled-lr / --decoupled-min-lr: the embedding's and output layer's own peak
// and floor on the same warmup (from warmup_init) and decay; without decoupled_min_lr the floor
// is min_lr, without decoupled_lr the rate is lr_at's.
TEST(LRSchedule, DecoupledPeakAndFloorOnTheSameShape) {
  for (LRDecayStyle style : {LRDecayStyle::linear, LRDecayStyle::cosine,
                             LRDecayStyle::inverse_square_root, LRDecayStyle::constant}) {
    LRSchedule s = schedule(style);
    for (double i : {0.0, 3.0, 10.0, 25.5, 60.0, 110.0, 200.0})
      EXPECT_EQ(s.decoupled_lr_at(i), s.lr_at(i)) << to_string(style) << " " << i;
    s.warmup_init = 1e-5f;
    s.decoupled_lr = 2e-3f;
    s.decoupled_min_lr = 1e-4f;
    LRSchedule same = s;  // the decoupled group is the main schedule with its peak and floor
    same.lr = 2e-3f;
    same.min_lr = 1e-4f;
    for (double i : {0.0, 3.0, 10.0, 25.5, 60.0, 110.0, 200.0})
      EXPECT_EQ(s.decoupled_lr_at(i), same.lr_at(i)) << to_string(style) << " " << i;
    EXPECT_FLOAT_EQ(s.decoupled_lr_at(5), 1e-5f + (2e-3f - 1e-5f) * 0.5f);
    s.decoupled_min_lr.reset();
    same.min_lr = 6e-5f;
    EXPECT_EQ(s.decoupled_lr_at(200), style == LRDecayStyle::constant ? 2e-3f : 6e-5f);
    EXPECT_EQ(s.decoupled_lr_at(60), same.lr_at(60)) << to_string(style);
  }
}

TEST(LRSchedule, DecoupledFieldsAreChecked) {
  LRSchedule s = schedule(LRDecayStyle::cosine);
  s.decoupled_min_lr = 1e-4f;  // without decoupled_lr
  EXPECT_THROW(s.validate(), ConfigError);
  s.decoupled_lr = 5e-5f;  // below its floor
  EXPECT_THROW(s.validate(), ConfigError);
  s.decoupled_min_lr.reset();  // the floor is then min_lr = 6e-5
  EXPECT_THROW(s.validate(), ConfigError);
  s.decoupled_lr = 1e-3f;  // above lr is allowed (Megatron's usual use)
  EXPECT_NO_THROW(s.validate());
}

// Megatron's --lr-warmup-init: the warmup starts there instead of 0.
TEST(LRSchedule, WarmupFromInit) {
  LRSchedule s = schedule(LRDecayStyle::cosine);
  s.warmup_init = 1e-4f;
  EXPECT_FLOAT_EQ(s.lr_at(0), 1e-4f);
  EXPECT_FLOAT_EQ(s.lr_at(5), 1e-4f + (6e-4f - 1e-4f) * 0.5f);
  EXPECT_FLOAT_EQ(s.lr_at(10), 6e-4f);
}

// Megatron's inverse-square-root: lr * sqrt(warmup / iteration) after the warmup, never below
// min_lr, min_lr past decay_iters.
TEST(LRSchedule, InverseSquareRoot) {
  const LRSchedule s = schedule(LRDecayStyle::inverse_square_root);
  for (int64_t i : {11, 40, 90})
    EXPECT_NEAR(s.lr_at(i), 6e-4 * std::sqrt(10.0 / double(i)), 1e-7 * 6e-4) << i;
  LRSchedule floor = s;
  floor.min_lr = 3e-4f;
  EXPECT_FLOAT_EQ(floor.lr_at(90), 3e-4f);  // 6e-4 * sqrt(1/9) = 2e-4 is below it
  EXPECT_EQ(s.lr_at(111), 6e-5f);
  // No warmup: Megatron clamps at one *sample* (it counts samples), not one iteration - with
  // global batches of 256, iteration 4 is 1024 samples: lr / 32.
  LRSchedule no_warmup = s;
  no_warmup.warmup_iters = 0;
  no_warmup.iterations_per_sample = 1.0 / 256;
  no_warmup.min_lr = 0;
  EXPECT_FLOAT_EQ(no_warmup.lr_at(4), 6e-4f / 32);
}

// WSD: the peak until the last wsd_decay_iters before decay_iters, then each annealing shape
// (Megatron's coefficients) down to min_lr.
TEST(LRSchedule, WarmupStableDecay) {
  LRSchedule s = schedule(LRDecayStyle::wsd);
  s.wsd_decay_iters = 20;  // annealing over iterations 90..110
  const double lr = 6e-4, min_lr = 6e-5;
  for (WSDDecayStyle style : {WSDDecayStyle::exponential, WSDDecayStyle::linear,
                              WSDDecayStyle::cosine, WSDDecayStyle::minus_sqrt}) {
    SCOPED_TRACE(to_string(style));
    s.wsd_style = style;
    s.validate();
    for (int64_t i : {11, 50, 90}) EXPECT_FLOAT_EQ(s.lr_at(i), 6e-4f) << i;  // stable
    for (int64_t i = 91; i <= 110; ++i) {
      const double q = double(i - 90) / 20.0;
      double c = 0;
      if (style == WSDDecayStyle::exponential) c = 2.0 * std::pow(0.5, q) - 1.0;
      if (style == WSDDecayStyle::linear) c = 1.0 - q;
      if (style == WSDDecayStyle::cosine) c = 0.5 * (std::cos(std::numbers::pi * q) + 1.0);
      if (style == WSDDecayStyle::minus_sqrt) c = 1.0 - std::sqrt(q);
      EXPECT_NEAR(s.lr_at(i), min_lr + c * (lr - min_lr), 1e-7 * lr) << i;
    }
    EXPECT_NEAR(s.lr_at(110), 6e-5, 1e-9);
    EXPECT_EQ(s.lr_at(111), 6e-5f);
  }
  // An annealing longer than the decay after the warmup is Megatron's too: it starts when the
  // warmup ends, part way down (iteration 11 of an annealing over 10..110).
  s.wsd_decay_iters = 100;
  s.wsd_style = WSDDecayStyle::linear;
  s.validate();
  EXPECT_NEAR(s.lr_at(11), 6e-5 + (1.0 - 1.0 / 100) * (6e-4 - 6e-5), 1e-7 * 6e-4);
}

// Megatron's get_wd: start to end over incr_iters, linear or cosine, then end.
TEST(WeightDecaySchedule, LinearAndCosineThenEnd) {
  WeightDecaySchedule s{0.0f, 0.1f, 20, WDIncrStyle::linear};
  s.validate();
  for (int64_t i : {0, 5, 10, 20}) EXPECT_FLOAT_EQ(s.weight_decay_at(i), 0.1f * float(i) / 20);
  EXPECT_EQ(s.weight_decay_at(21), 0.1f);
  s.style = WDIncrStyle::cosine;
  for (int64_t i : {0, 5, 10, 15, 20}) {
    const double r = double(i) / 20;
    EXPECT_NEAR(s.weight_decay_at(i), 0.1 * 0.5 * (std::cos(std::numbers::pi * (1 - r)) + 1), 1e-8)
        << i;
  }
  EXPECT_EQ(wd_incr_style_from_string("cosine"), WDIncrStyle::cosine);
  EXPECT_THROW(wd_incr_style_from_string("constant"), ConfigError);  // no schedule instead
  s.incr_iters = 0;
  EXPECT_THROW(s.validate(), ConfigError);
}

TEST(LRSchedule, StyleNames) {
  for (LRDecayStyle style : {LRDecayStyle::constant, LRDecayStyle::linear, LRDecayStyle::cosine,
                             LRDecayStyle::inverse_square_root, LRDecayStyle::wsd})
    EXPECT_EQ(lr_decay_style_from_string(to_string(style)), style);
  for (WSDDecayStyle style : {WSDDecayStyle::exponential, WSDDecayStyle::linear,
                              WSDDecayStyle::cosine, WSDDecayStyle::minus_sqrt})
    EXPECT_EQ(wsd_decay_style_from_string(to_string(style)), style);
  EXPECT_EQ(to_string(lr_decay_style_from_string("inverse-square-root")),
            std::string("inverse-square-root"));
  EXPECT_THROW(lr_decay_style_from_string("wsd"), ConfigError);  // Megatron spells it WSD
  EXPECT_THROW(wsd_decay_style_from_string("sqrt"), ConfigError);
}

}  // namespace
}  // namespace braid::engine
