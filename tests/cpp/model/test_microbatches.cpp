// Activations kept per microbatch, the loss's ignore rule, and argument errors.

#include <gtest/gtest.h>

#include <cmath>

#include "model_test_util.h"

namespace braid::model {
namespace {

using namespace testing_util;

TEST(Microbatches, InterleavedForwardsAndBackwardsEqualOneBatch) {
  const TransformerConfig c = small_llama();
  const Device d = testing::default_test_device();
  const Batch batch = make_batch(4, 8, c.vocab_size, 12);
  GPTModel whole(c, d, 4), split(c, d, 4);
  whole.forward(batch.ids, batch.targets);
  whole.backward();
  // Both halves have the same number of non-ignored targets, so the mean of the two means
  // is the mean over the batch.
  const float l0 = split.forward(batch.ids.narrow(0, 2), batch.targets.narrow(0, 2), 0);
  const float l1 = split.forward(batch.ids.narrow(2, 2), batch.targets.narrow(2, 2), 1);
  EXPECT_TRUE(split.has_activations(0) && split.has_activations(1));
  split.backward(0, 0.5f);
  EXPECT_FALSE(split.has_activations(0));
  split.backward(1, 0.5f);
  EXPECT_TRUE(std::isfinite(l0) && std::isfinite(l1));
  const auto a = host_floats(whole.flat_grads()), b = host_floats(split.flat_grads());
  double max_err = 0, max_abs = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    max_err = std::max(max_err, double(std::abs(a[i] - b[i])));
    max_abs = std::max(max_abs, double(std::abs(a[i])));
  }
  EXPECT_LE(max_err, 1e-5 * max_abs);
}

TEST(Microbatches, IgnoredTargetsDoNotCount) {
  const TransformerConfig c = small_gpt2();
  GPTModel model(c, testing::default_test_device(), 8);
  Batch batch = make_batch(2, 8, c.vocab_size, 5);
  const double full = reference_loss(model, batch);
  // Ignoring more targets changes the mean to the mean over the rest.
  int32_t* t = batch.targets.data_ptr<int32_t>();
  for (int i = 0; i < 8; ++i) t[i] = -1;
  const float partial = model.forward(batch.ids, batch.targets);
  model.backward();
  EXPECT_NEAR(partial, reference_loss(model, batch), 1e-5);
  EXPECT_NE(float(full), partial);

  for (int i = 0; i < 16; ++i) t[i] = -5;
  model.zero_grad();
  EXPECT_EQ(model.forward(batch.ids, batch.targets), 0.0f);
  model.backward();
  for (float g : host_floats(model.flat_grads())) ASSERT_EQ(g, 0.0f);
}

TEST(Microbatches, GradScaleScalesTheGradient) {
  const TransformerConfig c = small_gpt2();
  const Device d = testing::default_test_device();
  const Batch batch = make_batch(2, 8, c.vocab_size, 6);
  GPTModel one(c, d, 1), quarter(c, d, 1);
  one.forward(batch.ids, batch.targets);
  one.backward(0, 1.0f);
  quarter.forward(batch.ids, batch.targets);
  quarter.backward(0, 0.25f);
  const auto a = host_floats(one.flat_grads()), b = host_floats(quarter.flat_grads());
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_NEAR(b[i], 0.25f * a[i], 1e-6f * (1 + std::abs(a[i])));
}

TEST(Microbatches, MisuseIsAnError) {
  const TransformerConfig c = small_gpt2();
  GPTModel model(c, testing::default_test_device(), 2);
  const Batch batch = make_batch(2, 8, c.vocab_size, 1);
  EXPECT_THROW(model.backward(3), Error);
  model.forward(batch.ids, batch.targets, 3);
  EXPECT_THROW(model.forward(batch.ids, batch.targets, 3), Error);
  model.backward(3);
  EXPECT_THROW(model.backward(3), Error);

  Batch bad = make_batch(2, 8, c.vocab_size, 1);
  bad.ids.data_ptr<int32_t>()[5] = int32_t(c.vocab_size);
  EXPECT_THROW(model.forward(bad.ids, bad.targets), Error);
  const Batch too_long = make_batch(1, c.max_position_embeddings + 1, c.vocab_size, 1);
  EXPECT_THROW(model.forward(too_long.ids, too_long.targets), Error);
  EXPECT_THROW(model.forward(batch.ids, batch.targets.narrow(0, 1)), Error);
  EXPECT_FALSE(model.has_activations(0));
}

TEST(Microbatches, Bf16ParametersNeedCuda) {
  TransformerConfig c = small_gpt2();
  c.params_dtype = DType::bf16;
  EXPECT_THROW({ GPTModel model(c, Device::cpu(), 1); }, ConfigError);
}

// Hidden and attention dropout, each alone: a training forward draws a new mask every time;
// evaluation (logits(), and forward with training = false) applies none.
TEST(Microbatches, DropoutChangesTheTrainingLossOnly) {
  for (const bool attention : {false, true}) {
    SCOPED_TRACE(attention ? "attention dropout" : "hidden dropout");
    TransformerConfig c = small_gpt2();
    (attention ? c.attention_dropout : c.hidden_dropout) = 0.3f;
    GPTModel model(c, testing::default_test_device(), 2);
    const Batch batch = make_batch(2, 8, c.vocab_size, 1);
    const float train = model.forward(batch.ids, batch.targets);
    model.backward();
    const float again = model.forward(batch.ids, batch.targets);
    model.backward();
    const float reference = float(reference_loss(model, batch));
    EXPECT_NE(train, reference);  // logits() applies no dropout
    EXPECT_NE(train, again);      // a new mask every forward
    float evaluated = 0.0f;
    model.forward_stage(batch.ids, batch.targets, Tensor(), 0, &evaluated, false);
    EXPECT_NEAR(evaluated, reference, 1e-5f * std::abs(reference));
  }
}

}  // namespace
}  // namespace braid::model
