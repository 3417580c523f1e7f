// AdamW and global-norm clipping against a hand-written double-precision reference.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "braid/engine/adamw.h"
#include "model/model_test_util.h"

namespace braid::engine {
namespace {

using model::GPTModel;
using model::Parameter;
using namespace model::testing_util;

// The reference: torch.optim.AdamW on each parameter, after Megatron's clipping.
struct Reference {
  std::vector<std::vector<double>> params, m, v;
  int64_t step = 0;

  explicit Reference(const GPTModel& model) {
    for (const Parameter& p : model.parameters()) {
      const std::vector<float> host = host_floats(p.value);
      params.emplace_back(host.begin(), host.end());
      m.emplace_back(host.size(), 0.0);
      v.emplace_back(host.size(), 0.0);
    }
  }

  // Returns the global norm before clipping.
  double step_with(const std::vector<std::vector<float>>& grads, const AdamWConfig& c,
                   const std::vector<double>& decay, double lr) {
    return step_with(grads, c, decay, std::vector<double>(params.size(), lr));
  }
  // With parameter p's learning rate lrs[p].
  double step_with(const std::vector<std::vector<float>>& grads, const AdamWConfig& c,
                   const std::vector<double>& decay, const std::vector<double>& lrs) {
    double sq = 0;
    for (const auto& g : grads)
      for (float x : g) sq += double(x) * x;
    const double norm = std::sqrt(sq);
    double scale = 1.0;
    if (c.clip_grad > 0 && double(c.clip_grad) / (norm + 1e-6) < 1.0)
      scale = double(c.clip_grad) / (norm + 1e-6);
    ++step;
    const double bc1 = 1 - std::pow(double(c.beta1), double(step));
    const double bc2 = 1 - std::pow(double(c.beta2), double(step));
    for (size_t p = 0; p < params.size(); ++p) {
      for (size_t i = 0; i < params[p].size(); ++i) {
        const double g = double(grads[p][i]) * scale, lr = lrs[p];
        double& w = params[p][i];
        w -= lr * decay[p] * w;
        m[p][i] = c.beta1 * m[p][i] + (1 - c.beta1) * g;
        v[p][i] = c.beta2 * v[p][i] + (1 - c.beta2) * g * g;
        w -= lr * (m[p][i] / bc1) / (std::sqrt(v[p][i] / bc2) + c.eps);
      }
    }
    return norm;
  }
};

// Writes reproducible gradients (a different set per `round`) into the model.
std::vector<std::vector<float>> set_gradients(GPTModel& model, int round, float scale) {
  std::vector<std::vector<float>> out;
  uint64_t seed = 500 + 1000 * uint64_t(round);
  for (Parameter& p : model.parameters()) {
    Tensor g = testing::random_tensor(p.spec.shape, seed++, scale);
    p.grad.copy_from(g);
    out.push_back(host_floats(g));
  }
  return out;
}

void compare(GPTModel& model, const Reference& ref, double tol) {
  for (size_t p = 0; p < model.parameters().size(); ++p) {
    const Parameter& param = model.parameters()[p];
    const std::vector<float> got = host_floats(param.value);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], ref.params[p][i], tol) << param.spec.name << "[" << i << "]";
  }
}

void check_against_reference(AdamWConfig c, float grad_scale, bool expect_clipped) {
  GPTModel model(small_gpt2(), testing::default_test_device(), 3);
  Reference ref(model);
  AdamW opt(model, c);
  std::vector<double> decay;
  for (const Parameter& p : model.parameters()) decay.push_back(opt.weight_decay_of(p.spec));
  const float lrs[] = {1e-2f, 5e-3f, 2e-3f};
  for (int round = 0; round < 3; ++round) {
    const auto grads = set_gradients(model, round, grad_scale);
    const double want_norm = ref.step_with(grads, c, decay, lrs[round]);
    const float norm = opt.clip_and_step(lrs[round]);
    EXPECT_NEAR(norm, want_norm, 1e-5 * want_norm);
    EXPECT_EQ(expect_clipped, c.clip_grad > 0 && want_norm > c.clip_grad);
    EXPECT_EQ(opt.step(), round + 1);
    compare(model, ref, 2e-6);
  }
}

TEST(AdamW, MatchesReferenceWithoutClipping) {
  AdamWConfig c;
  c.beta2 = 0.95f;
  c.weight_decay = 0.1f;
  c.clip_grad = 0.0f;
  check_against_reference(c, 0.5f, false);
}

TEST(AdamW, MatchesReferenceWhenClipping) {
  AdamWConfig c;
  c.weight_decay = 0.1f;
  c.clip_grad = 0.5f;  // the random gradients' norm is far above this
  check_against_reference(c, 0.5f, true);
}

