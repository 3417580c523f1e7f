#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "braid/core/error.h"
#include "braid/model/config.h"

namespace braid::model {
namespace {

// Expects validate() to throw a ConfigError whose message names `field`.
void expect_rejected(const std::function<void(TransformerConfig&)>& edit, const std::string& field,
                     const std::string& preset = "gpt2-tiny") {
  TransformerConfig c = TransformerConfig::preset(preset);
  edit(c);
  try {
    c.validate();
    ADD_FAILURE() << "validate() accepted a config with a bad " << field;
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos)
        << "message does not name " << field << ": " << e.what();
  }
}

TEST(TransformerConfig, PresetsAreValid) {
  ASSERT_EQ(TransformerConfig::preset_names().size(), 4u);
  for (const std::string& name : TransformerConfig::preset_names()) {
    TransformerConfig c = TransformerConfig::preset(name);
    EXPECT_NO_THROW(c.validate()) << name;
  }
}

TEST(TransformerConfig, Gpt2AndLlamaPresetsHaveTheirArchitectures) {
  TransformerConfig g = TransformerConfig::preset("gpt2-124m");
  EXPECT_EQ(g.normalization, Normalization::layernorm);
  EXPECT_EQ(g.activation, Activation::gelu);
  EXPECT_EQ(g.position_embedding, PositionEmbedding::learned);
  EXPECT_TRUE(g.add_bias_linear);
  EXPECT_TRUE(g.tie_embeddings);
  EXPECT_EQ(g.head_dim(), 64);
  EXPECT_EQ(g.kv_heads(), 12);

  TransformerConfig l = TransformerConfig::preset("llama3-8b");
  EXPECT_EQ(l.normalization, Normalization::rmsnorm);
  EXPECT_EQ(l.activation, Activation::swiglu);
  EXPECT_EQ(l.position_embedding, PositionEmbedding::rope);
  EXPECT_FALSE(l.add_bias_linear);
  EXPECT_FALSE(l.tie_embeddings);
  EXPECT_EQ(l.head_dim(), 128);
  EXPECT_EQ(l.kv_heads(), 8);
  EXPECT_EQ(l.rope_theta, 500000.0f);
}

TEST(TransformerConfig, UnknownPresetListsTheValidNames) {
  try {
    TransformerConfig::preset("gpt5");
    ADD_FAILURE() << "no error for an unknown preset";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("gpt5"), std::string::npos) << msg;
    for (const std::string& name : TransformerConfig::preset_names())
      EXPECT_NE(msg.find(name), std::string::npos) << msg;
  }
}

TEST(TransformerConfig, InvalidFieldsAreNamed) {
  expect_rejected([](auto& c) { c.num_layers = 0; }, "num_layers");
  expect_rejected([](auto& c) { c.hidden_size = -64; }, "hidden_size");
  expect_rejected([](auto& c) { c.num_attention_heads = 0; }, "num_attention_heads");
  expect_rejected([](auto& c) { c.num_query_groups = -1; }, "num_query_groups");
  expect_rejected([](auto& c) { c.ffn_hidden_size = 0; }, "ffn_hidden_size");
  expect_rejected([](auto& c) { c.vocab_size = 0; }, "vocab_size");
  expect_rejected([](auto& c) { c.max_position_embeddings = 0; }, "max_position_embeddings");
  expect_rejected([](auto& c) { c.num_attention_heads = 3; }, "num_attention_heads");
  expect_rejected([](auto& c) { c.kv_channels = -1; }, "kv_channels");
  expect_rejected([](auto& c) { c.num_query_groups = 3; }, "num_query_groups", "llama-tiny");
  expect_rejected([](auto& c) { c.norm_eps = 0; }, "norm_eps");
  expect_rejected([](auto& c) { c.init_std = -1; }, "init_std");
  expect_rejected([](auto& c) { c.hidden_dropout = 1.0f; }, "hidden_dropout");
  expect_rejected([](auto& c) { c.attention_dropout = 1.0f; }, "attention_dropout");
  expect_rejected([](auto& c) { c.attention_dropout = -0.1f; }, "attention_dropout");
  expect_rejected([](auto& c) { c.params_dtype = DType::i32; }, "params_dtype");
  expect_rejected([](auto& c) { c.mtp_num_layers = -1; }, "mtp_num_layers", "llama-tiny");
  expect_rejected(
      [](auto& c) {
        c.mtp_num_layers = 1;
        c.mtp_loss_scaling_factor = -0.1f;
      },
      "mtp_loss_scaling_factor", "llama-tiny");
  expect_rejected([](auto& c) { c.mtp_num_layers = 1; }, "learned absolute positions");  // gpt2
  expect_rejected([](auto& c) { c.rope_theta = 0; }, "rope_theta", "llama-tiny");
  expect_rejected([](auto& c) { c.rope_scaling_factor = -8; }, "rope_scaling_factor", "llama-tiny");
  expect_rejected(
      [](auto& c) {
        c.rope_scaling_factor = 8;
        c.rope_low_freq_factor = 4;
        c.rope_high_freq_factor = 1;
      },
      "rope_low_freq_factor", "llama-tiny");
  expect_rejected(
      [](auto& c) {
        c.rope_scaling_factor = 8;
        c.rope_original_max_position_embeddings = 0;
      },
      "rope_original_max_position_embeddings", "llama-tiny");
  expect_rejected([](auto& c) { c.rope_scaling_factor = 8; }, "rope_scaling_factor");  // gpt2
  // rope rotates pairs (i, i + D/2): an odd head dim has no such pairing.
  expect_rejected(
      [](auto& c) {
        c.hidden_size = 60;
        c.num_attention_heads = 4;
      },
      "position_embedding", "llama-tiny");
}

