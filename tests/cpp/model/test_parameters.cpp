#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "braid/model/gpt_model.h"
#include "braid/model/parameters.h"
#include "test_devices.h"

namespace braid::model {
namespace {

std::map<std::string, ParamSpec> by_name(const std::vector<ParamSpec>& specs) {
  std::map<std::string, ParamSpec> out;
  for (const ParamSpec& s : specs) out.emplace(s.name, s);
  return out;
}

TEST(ParameterSpecs, Gpt2_124mHasTheKnownCount) {
  const TransformerConfig c = TransformerConfig::preset("gpt2-124m");
  EXPECT_EQ(count_parameters(c), 124439808);
  const auto specs = by_name(parameter_specs(c));
  EXPECT_EQ(specs.count("lm_head.weight"), 0u);  // tied to model.embed_tokens.weight
  EXPECT_EQ(specs.at("model.embed_tokens.weight").shape, (Shape{50257, 768}));
  EXPECT_EQ(specs.at("model.embed_positions.weight").shape, (Shape{1024, 768}));
  EXPECT_EQ(specs.at("model.layers.11.self_attn.q_proj.weight").shape, (Shape{768, 768}));
  EXPECT_EQ(specs.at("model.layers.11.self_attn.v_proj.bias").shape, (Shape{768}));
  EXPECT_EQ(specs.at("model.layers.0.mlp.up_proj.weight").shape, (Shape{3072, 768}));
  EXPECT_EQ(specs.at("model.layers.0.mlp.down_proj.weight").shape, (Shape{768, 3072}));
  EXPECT_EQ(specs.count("model.layers.0.mlp.gate_proj.weight"), 0u);
  EXPECT_EQ(specs.at("model.norm.bias").shape, (Shape{768}));
  EXPECT_EQ(specs.size(), 2u + 12u * 16u + 2u);
}

TEST(ParameterSpecs, Llama3_8bShapesWithoutAllocating) {
  const TransformerConfig c = TransformerConfig::preset("llama3-8b");
  EXPECT_EQ(count_parameters(c), 8030261248);
  const auto specs = by_name(parameter_specs(c));
  EXPECT_EQ(specs.at("model.embed_tokens.weight").shape, (Shape{128256, 4096}));
  EXPECT_EQ(specs.at("lm_head.weight").shape, (Shape{128256, 4096}));
  EXPECT_EQ(specs.at("model.layers.31.self_attn.q_proj.weight").shape, (Shape{4096, 4096}));
  EXPECT_EQ(specs.at("model.layers.31.self_attn.k_proj.weight").shape, (Shape{1024, 4096}));
  EXPECT_EQ(specs.at("model.layers.31.self_attn.v_proj.weight").shape, (Shape{1024, 4096}));
  EXPECT_EQ(specs.at("model.layers.31.self_attn.o_proj.weight").shape, (Shape{4096, 4096}));
  EXPECT_EQ(specs.at("model.layers.0.mlp.gate_proj.weight").shape, (Shape{14336, 4096}));
  EXPECT_EQ(specs.at("model.layers.0.mlp.up_proj.weight").shape, (Shape{14336, 4096}));
  EXPECT_EQ(specs.at("model.layers.0.mlp.down_proj.weight").shape, (Shape{4096, 14336}));
  EXPECT_EQ(specs.at("model.norm.weight").shape, (Shape{4096}));
  EXPECT_EQ(specs.count("model.embed_positions.weight"), 0u);
  EXPECT_EQ(specs.count("model.norm.bias"), 0u);
  for (const auto& [name, spec] : specs)
    EXPECT_FALSE(name.ends_with(".bias")) << name << ": Llama has no biases";
  EXPECT_EQ(specs.size(), 1u + 32u * 9u + 2u);
}

TEST(ParameterSpecs, OrderOfOneLayer) {
  const TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  const auto specs = parameter_specs(c);
  std::vector<std::string> names;
  for (const ParamSpec& s : specs) names.push_back(s.name);
  const std::string p = "model.layers.1.";
  const std::vector<std::string> layer = {p + "input_layernorm.weight",
                                          p + "input_layernorm.bias",
                                          p + "self_attn.q_proj.weight",
                                          p + "self_attn.k_proj.weight",
                                          p + "self_attn.v_proj.weight",
                                          p + "self_attn.q_proj.bias",
                                          p + "self_attn.k_proj.bias",
                                          p + "self_attn.v_proj.bias",
                                          p + "self_attn.o_proj.weight",
                                          p + "self_attn.o_proj.bias",
                                          p + "post_attention_layernorm.weight",
                                          p + "post_attention_layernorm.bias",
                                          p + "mlp.up_proj.weight",
                                          p + "mlp.up_proj.bias",
                                          p + "mlp.down_proj.weight",
                                          p + "mlp.down_proj.bias"};
  ASSERT_EQ(names.size(), 2u + 2u * 16u + 2u);
  EXPECT_EQ(names[0], "model.embed_tokens.weight");
  EXPECT_EQ(names[1], "model.embed_positions.weight");
  EXPECT_EQ(std::vector<std::string>(names.begin() + 18, names.begin() + 34), layer);
  EXPECT_EQ(names[34], "model.norm.weight");
  EXPECT_EQ(names[35], "model.norm.bias");
}

TEST(ParameterSpecs, ShardAndDecayFlags) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.add_bias_linear = true;
  const auto specs = by_name(parameter_specs(c));
  const std::string p = "model.layers.0.";
  EXPECT_EQ(specs.at("model.embed_tokens.weight").tp_dim, 0);
  EXPECT_EQ(specs.at("lm_head.weight").tp_dim, 0);
  EXPECT_EQ(specs.at(p + "self_attn.k_proj.weight").tp_dim, 0);
  EXPECT_EQ(specs.at(p + "self_attn.k_proj.bias").tp_dim, 0);
  EXPECT_EQ(specs.at(p + "self_attn.o_proj.weight").tp_dim, 1);
  EXPECT_EQ(specs.at(p + "self_attn.o_proj.bias").tp_dim, -1);
  EXPECT_EQ(specs.at(p + "mlp.gate_proj.weight").tp_dim, 0);
  EXPECT_EQ(specs.at(p + "mlp.down_proj.weight").tp_dim, 1);
  EXPECT_EQ(specs.at(p + "input_layernorm.weight").tp_dim, -1);
  EXPECT_EQ(specs.at("model.norm.weight").tp_dim, -1);
  for (const auto& [name, spec] : specs) {
    const bool matrix = spec.shape.dim() == 2 && !is_embedding(spec);
    EXPECT_EQ(spec.weight_decay, matrix) << name;
    EXPECT_EQ(spec.layer, name.starts_with("model.layers.") ? std::stoi(name.substr(13)) : -1)
        << name;
  }
  EXPECT_TRUE(is_embedding(specs.at("model.embed_tokens.weight")));
  EXPECT_FALSE(is_embedding(specs.at("lm_head.weight")));
}

// add_qkv_bias (Qwen2): biases on q, k and v alone, split over TP like their weights.
TEST(ParameterSpecs, QkvBiasAlone) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.add_qkv_bias = true;
  const auto specs = by_name(parameter_specs(c));
  const std::string p = "model.layers.0.";
  for (const char* proj : {"q_proj", "k_proj", "v_proj"}) {
    const std::string name = p + "self_attn." + proj + ".bias";
    ASSERT_TRUE(specs.contains(name)) << name;
    EXPECT_EQ(specs.at(name).tp_dim, 0) << name;
    EXPECT_EQ(specs.at(name).shape[0], specs.at(p + "self_attn." + proj + ".weight").shape[0]);
    EXPECT_FALSE(specs.at(name).weight_decay) << name;
  }
  for (const char* none :
       {"self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"})
    EXPECT_FALSE(specs.contains(p + none)) << none;
  c.add_bias_linear = true;  // every bias, the q, k, v ones once
  EXPECT_EQ(parameter_specs(c).size(), [&] {
    TransformerConfig all = c;
    all.add_qkv_bias = false;
    return parameter_specs(all).size();
  }());
}

