#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "braid/core/philox.h"
#include "braid/model/gpt_model.h"
#include "braid/model/init.h"
#include "test_devices.h"

namespace braid::model {
namespace {

ParamSpec spec_named(const TransformerConfig& c, const std::string& name) {
  for (const ParamSpec& s : parameter_specs(c))
    if (s.name == name) return s;
  ADD_FAILURE() << "no parameter " << name;
  return {};
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.data(), hb.data(), ha.nbytes()) == 0;
}

TEST(Init, ElementIsAPureFunctionOfSeedNameAndIndex) {
  const TransformerConfig c = TransformerConfig::preset("llama-tiny");
  const ParamSpec spec = spec_named(c, "model.layers.1.self_attn.k_proj.weight");
  std::vector<float> values(size_t(spec.shape.numel()));
  init_values(values, spec, c, 42);
  for (int64_t i : {int64_t(0), int64_t(1), int64_t(777), spec.shape.numel() - 1}) {
    philox::Words4 w = philox::random_words(42, philox::stream_of(spec.name.c_str()), uint64_t(i));
    EXPECT_EQ(values[size_t(i)], c.init_std * philox::normal_from_words(w.x[0], w.x[1])) << i;
  }
}

TEST(Init, SubRangeEqualsTheSameRangeOfTheFullTensor) {
  const TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  for (const char* name : {"model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"}) {
    const ParamSpec spec = spec_named(c, name);
    std::vector<float> full(size_t(spec.shape.numel()));
    init_values(full, spec, c, 9);
    // A column-parallel shard (rows [R/4, R/2)) and a row-parallel one (columns 16..31 of row 3).
    const int64_t cols = spec.shape[1], first = spec.shape[0] / 4;
    std::vector<float> rows(size_t(first * cols));
    init_values(rows, spec, c, 9, first * cols);
    EXPECT_EQ(0, std::memcmp(rows.data(), full.data() + first * cols, rows.size() * 4)) << name;
    std::vector<float> piece(16);
    init_values(piece, spec, c, 9, 3 * cols + 16);
    EXPECT_EQ(0, std::memcmp(piece.data(), full.data() + 3 * cols + 16, 64)) << name;
  }
}

TEST(Init, RulesPerParameterKind) {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  c.num_layers = 8;
  c.init_std = 0.05f;
  c.qk_layernorm = true;
  auto moments = [&](const std::string& name) {
    const ParamSpec spec = spec_named(c, name);
    std::vector<float> v(size_t(spec.shape.numel()));
    init_values(v, spec, c, 3);
    double sum = 0, sq = 0;
    for (float x : v) {
      sum += x;
      sq += double(x) * x;
    }
    const double mean = sum / double(v.size());
    return std::pair<double, double>(mean, std::sqrt(sq / double(v.size()) - mean * mean));
  };
  const auto [m1, s1] = moments("model.layers.2.mlp.up_proj.weight");
  EXPECT_NEAR(m1, 0.0, 0.002);
  EXPECT_NEAR(s1, 0.05, 0.002);
  const auto [m2, s2] = moments("model.layers.2.mlp.down_proj.weight");
  EXPECT_NEAR(s2, 0.05 / 4.0, 0.0005);  // 1 / sqrt(2 * 8 layers)
  const auto [m3, s3] = moments("model.layers.2.self_attn.o_proj.weight");
  EXPECT_NEAR(s3, 0.05 / 4.0, 0.0005);
  const auto [m4, s4] = moments("model.embed_tokens.weight");
  EXPECT_NEAR(s4, 0.05, 0.002);
  // Megatron's --embedding-init-method-std: the word and position embeddings' own std; the
  // output layer keeps init_std.
  c.embedding_init_std = 0.2f;
  c.tie_embeddings = false;
  EXPECT_NEAR(moments("model.embed_tokens.weight").second, 0.2, 0.008);
  EXPECT_NEAR(moments("model.embed_positions.weight").second, 0.2, 0.008);
  EXPECT_NEAR(moments("lm_head.weight").second, 0.05, 0.002);
  EXPECT_NEAR(moments("model.layers.2.mlp.up_proj.weight").second, 0.05, 0.002);
  c.embedding_init_std = 0.0f;
  // megatron-core initialises the attention sinks (softmax_offset) and the router's bias like
  // weights.
  c.softmax_type = SoftmaxType::learnable;
  c.num_experts = 4;
  for (const char* name : {"model.layers.2.self_attn.sinks", "model.layers.2.mlp.gate.bias"}) {
    const InitRule rule = init_rule(spec_named(c, name), c);
    EXPECT_EQ(rule.kind, InitKind::normal) << name;
    EXPECT_EQ(rule.std, c.init_std) << name;
    EXPECT_GT(moments(name).second, 0.0) << name;
  }
  c.softmax_type = SoftmaxType::vanilla;
  c.num_experts = 0;
  for (const char* name :
       {"model.layers.2.input_layernorm.weight", "model.layers.2.post_attention_layernorm.weight",
        "model.norm.weight", "model.layers.2.self_attn.q_norm.weight",
        "model.layers.2.self_attn.k_norm.weight"}) {
    const auto [m, s] = moments(name);
    EXPECT_EQ(m, 1.0) << name;
    EXPECT_EQ(s, 0.0) << name;
    c.zero_centered_gamma = true;  // holding gamma - 1, they start at zero
    const auto [zm, zs] = moments(name);
    c.zero_centered_gamma = false;
    EXPECT_EQ(zm, 0.0) << name;
    EXPECT_EQ(zs, 0.0) << name;
  }
  for (const char* name :
       {"model.layers.2.input_layernorm.bias", "model.layers.2.mlp.up_proj.bias",
        "model.layers.2.self_attn.v_proj.bias", "model.layers.2.self_attn.k_norm.bias"}) {
    const auto [m, s] = moments(name);
    EXPECT_EQ(m, 0.0) << name;
    EXPECT_EQ(s, 0.0) << name;
  }
}

TEST(Init, ModelParametersAreTheInitValues) {
  const TransformerConfig c = TransformerConfig::preset("llama-tiny");
  GPTModel model(c, testing::default_test_device(), 11);
  for (const Parameter& p : model.parameters()) {
    std::vector<float> want(size_t(p.spec.shape.numel()));
    init_values(want, p.spec, c, 11);
    const Tensor got = p.value.to(Device::cpu());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4)) << p.spec.name;
    const Tensor grad = p.grad.to(Device::cpu());
    for (int64_t i = 0; i < grad.numel(); ++i) ASSERT_EQ(grad.item(i), 0.0) << p.spec.name;
  }
}

TEST(Init, SameSeedSameModelOtherSeedOtherModel) {
  const TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  const Device d = testing::default_test_device();
  GPTModel a(c, d, 5), b(c, d, 5), other(c, d, 6);
  EXPECT_TRUE(same_bytes(a.flat_params(), b.flat_params()));
  EXPECT_FALSE(same_bytes(a.flat_params(), other.flat_params()));
}

TEST(Init, ShardOfAParameterIsASliceOfTheUnshardedOne) {
  // What a TP rank does for a column-parallel weight: initialise rows [r0, r1) in place.
  const TransformerConfig c = TransformerConfig::preset("llama-tiny");
  const Device d = testing::default_test_device();
  GPTModel model(c, d, 13);
  const Parameter& gate = model.parameter("model.layers.0.mlp.gate_proj.weight");
  const int64_t cols = gate.spec.shape[1], rows = gate.spec.shape[0] / 2;
  Tensor shard = Tensor::empty({rows, cols}, DType::f32, d);
  init_parameter(shard, gate.spec, c, 13, rows * cols);
  EXPECT_TRUE(same_bytes(shard, gate.value.narrow(rows, rows)));
}

}  // namespace
}  // namespace braid::model