TEST(TransformerConfig, KvChannelsSetTheHeadWidth) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");  // hidden 64, 4 heads
  EXPECT_EQ(c.head_dim(), 16);
  c.kv_channels = 32;  // attention 128 wide on a hidden size of 64 (Qwen3-0.6B's ratio)
  EXPECT_EQ(c.head_dim(), 32);
  c.num_attention_heads = 3;  // hidden need not divide by the heads when the width is given
  c.num_query_groups = 3;
  EXPECT_NO_THROW(c.validate());
  c.kv_channels = 15;  // but RoPE still needs an even one
  expect_rejected([&](auto& r) { r = c; }, "position_embedding");
}

TEST(TransformerConfig, RotaryPercentTurnsTheLeadingChannels) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");  // head dim 16
  EXPECT_EQ(c.rotary_dim(), 16);
  c.rotary_percent = 0.25;  // StableLM's
  EXPECT_EQ(c.rotary_dim(), 4);
  EXPECT_NO_THROW(c.validate());
  expect_rejected([](auto& r) { r.rotary_percent = 0; }, "rotary_percent", "llama-tiny");
  expect_rejected([](auto& r) { r.rotary_percent = 1.5; }, "rotary_percent", "llama-tiny");
  // int(16 x 0.1) = 1 channel: no pair to turn.
  expect_rejected([](auto& r) { r.rotary_percent = 0.1; }, "position_embedding", "llama-tiny");
  expect_rejected([](auto& r) { r.rotary_percent = 0.5; }, "rotary_percent");  // gpt2: no rope
  c.rotary_interleaved = true;  // GPT-J's pairs, on the turned part
  EXPECT_NO_THROW(c.validate());
  expect_rejected([](auto& r) { r.rotary_interleaved = true; }, "rotary_interleaved");  // gpt2
}

TEST(TransformerConfig, SlidingWindowsAndTheLayersTheyApplyTo) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.num_layers = 3;
  EXPECT_EQ(c.attention_window(0), -1);  // no window: every layer sees the whole context
  c.window_size = 4095;                  // Mistral 7B v0.1's (HF sliding_window 4096)
  EXPECT_NO_THROW(c.validate());
  for (int64_t l = 0; l < 3; ++l) EXPECT_EQ(c.attention_window(l), 4095);
  c.window_layers = {1, 0, 1};  // Megatron's --window-attn-skip-freq 2
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.attention_window(0), 4095);
  EXPECT_EQ(c.attention_window(1), -1);
  EXPECT_EQ(c.attention_window(2), 4095);
  c.window_size = 0;  // each query sees only itself: valid
  EXPECT_NO_THROW(c.validate());
  expect_rejected([](auto& r) { r.window_size = -2; }, "window_size");
  expect_rejected([](auto& r) { r.window_layers = {1, 0}; }, "window_layers");  // no window
  expect_rejected(
      [](auto& r) {
        r.window_size = 8;
        r.window_layers = {1, 0, 1};  // llama-tiny has 2 layers
      },
      "one per layer", "llama-tiny");
  expect_rejected(
      [](auto& r) {
        r.window_size = 8;
        r.window_layers = {1, 2};
      },
      "window_layers[1]", "llama-tiny");
}