// qk_layernorm (Qwen3): q_norm and k_norm per layer, weight [head_dim] (and a bias with
// layernorm), replicated over TP, not decayed.
TEST(ParameterSpecs, AttentionSinksAndRouterBias) {
  // GPT-OSS's: a sink per query head (split by heads over TP like q_proj, not decayed) and the
  // router's bias (megatron-core's with add_bias_linear, replicated, not decayed).
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.softmax_type = SoftmaxType::learnable;
  c.num_experts = 4;
  c.add_bias_linear = true;
  auto specs = by_name(parameter_specs(c));
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    const ParamSpec& sinks = specs.at(p + "self_attn.sinks");
    EXPECT_EQ(sinks.shape, Shape{c.num_attention_heads});
    EXPECT_EQ(sinks.tp_dim, 0);
    EXPECT_FALSE(sinks.weight_decay);
    const ParamSpec& bias = specs.at(p + "mlp.gate.bias");
    EXPECT_EQ(bias.shape, Shape{c.num_experts});
    EXPECT_EQ(bias.tp_dim, -1);
    EXPECT_FALSE(bias.weight_decay);
  }
  const ParamLayout tp2 = parameter_layout(c, 1, 2);
  bool found = false;
  for (size_t i = 0; i < tp2.specs.size(); ++i) {
    if (tp2.specs[i].name != "model.layers.0.self_attn.sinks") continue;
    found = true;
    EXPECT_EQ(tp2.shards[i].shape, Shape{c.num_attention_heads / 2});
    EXPECT_EQ(tp2.shards[i].start, c.num_attention_heads / 2);
  }
  EXPECT_TRUE(found);
  c.softmax_type = SoftmaxType::off_by_one;  // sinks of 0: no parameter
  c.add_bias_linear = false;
  specs = by_name(parameter_specs(c));
  EXPECT_FALSE(specs.contains("model.layers.0.self_attn.sinks"));
  EXPECT_FALSE(specs.contains("model.layers.0.mlp.gate.bias"));
}

