#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "braid/engine/trainer.h"
#include "model/model_test_util.h"

namespace braid::engine {
namespace {

using model::GPTModel;
using model::TransformerConfig;
using namespace model::testing_util;

LRSchedule warmup_cosine(float lr, int64_t warmup, int64_t decay) {
  LRSchedule s;
  s.lr = lr;
  s.min_lr = lr / 10;
  s.warmup_iters = warmup;
  s.decay_iters = decay;
  s.style = LRDecayStyle::cosine;
  return s;
}

void check_loss_falls(const std::string& preset) {
  const TransformerConfig c = TransformerConfig::preset(preset);
  GPTModel model(c, testing::default_test_device(), 17);
  AdamWConfig opt;
  opt.weight_decay = 0.01f;
  const LRSchedule schedule = warmup_cosine(1e-2f, 5, 60);
  Trainer trainer(model, opt, schedule);
  const Batch batch = make_batch(4, 32, c.vocab_size, 23);
  StepStats first, last;
  for (int i = 0; i < 60; ++i) {
    const StepStats s = trainer.train_step(batch.ids, batch.targets, 2);
    if (i == 0) first = s;
    last = s;
    ASSERT_TRUE(std::isfinite(s.loss) && std::isfinite(s.grad_norm)) << "step " << i;
    EXPECT_EQ(s.lr, schedule.lr_at(i));
    EXPECT_GT(s.peak_memory_bytes, 0);
    EXPECT_GT(s.tokens_per_second, 0);
    EXPECT_GT(s.seconds, 0);
  }
  EXPECT_EQ(trainer.iteration(), 60);
  EXPECT_EQ(trainer.optimizer().step(), 60);
  EXPECT_NEAR(first.loss, std::log(double(c.vocab_size)), 0.1);  // ~uniform at init
  EXPECT_LT(last.loss, 0.25 * first.loss) << preset << ": " << first.loss << " -> " << last.loss;
}

TEST(Trainer, Gpt2LossFallsOnARepeatedBatch) { check_loss_falls("gpt2-tiny"); }

TEST(Trainer, LlamaLossFallsOnARepeatedBatch) { check_loss_falls("llama-tiny"); }

// A traced trainer (on the test device: on CUDA every span synchronizes it) trains exactly
// like an untraced one and records each step: its forwards and backwards, the optimizer, and,
// in one process, no communication - the whole step is compute.
TEST(Trainer, TracedStepsTrainAlikeAndAreAllCompute) {
  const TransformerConfig c = small_llama();
  const Device d = testing::default_test_device();
  const Batch batch = make_batch(4, 8, c.vocab_size, 4);
  GPTModel a(c, d, 6), b(c, d, 6);
  LRSchedule constant;
  constant.style = LRDecayStyle::constant;
  Trainer plain(a, AdamWConfig{}, constant), traced(b, AdamWConfig{}, constant);
  Trace trace(0, d);
  traced.set_trace(&trace);
  for (int step = 0; step < 3; ++step) {
    trace.clear();
    const StepStats want = plain.train_step(batch.ids, batch.targets, 2);
    const StepStats got = traced.train_step(batch.ids, batch.targets, 2);
    EXPECT_EQ(got.loss, want.loss) << "step " << step;
    EXPECT_EQ(got.grad_norm, want.grad_norm) << "step " << step;
    EXPECT_EQ(want.compute_seconds, 0);  // untraced: no breakdown
    EXPECT_EQ(got.compute_seconds, got.seconds);
    EXPECT_EQ(got.pipeline_wait_seconds + got.tp_wait_seconds + got.dp_wait_seconds +
                  got.other_wait_seconds,
              0);
    std::map<std::string, int> names;
    int64_t compute_ns = 0, step_ns = 0;
    for (const TraceSpan& span : trace.spans()) {
      ++names[span.name];
      EXPECT_GE(span.dur_ns, 0);
      (span.lane == "step" ? step_ns : compute_ns) += span.dur_ns;
      EXPECT_TRUE(span.lane == "step" || span.lane == "compute") << span.lane;
    }
    EXPECT_EQ(names, (std::map<std::string, int>{
                         {"backward", 2}, {"forward", 2}, {"optimizer", 1}, {"step", 1}}));
    EXPECT_LE(compute_ns, step_ns);
  }
}

// One microbatch of 4 rows and 4 of one row give the same step; with dropout too, since the
// masks follow the samples' indices, not the microbatches.
void check_microbatches_accumulate(const TransformerConfig& c) {
  const Device d = testing::default_test_device();
  const Batch batch = make_batch(4, 8, c.vocab_size, 4);
  GPTModel a(c, d, 6), b(c, d, 6);
  LRSchedule constant;
  constant.lr = 1e-3f;
  constant.style = LRDecayStyle::constant;
  Trainer ta(a, AdamWConfig{}, constant), tb(b, AdamWConfig{}, constant);
  const StepStats sa = ta.train_step(batch.ids, batch.targets, 1);
  const StepStats sb = tb.train_step(batch.ids, batch.targets, 4);
  EXPECT_NEAR(sa.loss, sb.loss, 1e-5 * sa.loss);
  EXPECT_EQ(ta.consumed_samples(), 4);
  EXPECT_EQ(tb.consumed_samples(), 4);
  EXPECT_NEAR(sa.grad_norm, sb.grad_norm, 1e-4 * sa.grad_norm);
  // The accumulated gradients are still in the buffers after the step. (Parameters are not
  // compared: Adam's first step moves each by ~lr * sign(g), which amplifies f32 noise in
  // gradients that are ~0.)
  const auto ga = host_floats(a.flat_grads()), gb = host_floats(b.flat_grads());
  double max_err = 0, max_abs = 0;
  for (size_t i = 0; i < ga.size(); ++i) {
    max_err = std::max(max_err, double(std::abs(ga[i] - gb[i])));
    max_abs = std::max(max_abs, double(std::abs(ga[i])));
  }
  EXPECT_GT(max_abs, 0);
  EXPECT_LE(max_err, 1e-5 * max_abs);
}

TEST(Trainer, MicrobatchesAccumulateToTheFullBatchStep) {
  check_microbatches_accumulate(small_llama());
}

TEST(Trainer, MicrobatchesAccumulateToTheFullBatchStepWithDropout) {
  TransformerConfig c = small_llama();
  c.hidden_dropout = 0.1f;
  c.attention_dropout = 0.1f;
  check_microbatches_accumulate(c);
  // The same batch at another data position draws other masks.
  const Device d = testing::default_test_device();
  const Batch batch = make_batch(4, 8, c.vocab_size, 4);
  GPTModel a(c, d, 6), b(c, d, 6);
  const LRSchedule schedule = warmup_cosine(1e-3f, 0, 10);
  Trainer ta(a, AdamWConfig{}, schedule), tb(b, AdamWConfig{}, schedule);
  tb.set_iterations(0, 0, 0, 4);
  EXPECT_NE(ta.train_step(batch.ids, batch.targets).loss,
            tb.train_step(batch.ids, batch.targets).loss);
}

// bf16 parameters and activations, f32 gradients and master weights. CUDA only: activations
// on the CPU are f32 (run with BRAID_TEST_DEVICE=cuda).
TEST(Trainer, Bf16TrainsLikeF32OnCuda) {
  const Device d = testing::default_test_device();
  if (!d.is_cuda()) GTEST_SKIP() << "bf16 activations need a CUDA device";
  const TransformerConfig c32 = TransformerConfig::preset("llama-tiny");
  TransformerConfig c16 = c32;
  c16.params_dtype = DType::bf16;
  GPTModel m32(c32, d, 17), m16(c16, d, 17);
  ASSERT_EQ(m16.flat_params().dtype(), DType::bf16);
  ASSERT_EQ(m16.flat_grads().dtype(), DType::f32);
  const Batch batch = make_batch(4, 32, c32.vocab_size, 23);
  const float l32 = m32.forward(batch.ids, batch.targets);
  const float l16 = m16.forward(batch.ids, batch.targets);
  EXPECT_NEAR(l16, l32, 2e-2 * l32);
  m32.backward();
  m16.backward();
  const auto g32 = host_floats(m32.flat_grads()), g16 = host_floats(m16.flat_grads());
  double dot = 0, n32 = 0, n16 = 0;
  for (size_t i = 0; i < g32.size(); ++i) {
    dot += double(g32[i]) * g16[i];
    n32 += double(g32[i]) * g32[i];
    n16 += double(g16[i]) * g16[i];
  }
  EXPECT_GT(dot / std::sqrt(n32 * n16), 0.99) << "bf16 gradients point elsewhere";

  Trainer trainer(m16, AdamWConfig{}, warmup_cosine(1e-2f, 5, 40));
  float first = 0, last = 0;
  for (int i = 0; i < 40; ++i) {
    last = trainer.train_step(batch.ids, batch.targets).loss;
    if (i == 0) first = last;
  }
  EXPECT_LT(last, 0.5f * first);
  // The model's bf16 weights are the optimizer's f32 master weights, rounded.
  const auto master = host_floats(trainer.optimizer().master_params());
  const Tensor params = m16.flat_params().to(Device::cpu());
  const uint16_t* bits = params.data_ptr<uint16_t>();
  for (size_t i = 0; i < master.size(); ++i) ASSERT_EQ(bits[i], float_to_bf16(master[i])) << i;
}

TEST(Trainer, BatchMustSplitIntoMicrobatches) {
  const TransformerConfig c = small_gpt2();
  GPTModel model(c, testing::default_test_device(), 6);
  Trainer trainer(model, AdamWConfig{}, warmup_cosine(1e-3f, 0, 10));
  const Batch batch = make_batch(3, 8, c.vocab_size, 4);
  EXPECT_THROW(trainer.train_step(batch.ids, batch.targets, 2), Error);
  EXPECT_THROW(trainer.train_step(batch.ids, batch.targets, 0), Error);
  EXPECT_EQ(trainer.iteration(), 0);
}

// A weight-decay schedule sets each step's decay from the steps taken, like the learning rate:
// the model of one process trains exactly as an AdamW whose decay is set by hand before each
// step does.
TEST(Trainer, WeightDecayScheduleSetsEachStepsDecay) {
  const TransformerConfig c = small_gpt2();
  GPTModel scheduled(c, testing::default_test_device(), 6),
      by_hand(c, testing::default_test_device(), 6);
  ParallelModel wrapped(scheduled);
  TrainerConfig config{AdamWConfig{}, warmup_cosine(1e-2f, 0, 10), {}, {}, "1f1b"};
  config.weight_decay_schedule = WeightDecaySchedule{0.0f, 0.5f, 4, WDIncrStyle::linear};
  Trainer trainer(wrapped, config);
  Trainer reference(by_hand, AdamWConfig{}, warmup_cosine(1e-2f, 0, 10));
  const Batch batch = make_batch(2, 8, c.vocab_size, 4);
  for (int i = 0; i < 6; ++i) {
    reference.optimizer().set_weight_decay(config.weight_decay_schedule->weight_decay_at(i));
    trainer.train_step(batch.ids, batch.targets, 1);
    reference.train_step(batch.ids, batch.targets, 1);
    EXPECT_EQ(trainer.optimizer().config().weight_decay, std::min(0.5f, 0.125f * float(i)));
  }
  EXPECT_EQ(host_floats(scheduled.flat_params()), host_floats(by_hand.flat_params()));
  config.weight_decay_schedule->incr_iters = 0;
  EXPECT_THROW({ Trainer t(wrapped, config); }, ConfigError);
}

// With TrainerConfig::global_batch_size the schedules count the samples of the updates, as
// Megatron's do: a step of half a global batch (a ramp's) advances them half an iteration, a
// skipped step not at all, and set_iterations (a checkpoint's counters) restores the count.
TEST(Trainer, SchedulesCountTheSamplesOfTheUpdates) {
  const TransformerConfig c = small_gpt2();
  GPTModel model(c, testing::default_test_device(), 6);
  ParallelModel wrapped(model);
  TrainerConfig config{AdamWConfig{}, warmup_cosine(1e-2f, 2, 10), {}, {}, "1f1b", 4};
  config.weight_decay_schedule = WeightDecaySchedule{0.0f, 0.5f, 4, WDIncrStyle::linear};
  config.loss_scale.dynamic = true;
  config.loss_scale.initial_loss_scale = 0x1p66f;  // overflows: the first steps are skipped
  config.loss_scale.hysteresis = 1;
  Trainer trainer(wrapped, config);
  double position = 0;  // in global batches of 4
  int64_t samples = 0, consumed = 0;
  for (int64_t rows : {2, 2, 4, 2, 4, 4, 2, 4, 2, 4, 2, 4}) {
    const Batch batch = make_batch(rows, 8, c.vocab_size, 4 + rows);
    const StepStats s = trainer.train_step(batch.ids, batch.targets, 1);
    consumed += rows;  // skipped steps too
    EXPECT_EQ(trainer.consumed_samples(), consumed);
    EXPECT_EQ(s.lr, config.schedule.lr_at(position)) << "at " << position;
    EXPECT_EQ(trainer.optimizer().config().weight_decay,
              config.weight_decay_schedule->weight_decay_at(position));
    if (!s.skipped) {
      position += double(rows) / 4;
      samples += rows;
    }
    EXPECT_EQ(trainer.schedule_iterations(), position);
    EXPECT_EQ(trainer.update_samples(), samples);
  }
  EXPECT_GT(trainer.skipped_iterations(), 0);
  EXPECT_GT(samples, 4);  // the scale came down and updates followed
  trainer.set_iterations(9, 1, 22, 30);
  EXPECT_EQ(trainer.schedule_iterations(), 5.5);
  EXPECT_EQ(trainer.consumed_samples(), 30);
  // Without it (0) every update is one iteration, whatever its size.
  Trainer counting(model, AdamWConfig{}, warmup_cosine(1e-2f, 2, 10));
  counting.set_iterations(9, 1, 22, 30);
  EXPECT_EQ(counting.schedule_iterations(), 8.0);
}

// A passed iteration (--iterations-to-skip) advances the iteration and the data position alone:
// the parameters, the optimizer's state and step, the schedules' position and the skipped count
// stay, and the next step trains as a trainer that had not passed one trains at that data
// position (the dropout masks are the next samples').
TEST(Trainer, PassedIterationChangesNothingButTheCounts) {
  TransformerConfig c = small_gpt2();
  c.hidden_dropout = 0.1f;
  c.attention_dropout = 0.1f;
  GPTModel passing(c, testing::default_test_device(), 6);
  GPTModel plain(c, testing::default_test_device(), 6);
  ParallelModel passing_wrapped(passing), plain_wrapped(plain);
  const TrainerConfig config{AdamWConfig{}, warmup_cosine(1e-2f, 2, 10), {}, {}, "1f1b", 4};
  Trainer with_pass(passing_wrapped, config), without(plain_wrapped, config);
  const Batch first = make_batch(4, 8, c.vocab_size, 1), second = make_batch(4, 8, c.vocab_size, 2);
  with_pass.train_step(first.ids, first.targets);
  without.train_step(first.ids, first.targets);
  const std::vector<float> before = host_floats(passing.flat_params());
  with_pass.pass_iteration(4);
  EXPECT_EQ(with_pass.iteration(), 2);
  EXPECT_EQ(with_pass.consumed_samples(), 8);
  EXPECT_EQ(with_pass.skipped_iterations(), 0);
  EXPECT_EQ(with_pass.update_samples(), 4);
  EXPECT_EQ(with_pass.schedule_iterations(), 1.0);
  EXPECT_EQ(with_pass.optimizer().step(), 1);
  EXPECT_EQ(host_floats(passing.flat_params()), before);
  without.set_iterations(1, 0, 4, 8);
  const StepStats a = with_pass.train_step(second.ids, second.targets);
  const StepStats b = without.train_step(second.ids, second.targets);
  EXPECT_EQ(a.lr, b.lr);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(host_floats(passing.flat_params()), host_floats(plain.flat_params()));
  EXPECT_EQ(with_pass.iteration(), 3);
  EXPECT_EQ(with_pass.consumed_samples(), 12);
  EXPECT_THROW(with_pass.pass_iteration(0), Error);
  // Schedules that count iterations would take the passed one for an update: refused.
  Trainer counting(plain, AdamWConfig{}, warmup_cosine(1e-2f, 2, 10));
  EXPECT_THROW(counting.pass_iteration(4), Error);
}

TEST(Trainer, InvalidScheduleIsRejected) {
  GPTModel model(small_gpt2(), testing::default_test_device(), 6);
  EXPECT_THROW({ Trainer t(model, AdamWConfig{}, warmup_cosine(1e-3f, 10, 10)); }, ConfigError);
}

}  // namespace
}  // namespace braid::engine