TEST(AdamW, ClipThresholdAboveTheNormChangesNothing) {
  AdamWConfig c;
  c.clip_grad = 1e6f;
  check_against_reference(c, 0.5f, false);
}

// Megatron's --decoupled-lr: the word embedding and the output layer (every copy of them) step
// with their own rate, everything else - position embeddings included - with the main one.
TEST(AdamW, DecoupledRateStepsTheEmbeddingAndOutputLayerOnly) {
  for (bool tied : {true, false}) {
    model::TransformerConfig config = small_gpt2();
    config.tie_embeddings = tied;
    GPTModel model(config, testing::default_test_device(), 3);
    Reference ref(model);
    AdamWConfig c;
    c.weight_decay = 0.1f;
    c.decay_embeddings = true;
    c.clip_grad = 0.0f;  // step_with takes the gradients' scale as given
    AdamW opt(model, c);
    std::vector<double> decay;
    int vocab = 0;
    for (const Parameter& p : model.parameters()) decay.push_back(opt.weight_decay_of(p.spec));
    for (int round = 0; round < 3; ++round) {
      const float lr = 1e-2f / float(round + 1), decoupled = round == 1 ? 0.0f : 4e-2f;
      std::vector<double> lrs;
      for (const Parameter& p : model.parameters()) {
        const bool embedding_or_output =
            p.spec.name == "model.embed_tokens.weight" || p.spec.name == "lm_head.weight";
        lrs.push_back(embedding_or_output ? decoupled : lr);
        vocab += round == 0 && embedding_or_output;
      }
      const auto grads = set_gradients(model, round, 0.5f);
      ref.step_with(grads, c, decay, lrs);
      opt.step_with(lr, 1.0f, decoupled);
      compare(model, ref, 2e-6);
    }
    EXPECT_EQ(vocab, tied ? 1 : 2);
  }
}

// The embedding's and output layer's groups move to the end of the optimizer's list: each
// group keeps its own weight decay, applied with its own rate. Zero gradients: only the
// decoupled decay moves the weights, by (1 - rate x decay).
TEST(AdamW, DecoupledRateKeepsEachGroupsWeightDecay) {
  GPTModel model(small_llama(), testing::default_test_device(), 3);
  AdamWConfig c;
  c.weight_decay = 0.5f;
  AdamW opt(model, c);
  auto host = [&](const char* name) { return host_floats(model.parameter(name).value); };
  const auto linear = host("model.layers.0.mlp.up_proj.weight");
  const auto head = host("lm_head.weight");
  const auto embed = host("model.embed_tokens.weight");
  const auto norm = host("model.layers.0.input_layernorm.weight");
  model.zero_grad();
  opt.step_with(0.1f, 1.0f, 0.2f);
  const auto linear_after = host("model.layers.0.mlp.up_proj.weight");
  const auto head_after = host("lm_head.weight");
  for (size_t i = 0; i < linear.size(); ++i) ASSERT_FLOAT_EQ(linear_after[i], linear[i] * 0.95f);
  for (size_t i = 0; i < head.size(); ++i) ASSERT_FLOAT_EQ(head_after[i], head[i] * 0.9f);
  EXPECT_EQ(host("model.embed_tokens.weight"), embed);  // no decay (decay_embeddings off)
  EXPECT_EQ(host("model.layers.0.input_layernorm.weight"), norm);
}

// --log-num-zeros-in-grad: the zero gradient elements of every parameter, once each.
TEST(AdamW, CountsTheZeroGradientElements) {
  GPTModel model(small_llama(), testing::default_test_device(), 3);
  AdamW opt(model, AdamWConfig{});
  auto count = [&] {
    int64_t zeros = 0;
    for (const Parameter& p : model.parameters())
      for (float x : host_floats(p.grad)) zeros += x == 0.0f;
    return zeros;
  };
  set_gradients(model, 0, 0.5f);
  const int64_t random = count();
  EXPECT_EQ(opt.num_zeros_in_grads(), random);
  Parameter& p = model.parameter("model.layers.1.mlp.up_proj.weight");
  p.grad.copy_from(Tensor::zeros(p.grad.shape(), DType::f32, p.grad.device()));
  EXPECT_GE(count(), random + p.grad.numel() - 2);  // random values are rarely exactly 0
  EXPECT_EQ(opt.num_zeros_in_grads(), count());
  model.zero_grad();  // every element of every parameter, never the padding between them
  int64_t elements = 0;
  for (const Parameter& q : model.parameters()) elements += q.grad.numel();
  EXPECT_EQ(opt.num_zeros_in_grads(), elements);
}