TEST(ParameterSpecs, QkNorms) {
  for (const char* preset : {"llama-tiny", "gpt2-tiny"}) {
    TransformerConfig c = TransformerConfig::preset(preset);
    c.qk_layernorm = true;
    const auto specs = by_name(parameter_specs(c));
    const std::vector<std::string> parts = c.normalization == Normalization::layernorm
                                               ? std::vector<std::string>{"weight", "bias"}
                                               : std::vector<std::string>{"weight"};
    for (int layer = 0; layer < c.num_layers; ++layer)
      for (const char* norm : {"q_norm", "k_norm"})
        for (const std::string& part : parts) {
          const std::string name =
              "model.layers." + std::to_string(layer) + ".self_attn." + norm + "." + part;
          ASSERT_TRUE(specs.contains(name)) << name;
          EXPECT_EQ(specs.at(name).shape, Shape{c.head_dim()}) << name;
          EXPECT_EQ(specs.at(name).tp_dim, -1) << name;
          EXPECT_FALSE(specs.at(name).weight_decay) << name;
        }
  }
}

TEST(ParameterSpecs, LatentAttentionHasDeepSeekV3sNamesAndShapes) {
  // DeepSeek-V3's shape per layer (HF's names and [out, in] layouts): hidden 7168, 128 heads,
  // q latent 1536, kv latent 512, heads of 128 + 64, values of 128.
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.hidden_size = 7168;
  c.num_attention_heads = 128;
  c.num_query_groups = 0;
  c.multi_latent_attention = true;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_head_dim = 128;
  c.qk_pos_emb_head_dim = 64;
  c.v_head_dim = 128;
  c.qk_layernorm = true;
  const auto specs = by_name(parameter_specs(c));
  const std::string a = "model.layers.1.self_attn.";
  const std::vector<std::tuple<std::string, Shape, int>> want = {
      {"q_a_proj.weight", Shape{1536, 7168}, -1},
      {"q_a_layernorm.weight", Shape{1536}, -1},
      {"q_b_proj.weight", Shape{128 * 192, 1536}, 0},
      {"kv_a_proj_with_mqa.weight", Shape{512 + 64, 7168}, -1},
      {"kv_a_layernorm.weight", Shape{512}, -1},
      {"kv_b_proj.weight", Shape{128 * 256, 512}, 0},
      {"o_proj.weight", Shape{7168, 128 * 128}, 1}};
  int64_t attention = 0;
  for (const auto& [name, shape, tp_dim] : want) {
    ASSERT_TRUE(specs.contains(a + name)) << name;
    EXPECT_EQ(specs.at(a + name).shape, shape) << name;
    EXPECT_EQ(specs.at(a + name).tp_dim, tp_dim) << name;
    attention += shape.numel();
  }
  for (const char* gone : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_norm.weight"})
    EXPECT_FALSE(specs.contains(a + gone)) << gone;
  EXPECT_EQ(attention, 187107328);  // DeepSeek-V3's attention parameters per layer
  c.q_lora_rank = 0;                // DeepSeek-V2-Lite: q_proj from the hidden state
  const auto lite = by_name(parameter_specs(c));
  EXPECT_EQ(lite.at(a + "q_proj.weight").shape, (Shape{128 * 192, 7168}));
  EXPECT_FALSE(lite.contains(a + "q_a_proj.weight"));
  EXPECT_FALSE(lite.contains(a + "q_b_proj.weight"));
}

// Multi-token prediction depths follow the last layer with DeepSeek-V3's MTP names (its layer 61
// for 61 layers), of the last layer's kind; the last pipeline chunk holds them and its own
// embed_tokens, untied.
TEST(ParameterSpecs, MultiTokenPredictionDepthsFollowTheLastLayer) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");  // 2 layers, untied, RMSNorm
  c.num_experts = 4;
  c.moe_layers = {0, 1};
  c.mtp_num_layers = 2;
  const auto specs = parameter_specs(c);
  std::vector<std::string> names;
  for (const ParamSpec& s : specs) names.push_back(s.name);
  const auto at = [&](const std::string& name) {
    return std::find(names.begin(), names.end(), name) - names.begin();
  };
  for (int layer : {2, 3}) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    const auto& s = by_name(specs);
    ASSERT_TRUE(s.contains(p + "eh_proj.weight")) << layer;
    EXPECT_EQ(s.at(p + "eh_proj.weight").shape, (Shape{c.hidden_size, 2 * c.hidden_size}));
    EXPECT_EQ(s.at(p + "eh_proj.weight").tp_dim, -1);
    EXPECT_EQ(s.at(p + "eh_proj.weight").layer, layer);
    EXPECT_TRUE(s.contains(p + "mlp.experts.3.down_proj.weight")) << "the last layer's kind";
    EXPECT_LT(at(p + "enorm.weight"), at(p + "hnorm.weight"));
    EXPECT_LT(at(p + "hnorm.weight"), at(p + "eh_proj.weight"));
    EXPECT_LT(at(p + "eh_proj.weight"), at(p + "input_layernorm.weight"));
    EXPECT_LT(at(p + "mlp.gate.weight"), at(p + "shared_head.norm.weight"));
  }
  EXPECT_LT(at("model.layers.1.mlp.gate.weight"), at("model.layers.2.enorm.weight"));
  EXPECT_LT(at("model.layers.3.shared_head.norm.weight"), at("model.norm.weight"));
  EXPECT_TRUE(c.is_moe_layer(3));
  EXPECT_EQ(c.num_moe_layers(), 3);
  c.moe_layers = {1, 0};
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_EQ(c.num_moe_layers(), 1);

  const ParamLayout first = parameter_layout(
      c, 0, 1, {.first_layer = 0, .end_layer = 1, .embedding = true, .head = false});
  const ParamLayout last = parameter_layout(
      c, 0, 1, {.first_layer = 1, .end_layer = 2, .embedding = false, .head = true});
  const auto first_names = by_name(first.specs), last_names = by_name(last.specs);
  EXPECT_FALSE(first_names.contains("model.layers.2.eh_proj.weight"));
  EXPECT_TRUE(last_names.contains("model.layers.3.eh_proj.weight"));
  EXPECT_TRUE(last_names.contains("model.embed_tokens.weight"));
  EXPECT_TRUE(last_names.contains("lm_head.weight"));
  EXPECT_EQ(held_layers_end(first.chunk, c), 1);
  EXPECT_EQ(held_layers_end(last.chunk, c), 4);
  // The depths follow the model's last layer: a head's chunk ending before it is refused.
  EXPECT_THROW(parameter_layout(c, 0, 1, {.first_layer = 0, .end_layer = 1}), ConfigError);
}