TEST(TransformerConfig, LatentAttentionRules) {
  auto latent = [](TransformerConfig& c) {
    c.num_query_groups = 0;
    c.multi_latent_attention = true;
    c.qk_head_dim = 8;
    c.qk_pos_emb_head_dim = 4;
    c.v_head_dim = 8;
  };
  TransformerConfig ok = TransformerConfig::preset("llama-tiny");
  latent(ok);
  EXPECT_NO_THROW(ok.validate());
  EXPECT_EQ(ok.head_dim(), 12);
  EXPECT_EQ(ok.value_head_dim(), 8);
  EXPECT_EQ(ok.rotary_dim(), 4);
  EXPECT_EQ(ok.kv_heads(), ok.num_attention_heads);
  auto rejected = [&](const std::function<void(TransformerConfig&)>& edit,
                      const std::string& field) {
    expect_rejected(
        [&](TransformerConfig& c) {
          latent(c);
          edit(c);
        },
        field, "llama-tiny");
  };
  rejected([](TransformerConfig& c) { c.add_bias_linear = true; }, "add_bias_linear");
  rejected([](TransformerConfig& c) { c.add_qkv_bias = true; }, "add_qkv_bias");
  rejected([](TransformerConfig& c) { c.num_query_groups = 2; }, "num_query_groups");
  rejected([](TransformerConfig& c) { c.kv_channels = 16; }, "kv_channels");
  rejected([](TransformerConfig& c) { c.v_head_dim = 13; }, "v_head_dim");
  rejected([](TransformerConfig& c) { c.qk_pos_emb_head_dim = 3; }, "qk_pos_emb_head_dim");
  rejected([](TransformerConfig& c) { c.kv_lora_rank = 0; }, "kv_lora_rank");
  rejected([](TransformerConfig& c) { c.q_lora_rank = -1; }, "q_lora_rank");
  rejected([](TransformerConfig& c) { c.rotary_percent = 0.5; }, "rotary_percent");
  rejected([](TransformerConfig& c) { c.rotary_interleaved = true; }, "rotary_interleaved");
  rejected([](TransformerConfig& c) { c.position_embedding = PositionEmbedding::learned; },
           "position_embedding");
}

TEST(TransformerConfig, YarnRulesAndFactors) {
  // DeepSeek-V3's rope_scaling: factor 40 from 4096 positions, mscale = mscale_all_dim = 1.
  auto yarn = [](TransformerConfig& c) {
    c.rope_yarn_factor = 40;
    c.rope_original_max_position_embeddings = 4096;
    c.rope_yarn_mscale = 1;
    c.rope_yarn_mscale_all_dim = 1;
  };
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  EXPECT_EQ(c.rope_attention_factor(), 1.0f);  // no YaRN
  EXPECT_EQ(c.softmax_scale_factor(), 1.0f);
  yarn(c);
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.rope_attention_factor(), 1.0f);  // g(1) / g(1)
  EXPECT_EQ(c.softmax_scale_factor(), 1.0f);   // without MLA the softmax scale stays
  c.num_query_groups = 0;
  c.multi_latent_attention = true;
  c.qk_head_dim = 8;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 8;
  EXPECT_NO_THROW(c.validate());
  // HF's DeepseekV3Attention: scaling = qk_head_dim^-0.5 x yarn_get_mscale(40, 1)^2, and
  // yarn_get_mscale(40, 1)^2 = (0.1 ln 40 + 1)^2 = 1.8738542070926265 in Python.
  EXPECT_EQ(c.softmax_scale_factor(), float(1.8738542070926265));
  EXPECT_EQ(c.rope_attention_factor(), 1.0f);
  // mscale_all_dim 0 (Megatron's default): cos and sin times g(mscale), the softmax unscaled.
  c.rope_yarn_mscale_all_dim = 0;
  EXPECT_FLOAT_EQ(c.rope_attention_factor(), float(0.1 * std::log(40.0) + 1));
  EXPECT_EQ(c.softmax_scale_factor(), 1.0f);
  // Qwen's rope_scaling (factor 4, no mscale): HF's attention_factor 1.138629436111989.
  TransformerConfig q = TransformerConfig::preset("llama-tiny");
  q.rope_yarn_factor = 4;
  EXPECT_EQ(q.rope_attention_factor(), float(1.138629436111989));
  EXPECT_EQ(q.softmax_scale_factor(), 1.0f);

  auto rejected = [&](const std::function<void(TransformerConfig&)>& edit, const std::string& field,
                      const std::string& preset = "llama-tiny") {
    expect_rejected(
        [&](TransformerConfig& r) {
          yarn(r);
          edit(r);
        },
        field, preset);
  };
  rejected([](TransformerConfig& r) { r.rope_yarn_factor = 0.5f; },
           "rope_yarn_factor must be >= 1");
  rejected([](TransformerConfig& r) { r.rope_yarn_factor = -40; }, "rope_yarn_factor");
  rejected([](TransformerConfig& r) { r.rope_yarn_factor = std::nanf(""); }, "rope_yarn_factor");
  rejected([](TransformerConfig& r) { r.rope_scaling_factor = 8; }, "rope_scaling_factor");
  rejected([](TransformerConfig& r) { r.rope_yarn_beta_slow = 64; }, "rope_yarn_beta_slow (64)");
  rejected([](TransformerConfig& r) { r.rope_yarn_beta_slow = 0; }, "rope_yarn_beta_slow (0)");
  rejected([](TransformerConfig& r) { r.rope_yarn_mscale = -1; }, "rope_yarn_mscale (-1)");
  rejected([](TransformerConfig& r) { r.rope_yarn_mscale_all_dim = INFINITY; },
           "rope_yarn_mscale_all_dim (inf)");
  rejected([](TransformerConfig& r) { r.rope_original_max_position_embeddings = 0; },
           "rope_original_max_position_embeddings");
  rejected([](TransformerConfig&) {}, "rope_yarn_factor needs position_embedding = rope",
           "gpt2-tiny");
}

