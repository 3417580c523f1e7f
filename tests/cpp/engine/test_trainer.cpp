#include <gtest/gtest.h>

#include <cmath>

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

TEST(Trainer, MicrobatchesAccumulateToTheFullBatchStep) {
  const TransformerConfig c = small_llama();
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
  EXPECT_NEAR(sa.grad_norm, sb.grad_norm, 1e-4 * sa.grad_norm);
  const auto pa = host_floats(a.flat_params()), pb = host_floats(b.flat_params());
  for (size_t i = 0; i < pa.size(); ++i) ASSERT_NEAR(pa[i], pb[i], 1e-6f) << i;
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

TEST(Trainer, InvalidScheduleIsRejected) {
  GPTModel model(small_gpt2(), testing::default_test_device(), 6);
  EXPECT_THROW({ Trainer t(model, AdamWConfig{}, warmup_cosine(1e-3f, 10, 10)); }, ConfigError);
}

}  // namespace
}  // namespace braid::engine