TEST(ParameterSpecs, InvalidConfigIsRejected) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.num_query_groups = 3;
  EXPECT_THROW(parameter_specs(c), ConfigError);
}

class FlatBuffer : public ::testing::TestWithParam<std::string> {};

TEST_P(FlatBuffer, ViewsTileTheBufferInOrder) {
  const TransformerConfig c = TransformerConfig::preset(GetParam());
  GPTModel model(c, testing::default_test_device(), 7);
  const ParamLayout& layout = model.layout();
  std::vector<Parameter>& params = model.parameters();
  ASSERT_EQ(params.size(), layout.specs.size());
  const Tensor& flat = model.flat_params();
  const Tensor& grads = model.flat_grads();
  EXPECT_EQ(flat.numel(), layout.num_elements);
  EXPECT_EQ(grads.numel(), layout.num_elements);
  EXPECT_EQ(grads.dtype(), DType::f32);
  EXPECT_EQ(model.num_parameters(), count_parameters(c));
  int64_t end = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const Parameter& p = params[i];
    EXPECT_EQ(p.value.storage(), flat.storage()) << p.spec.name;
    EXPECT_EQ(p.grad.storage(), grads.storage()) << p.spec.name;
    const int64_t offset = int64_t(p.value.offset_bytes() / dtype_size(p.value.dtype()));
    EXPECT_EQ(offset, layout.offsets[i]) << p.spec.name;
    EXPECT_EQ(int64_t(p.grad.offset_bytes() / 4), offset) << p.spec.name;
    EXPECT_EQ(p.value.shape(), p.spec.shape) << p.spec.name;
    EXPECT_GE(offset, end) << p.spec.name << " overlaps its predecessor";
    // A new group starts aligned; a fused member follows its predecessor directly.
    if (offset != end) {
      EXPECT_EQ(offset % kParamGroupAlignment, 0) << p.spec.name;
      EXPECT_LT(offset - end, kParamGroupAlignment) << p.spec.name;
    }
    end = offset + p.spec.shape.numel();
    EXPECT_EQ(&model.parameter(p.spec.name), &p);
  }
  EXPECT_LE(end, layout.num_elements);
  EXPECT_EQ(layout.num_elements % kParamGroupAlignment, 0);
}