TEST(TransformerConfig, MixturesAreValid) {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  c.normalization = Normalization::rmsnorm;
  c.activation = Activation::swiglu;
  c.num_query_groups = 2;
  c.tie_embeddings = false;
  EXPECT_NO_THROW(c.validate());
  c = TransformerConfig::preset("llama-tiny");
  c.add_bias_linear = true;
  c.position_embedding = PositionEmbedding::learned;
  c.normalization = Normalization::layernorm;
  EXPECT_NO_THROW(c.validate());
}

TEST(TransformerConfig, GatedActivationRules) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  EXPECT_TRUE(c.gated_activation());
  c.activation = Activation::quick_geglu;
  EXPECT_TRUE(c.gated_activation());
  c.glu_linear_offset = 1.0f;
  c.activation_clamp = 7.0f;
  EXPECT_NO_THROW(c.validate());
  auto error_of = [](const TransformerConfig& config) {
    try {
      config.validate();
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  c.activation_clamp = -1.0f;
  EXPECT_NE(error_of(c).find("activation_clamp"), std::string::npos);
  c.activation_clamp = 7.0f;
  c.activation = Activation::gelu;  // ungated: the offset and clamp have nothing to act on
  EXPECT_FALSE(c.gated_activation());
  EXPECT_NE(error_of(c).find("gated activations"), std::string::npos);
  c.activation = Activation::swiglu;
  c.glu_linear_offset = std::nanf("");
  EXPECT_NE(error_of(c).find("glu_linear_offset"), std::string::npos);
  TransformerConfig mla = TransformerConfig::preset("llama-tiny");
  mla.multi_latent_attention = true;
  mla.num_query_groups = 0;
  mla.softmax_type = SoftmaxType::learnable;
  EXPECT_NE(error_of(mla).find("softmax_type learnable"), std::string::npos);
}

TEST(TransformerConfig, EnumNamesRoundTrip) {
  for (Normalization v : {Normalization::layernorm, Normalization::rmsnorm}) {
    Normalization back =
        v == Normalization::layernorm ? Normalization::rmsnorm : Normalization::layernorm;
    from_string(to_string(v), back);
    EXPECT_EQ(back, v);
  }
  for (Activation v : {Activation::gelu, Activation::swiglu, Activation::squared_relu,
                       Activation::gelu_exact, Activation::quick_geglu}) {
    Activation back = v == Activation::gelu ? Activation::swiglu : Activation::gelu;
    from_string(to_string(v), back);
    EXPECT_EQ(back, v);
  }
  for (PositionEmbedding v : {PositionEmbedding::learned, PositionEmbedding::rope}) {
    PositionEmbedding back =
        v == PositionEmbedding::rope ? PositionEmbedding::learned : PositionEmbedding::rope;
    from_string(to_string(v), back);
    EXPECT_EQ(back, v);
  }
  for (SoftmaxType v : {SoftmaxType::vanilla, SoftmaxType::off_by_one, SoftmaxType::learnable}) {
    SoftmaxType back = v == SoftmaxType::vanilla ? SoftmaxType::learnable : SoftmaxType::vanilla;
    from_string(to_string(v), back);
    EXPECT_EQ(back, v);
  }
  EXPECT_STREQ(to_string(SoftmaxType::off_by_one), "off-by-one");  // Megatron's spelling
  for (Recompute v : {Recompute::none, Recompute::selective, Recompute::full}) {
    Recompute back = v == Recompute::none ? Recompute::full : Recompute::none;
    from_string(to_string(v), back);
    EXPECT_EQ(back, v);
  }
}

TEST(TransformerConfig, UnknownEnumNamesListTheValidOnes) {
  Recompute r;
  try {
    from_string("partial", r);
    ADD_FAILURE() << "no error for an unknown recompute policy";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("partial"), std::string::npos) << msg;
    EXPECT_NE(msg.find("selective"), std::string::npos) << msg;
  }
  Normalization n;
  EXPECT_THROW(from_string("batchnorm", n), ConfigError);
  Activation a;
  EXPECT_THROW(from_string("relu", a), ConfigError);
  PositionEmbedding p;
  EXPECT_THROW(from_string("alibi", p), ConfigError);
}

}  // namespace
}  // namespace braid::model