TEST(AdamW, DecayGoesToLinearWeightsOnlyUnlessEmbeddingsAreAsked) {
  GPTModel model(small_llama(), testing::default_test_device(), 3);
  AdamWConfig c;
  c.weight_decay = 0.1f;
  AdamW plain(model, c);
  c.decay_embeddings = true;
  AdamW with_embeddings(model, c);
  for (const Parameter& p : model.parameters()) {
    const std::string& n = p.spec.name;
    const bool linear = n.ends_with("proj.weight") || n == "lm_head.weight";
    EXPECT_EQ(plain.weight_decay_of(p.spec), linear ? 0.1f : 0.0f) << n;
    const bool embedding = n == "model.embed_tokens.weight";
    EXPECT_EQ(with_embeddings.weight_decay_of(p.spec), linear || embedding ? 0.1f : 0.0f) << n;
  }
}

TEST(AdamW, WeightDecayAloneShrinksDecayedWeights) {
  // Zero gradients: only the decoupled decay moves the weights, by the factor (1 - lr wd).
  GPTModel model(small_gpt2(), testing::default_test_device(), 3);
  AdamWConfig c;
  c.weight_decay = 0.5f;
  AdamW opt(model, c);
  const auto before = host_floats(model.parameter("model.layers.0.mlp.up_proj.weight").value);
  const auto embed = host_floats(model.parameter("model.embed_tokens.weight").value);
  model.zero_grad();
  EXPECT_EQ(opt.clip_and_step(0.1f), 0.0f);
  const auto after = host_floats(model.parameter("model.layers.0.mlp.up_proj.weight").value);
  for (size_t i = 0; i < before.size(); ++i) ASSERT_FLOAT_EQ(after[i], before[i] * 0.95f);
  EXPECT_EQ(host_floats(model.parameter("model.embed_tokens.weight").value), embed);
}

TEST(AdamW, SetWeightDecayChangesTheDecayedWeightsOnly) {
  // A weight-decay schedule's step: from 0 (nothing decays) to 0.3 - (1 - 0.1 x 0.3) on the
  // weights that decay, nothing on the norms and embeddings.
  GPTModel model(small_gpt2(), testing::default_test_device(), 3);
  AdamWConfig c;
  c.weight_decay = 0.0f;
  AdamW opt(model, c);
  const auto before = host_floats(model.parameter("model.layers.0.mlp.up_proj.weight").value);
  const auto norm = host_floats(model.parameter("model.layers.0.input_layernorm.weight").value);
  model.zero_grad();
  opt.clip_and_step(0.1f);
  EXPECT_EQ(host_floats(model.parameter("model.layers.0.mlp.up_proj.weight").value), before);
  opt.set_weight_decay(0.3f);
  EXPECT_EQ(opt.config().weight_decay, 0.3f);
  opt.clip_and_step(0.1f);
  const auto after = host_floats(model.parameter("model.layers.0.mlp.up_proj.weight").value);
  for (size_t i = 0; i < before.size(); ++i) ASSERT_FLOAT_EQ(after[i], before[i] * 0.97f);
  EXPECT_EQ(host_floats(model.parameter("model.layers.0.input_layernorm.weight").value), norm);
}

TEST(AdamW, NonFiniteGradientLeavesEverythingUntouched) {
  GPTModel model(small_gpt2(), testing::default_test_device(), 3);
  AdamW opt(model, AdamWConfig{});
  set_gradients(model, 0, 0.5f);
  Parameter& p = model.parameter("model.layers.1.self_attn.k_proj.bias");
  Tensor host = p.grad.to(Device::cpu());
  host.data_ptr<float>()[2] = std::numeric_limits<float>::quiet_NaN();
  p.grad.copy_from(host);
  const auto before = host_floats(model.flat_params());
  EXPECT_THROW(opt.clip_and_step(1e-3f), Error);
  EXPECT_EQ(opt.step(), 0);
  EXPECT_EQ(host_floats(model.flat_params()), before);
  for (float x : host_floats(opt.exp_avg())) ASSERT_EQ(x, 0.0f);
}

TEST(AdamW, InvalidConfigIsNamed) {
  GPTModel model(small_gpt2(), testing::default_test_device(), 3);
  auto expect_rejected = [&](AdamWConfig c, const std::string& field) {
    try {
      AdamW opt(model, c);
      ADD_FAILURE() << "accepted a bad " << field;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  AdamWConfig c;
  c.beta1 = 1.0f;
  expect_rejected(c, "beta1");
  c = AdamWConfig{};
  c.beta2 = -0.1f;
  expect_rejected(c, "beta2");
  c = AdamWConfig{};
  c.eps = 0;
  expect_rejected(c, "eps");
  c = AdamWConfig{};
  c.weight_decay = -1;
  expect_rejected(c, "weight_decay");
  c = AdamWConfig{};
  c.clip_grad = -1;
  expect_rejected(c, "clip_grad");
  c = AdamWConfig{};
  c.lr = -1;
  expect_rejected(c, "lr");
}

}  // namespace
}  // namespace braid::engine