TEST_P(FlatBuffer, FusedGroupsAreAdjacentAndOthersAligned) {
  TransformerConfig c = TransformerConfig::preset(GetParam());
  c.add_bias_linear = true;
  c.hidden_size = 40;  // sizes that are not multiples of 64 expose missing alignment
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 72;
  GPTModel model(c, testing::default_test_device(), 7);
  auto offset = [&](const std::string& name) {
    return int64_t(model.parameter(name).value.offset_bytes() / dtype_size(c.params_dtype));
  };
  auto numel = [&](const std::string& name) { return model.parameter(name).value.numel(); };
  const std::string a = "model.layers.1.self_attn.", m = "model.layers.1.mlp.";
  for (const char* kind : {"weight", "bias"}) {
    const std::string q = a + "q_proj." + kind, k = a + "k_proj." + kind, v = a + "v_proj." + kind;
    EXPECT_EQ(offset(q) % kParamGroupAlignment, 0) << q;
    EXPECT_EQ(offset(k), offset(q) + numel(q)) << k;
    EXPECT_EQ(offset(v), offset(k) + numel(k)) << v;
  }
  if (c.activation == Activation::swiglu) {
    for (const char* kind : {"weight", "bias"}) {
      const std::string gate = m + "gate_proj." + kind, up = m + "up_proj." + kind;
      EXPECT_EQ(offset(gate) % kParamGroupAlignment, 0) << gate;
      EXPECT_EQ(offset(up), offset(gate) + numel(gate)) << up;
    }
  }
  for (const Parameter& p : model.parameters()) {
    const std::string& n = p.spec.name;
    const bool member =
        n.find("k_proj") != std::string::npos || n.find("v_proj") != std::string::npos ||
        (c.activation == Activation::swiglu && n.find("up_proj") != std::string::npos);
    if (!member) {
      EXPECT_EQ(offset(n) % kParamGroupAlignment, 0) << n;
    }
  }
}

TEST_P(FlatBuffer, UnknownParameterNameIsAnError) {
  GPTModel model(TransformerConfig::preset(GetParam()), testing::default_test_device(), 7);
  try {
    model.parameter("model.layers.9.self_attn.q_proj.weight");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.9.self_attn.q_proj.weight"),
              std::string::npos);
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, FlatBuffer, ::testing::Values("gpt2-tiny", "llama-tiny"),
                         [](const auto& info) {
                           return info.param == "gpt2-tiny" ? std::string("gpt2")
                                                            : std::string("llama");
                         });

}  // namespace
}  // namespace braid::model
