// The three recompute policies: bit-identical gradients, decreasing activation memory.

#include <gtest/gtest.h>

#include <cstring>

#include "braid/core/stream.h"
#include "model_test_util.h"

namespace braid::model {
namespace {

using namespace testing_util;

struct Run {
  Tensor grads;  // host copy
  float loss = 0;
  int64_t peak_activation_bytes = 0;
  int64_t leaked_bytes = 0;
};

Run run_policy(TransformerConfig config, Recompute policy, const Batch& batch) {
  config.recompute = policy;
  const Device device = testing::default_test_device();
  GPTModel model(config, device, 99);
  synchronize(device);
  const int64_t before = memory_stats(device).current_bytes;
  reset_peak_memory(device);
  Run run;
  run.loss = model.forward(batch.ids, batch.targets);
  model.backward();
  synchronize(device);
  const MemoryStats after = memory_stats(device);
  run.peak_activation_bytes = after.peak_bytes - before;
  run.leaked_bytes = after.current_bytes - before;
  run.grads = model.flat_grads().to(Device::cpu());
  return run;
}

void check_policies(const TransformerConfig& config) {
  const Batch batch = make_batch(4, 32, config.vocab_size, 3);
  const Run none = run_policy(config, Recompute::none, batch);
  const Run selective = run_policy(config, Recompute::selective, batch);
  const Run full = run_policy(config, Recompute::full, batch);
  for (const Run* r : {&none, &selective, &full}) {
    EXPECT_EQ(r->leaked_bytes, 0) << "activations outlive backward";
    EXPECT_EQ(r->loss, none.loss);
  }
  const size_t bytes = none.grads.nbytes();
  EXPECT_EQ(0, std::memcmp(selective.grads.data(), none.grads.data(), bytes))
      << "selective recompute changed the gradients";
  EXPECT_EQ(0, std::memcmp(full.grads.data(), none.grads.data(), bytes))
      << "full recompute changed the gradients";
  EXPECT_GT(none.peak_activation_bytes, selective.peak_activation_bytes);
  EXPECT_GT(selective.peak_activation_bytes, full.peak_activation_bytes);
  ::testing::Test::RecordProperty("peak_none", std::to_string(none.peak_activation_bytes));
  ::testing::Test::RecordProperty("peak_selective",
                                  std::to_string(selective.peak_activation_bytes));
  ::testing::Test::RecordProperty("peak_full", std::to_string(full.peak_activation_bytes));
  std::printf("peak activation bytes: none %lld, selective %lld, full %lld\n",
              (long long)none.peak_activation_bytes, (long long)selective.peak_activation_bytes,
              (long long)full.peak_activation_bytes);
}

TEST(Recompute, Gpt2PoliciesAgreeAndSaveMemory) {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  c.num_layers = 4;
  c.hidden_dropout = 0.1f;  // masks must be drawn again identically when recomputing
  check_policies(c);
}

TEST(Recompute, LlamaPoliciesAgreeAndSaveMemory) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.num_layers = 4;
  check_policies(c);
}

}  // namespace
}  // namespace braid::model
