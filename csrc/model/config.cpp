#include "braid/model/config.h"

#include <algorithm>
#include <cmath>

#include "braid/core/error.h"

namespace braid::model {
namespace {

template <typename Enum, size_t N>
void enum_from_string(std::string_view name, const char* what, const Enum (&values)[N], Enum& out) {
  std::string valid;
  for (Enum value : values) {
    if (name == to_string(value)) {
      out = value;
      return;
    }
    valid += std::string(valid.empty() ? "" : ", ") + to_string(value);
  }
  throw ConfigError(
      detail::concat("unknown ", what, " '", name, "' (expected one of: ", valid, ")"), __FILE__,
      __LINE__);
}

void check_positive(int64_t value, const char* field) {
  BRAID_CONFIG_CHECK(value > 0, "TransformerConfig.", field, " must be positive, got ", value);
}

}  // namespace

const char* to_string(Normalization value) {
  return value == Normalization::layernorm ? "layernorm" : "rmsnorm";
}

const char* to_string(Activation value) {
  switch (value) {
    case Activation::gelu:
      return "gelu";
    case Activation::swiglu:
      return "swiglu";
    case Activation::squared_relu:
      return "squared_relu";
    case Activation::gelu_exact:
      return "gelu_exact";
    case Activation::quick_geglu:
      return "quick_geglu";
  }
  return "?";
}

const char* to_string(SoftmaxType value) {
  switch (value) {
    case SoftmaxType::vanilla:
      return "vanilla";
    case SoftmaxType::off_by_one:
      return "off-by-one";
    case SoftmaxType::learnable:
      return "learnable";
  }
  return "?";
}

void from_string(std::string_view name, SoftmaxType& out) {
  static constexpr SoftmaxType kAll[] = {SoftmaxType::vanilla, SoftmaxType::off_by_one,
                                         SoftmaxType::learnable};
  enum_from_string(name, "softmax_type", kAll, out);
}

const char* to_string(PositionEmbedding value) {
  return value == PositionEmbedding::learned ? "learned" : "rope";
}

const char* to_string(Recompute value) {
  switch (value) {
    case Recompute::none:
      return "none";
    case Recompute::selective:
      return "selective";
    case Recompute::full:
      return "full";
  }
  return "?";
}

const char* to_string(RecomputeMethod value) {
  switch (value) {
    case RecomputeMethod::uniform:
      return "uniform";
    case RecomputeMethod::block:
      return "block";
  }
  return "?";
}

const char* to_string(MoeScoreFunction value) {
  return value == MoeScoreFunction::softmax ? "softmax" : "sigmoid";
}

const char* to_string(MoeLoadBalancing value) {
  return value == MoeLoadBalancing::aux_loss ? "aux_loss" : "seq_aux_loss";
}

const char* to_string(MoeTokenDropPolicy value) {
  return value == MoeTokenDropPolicy::probs ? "probs" : "position";
}

void from_string(std::string_view name, MoeTokenDropPolicy& out) {
  static constexpr MoeTokenDropPolicy kAll[] = {MoeTokenDropPolicy::probs,
                                                MoeTokenDropPolicy::position};
  enum_from_string(name, "moe_token_drop_policy", kAll, out);
}

void from_string(std::string_view name, MoeScoreFunction& out) {
  static constexpr MoeScoreFunction kAll[] = {MoeScoreFunction::softmax, MoeScoreFunction::sigmoid};
  enum_from_string(name, "moe_router_score_function", kAll, out);
}

void from_string(std::string_view name, MoeLoadBalancing& out) {
  static constexpr MoeLoadBalancing kAll[] = {MoeLoadBalancing::aux_loss,
                                              MoeLoadBalancing::seq_aux_loss};
  enum_from_string(name, "moe_router_load_balancing_type", kAll, out);
}

void from_string(std::string_view name, Normalization& out) {
  static constexpr Normalization kAll[] = {Normalization::layernorm, Normalization::rmsnorm};
  enum_from_string(name, "normalization", kAll, out);
}

void from_string(std::string_view name, Activation& out) {
  static constexpr Activation kAll[] = {Activation::gelu, Activation::swiglu,
                                        Activation::squared_relu, Activation::gelu_exact,
                                        Activation::quick_geglu};
  enum_from_string(name, "activation", kAll, out);
}

void from_string(std::string_view name, PositionEmbedding& out) {
  static constexpr PositionEmbedding kAll[] = {PositionEmbedding::learned, PositionEmbedding::rope};
  enum_from_string(name, "position_embedding", kAll, out);
}

void from_string(std::string_view name, Recompute& out) {
  static constexpr Recompute kAll[] = {Recompute::none, Recompute::selective, Recompute::full};
  enum_from_string(name, "recompute", kAll, out);
}

void from_string(std::string_view name, RecomputeMethod& out) {
  static constexpr RecomputeMethod kAll[] = {RecomputeMethod::uniform, RecomputeMethod::block};
  enum_from_string(name, "recompute_method", kAll, out);
}

int64_t TransformerConfig::head_dim() const {
  BRAID_CONFIG_CHECK(num_attention_heads > 0, "TransformerConfig.num_attention_heads must be ",
                     "positive, got ", num_attention_heads);
  if (multi_latent_attention) return qk_head_dim + qk_pos_emb_head_dim;
  return kv_channels > 0 ? kv_channels : hidden_size / num_attention_heads;
}

int64_t TransformerConfig::rotary_dim() const {
  if (multi_latent_attention) return qk_pos_emb_head_dim;
  return int64_t(double(head_dim()) * rotary_percent);
}

int64_t TransformerConfig::value_head_dim() const {
  return multi_latent_attention ? v_head_dim : head_dim();
}

int64_t TransformerConfig::attention_window(int64_t layer) const {
  if (window_size < 0) return -1;
  if (window_layers.empty()) return window_size;
  return window_layers[size_t(kind_of_layer(layer))] != 0 ? window_size : -1;
}

bool TransformerConfig::gated_activation() const {
  return activation == Activation::swiglu || activation == Activation::quick_geglu;
}

int64_t TransformerConfig::mlp_hidden_size() const {
  return num_experts > 0 && moe_ffn_hidden_size > 0 ? moe_ffn_hidden_size : ffn_hidden_size;
}

bool TransformerConfig::is_moe_layer(int64_t layer) const {
  if (num_experts == 0) return false;
  if (moe_layers.empty()) return true;
  return moe_layers[size_t(kind_of_layer(layer))] != 0;
}

int64_t TransformerConfig::kind_of_layer(int64_t layer) const {
  BRAID_CHECK(layer >= 0 && layer < num_layers + mtp_num_layers, "layer ", layer,
              " is not one of the model's ", num_layers, " layers and ", mtp_num_layers,
              " MTP depths");
  return std::min(layer, num_layers - 1);
}

int64_t TransformerConfig::num_moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers + mtp_num_layers; ++l) n += is_moe_layer(l);
  return n;
}

int64_t TransformerConfig::kv_heads() const {
  return num_query_groups == 0 || multi_latent_attention ? num_attention_heads : num_query_groups;
}

int64_t TransformerConfig::padded_vocab_size(int tp_size) const {
  const int64_t multiple = make_vocab_size_divisible_by * tp_size;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

namespace {

// The rules multi-latent attention adds (TransformerConfig's comment on multi_latent_attention).
void validate_latent_attention(const TransformerConfig& c) {
  BRAID_CONFIG_CHECK(c.q_lora_rank >= 0, "TransformerConfig.q_lora_rank must be >= 0 (0: no ",
                     "query latent), got ", c.q_lora_rank);
  check_positive(c.kv_lora_rank, "kv_lora_rank");
  check_positive(c.qk_head_dim, "qk_head_dim");
  check_positive(c.v_head_dim, "v_head_dim");
  BRAID_CONFIG_CHECK(c.qk_pos_emb_head_dim > 0 && c.qk_pos_emb_head_dim % 2 == 0,
                     "TransformerConfig.qk_pos_emb_head_dim must be even and positive, got ",
                     c.qk_pos_emb_head_dim);
  BRAID_CONFIG_CHECK(c.v_head_dim <= c.head_dim(), "TransformerConfig.v_head_dim (", c.v_head_dim,
                     ") must not exceed the query/key head, qk_head_dim + qk_pos_emb_head_dim (",
                     c.head_dim(), "): braid's attention runs the value heads padded to it");
  BRAID_CONFIG_CHECK(c.position_embedding == PositionEmbedding::rope && c.rotary_percent == 1.0,
                     "TransformerConfig.multi_latent_attention needs position_embedding = rope ",
                     "(its qk_pos_emb_head_dim channels turn) and rotary_percent 1");
  BRAID_CONFIG_CHECK(!c.add_bias_linear && !c.add_qkv_bias,
                     "TransformerConfig.multi_latent_attention has no linear biases: set ",
                     "add_bias_linear and add_qkv_bias off (Megatron's --disable-bias-linear)");
  BRAID_CONFIG_CHECK(c.num_query_groups == 0 || c.num_query_groups == c.num_attention_heads,
                     "TransformerConfig.num_query_groups (", c.num_query_groups,
                     ") must be 0 or num_attention_heads (", c.num_attention_heads,
                     ") with multi_latent_attention: every head has its own key and value");
  BRAID_CONFIG_CHECK(c.kv_channels == 0, "TransformerConfig.kv_channels (", c.kv_channels,
                     ") must be 0 with multi_latent_attention: qk_head_dim, ",
                     "qk_pos_emb_head_dim and v_head_dim give the heads' widths");
}

// The rules YaRN adds (HF's _validate_yarn_rope_parameters' warnings, as errors).
void validate_yarn(const TransformerConfig& c) {
  BRAID_CONFIG_CHECK(c.rope_scaling_factor == 0,
                     "TransformerConfig.rope_yarn_factor and rope_scaling_factor (Llama 3.1's) ",
                     "exclude each other, got ", c.rope_yarn_factor, " and ",
                     c.rope_scaling_factor);
  BRAID_CONFIG_CHECK(c.rope_yarn_factor >= 1 && std::isfinite(c.rope_yarn_factor),
                     "TransformerConfig.rope_yarn_factor must be >= 1 and finite (0: no YaRN), ",
                     "got ", c.rope_yarn_factor);
  BRAID_CONFIG_CHECK(0 < c.rope_yarn_beta_slow && c.rope_yarn_beta_slow <= c.rope_yarn_beta_fast &&
                         std::isfinite(c.rope_yarn_beta_fast),
                     "TransformerConfig.rope_yarn_beta_slow (", c.rope_yarn_beta_slow,
                     ") must be positive and at most rope_yarn_beta_fast (", c.rope_yarn_beta_fast,
                     ")");
  BRAID_CONFIG_CHECK(
      c.rope_yarn_mscale >= 0 && std::isfinite(c.rope_yarn_mscale) &&
          c.rope_yarn_mscale_all_dim >= 0 && std::isfinite(c.rope_yarn_mscale_all_dim),
      "TransformerConfig.rope_yarn_mscale (", c.rope_yarn_mscale,
      ") and rope_yarn_mscale_all_dim (", c.rope_yarn_mscale_all_dim, ") must be >= 0 and finite");
  BRAID_CONFIG_CHECK(c.rope_original_max_position_embeddings > 0,
                     "TransformerConfig.rope_original_max_position_embeddings must be positive, "
                     "got ",
                     c.rope_original_max_position_embeddings);
}

// YaRN's get_mscale (HF's, megatron-core's _yarn_get_mscale), in double as Python's.
double yarn_mscale(double factor, double mscale) {
  return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

}  // namespace

float TransformerConfig::rope_attention_factor() const {
  if (rope_yarn_factor == 0) return 1.0f;
  return float(yarn_mscale(rope_yarn_factor, rope_yarn_mscale) /
               yarn_mscale(rope_yarn_factor, rope_yarn_mscale_all_dim));
}

float TransformerConfig::softmax_scale_factor() const {
  if (rope_yarn_factor == 0 || !multi_latent_attention) return 1.0f;
  const double m = yarn_mscale(rope_yarn_factor, rope_yarn_mscale_all_dim);
  return float(m * m);
}

void TransformerConfig::validate() const {
  check_positive(num_layers, "num_layers");
  check_positive(hidden_size, "hidden_size");
  check_positive(num_attention_heads, "num_attention_heads");
  BRAID_CONFIG_CHECK(num_query_groups >= 0, "TransformerConfig.num_query_groups must be >= 0 ",
                     "(0: one group per head), got ", num_query_groups);
  check_positive(ffn_hidden_size, "ffn_hidden_size");
  check_positive(vocab_size, "vocab_size");
  check_positive(max_position_embeddings, "max_position_embeddings");
  check_positive(make_vocab_size_divisible_by, "make_vocab_size_divisible_by");
  check_positive(recompute_num_layers, "recompute_num_layers");
  BRAID_CONFIG_CHECK(kv_channels >= 0, "TransformerConfig.kv_channels must be >= 0 ",
                     "(0: hidden_size / num_attention_heads), got ", kv_channels);
  if (multi_latent_attention) validate_latent_attention(*this);
  BRAID_CONFIG_CHECK(
      kv_channels > 0 || multi_latent_attention || hidden_size % num_attention_heads == 0,
      "TransformerConfig.hidden_size (", hidden_size,
      ") must be divisible by num_attention_heads (", num_attention_heads,
      "), or kv_channels must give the head width");
  BRAID_CONFIG_CHECK(num_attention_heads % kv_heads() == 0,
                     "TransformerConfig.num_attention_heads (", num_attention_heads,
                     ") must be divisible by num_query_groups (", kv_heads(), ")");
  if (position_embedding == PositionEmbedding::rope) {
    BRAID_CONFIG_CHECK(rotary_percent > 0 && rotary_percent <= 1,
                       "TransformerConfig.rotary_percent must be in (0, 1], got ", rotary_percent);
    BRAID_CONFIG_CHECK(rotary_dim() % 2 == 0 && rotary_dim() > 0,
                       "TransformerConfig.position_embedding = rope needs an even, nonzero number ",
                       "of rotated channels (the head dim ", head_dim(), " x rotary_percent ",
                       rotary_percent, "), got ", rotary_dim());
    BRAID_CONFIG_CHECK(rope_theta > 0 && std::isfinite(rope_theta),
                       "TransformerConfig.rope_theta must be positive and finite, got ",
                       rope_theta);
    BRAID_CONFIG_CHECK(rope_scaling_factor >= 0 && std::isfinite(rope_scaling_factor),
                       "TransformerConfig.rope_scaling_factor must be positive (0: no scaling), "
                       "got ",
                       rope_scaling_factor);
    BRAID_CONFIG_CHECK(rope_scaling_factor == 0 || (0 < rope_low_freq_factor &&
                                                    rope_low_freq_factor < rope_high_freq_factor &&
                                                    std::isfinite(rope_high_freq_factor)),
                       "TransformerConfig.rope_low_freq_factor (", rope_low_freq_factor,
                       ") must be positive and below rope_high_freq_factor (",
                       rope_high_freq_factor, ")");
    BRAID_CONFIG_CHECK(rope_scaling_factor == 0 || rope_original_max_position_embeddings > 0,
                       "TransformerConfig.rope_original_max_position_embeddings must be positive, "
                       "got ",
                       rope_original_max_position_embeddings);
    if (rope_yarn_factor != 0) validate_yarn(*this);
    BRAID_CONFIG_CHECK(rope_linear_factor >= 0 && std::isfinite(rope_linear_factor),
                       "TransformerConfig.rope_linear_factor must be positive and finite (0: no "
                       "interpolation), got ",
                       rope_linear_factor);
    BRAID_CONFIG_CHECK(
        rope_linear_factor == 0 || (rope_scaling_factor == 0 && rope_yarn_factor == 0),
        "TransformerConfig.rope_linear_factor (", rope_linear_factor,
        ") excludes Llama 3.1's rope_scaling_factor (", rope_scaling_factor,
        ") and rope_yarn_factor (", rope_yarn_factor, ")");
  } else {
    BRAID_CONFIG_CHECK(rope_scaling_factor == 0,
                       "TransformerConfig.rope_scaling_factor needs "
                       "position_embedding = rope");
    BRAID_CONFIG_CHECK(rope_yarn_factor == 0,
                       "TransformerConfig.rope_yarn_factor needs position_embedding = rope");
    BRAID_CONFIG_CHECK(rope_linear_factor == 0,
                       "TransformerConfig.rope_linear_factor needs position_embedding = rope");
    BRAID_CONFIG_CHECK(rotary_percent == 1.0,
                       "TransformerConfig.rotary_percent needs position_embedding = rope");
    BRAID_CONFIG_CHECK(!rotary_interleaved,
                       "TransformerConfig.rotary_interleaved needs position_embedding = rope");
  }
  BRAID_CONFIG_CHECK(!(multi_latent_attention && rotary_interleaved),
                     "TransformerConfig.rotary_interleaved with multi_latent_attention: MLA's RoPE "
                     "pairs are interleaved already");
  BRAID_CONFIG_CHECK(window_size >= -1,
                     "TransformerConfig.window_size must be >= 0 (the keys before each query a "
                     "windowed layer sees) or -1 (no window), got ",
                     window_size);
  BRAID_CONFIG_CHECK(window_layers.empty() || window_size >= 0,
                     "TransformerConfig.window_layers needs a window_size");
  BRAID_CONFIG_CHECK(window_layers.empty() || int64_t(window_layers.size()) == num_layers,
                     "TransformerConfig.window_layers has ", window_layers.size(),
                     " entries; it needs one per layer (", num_layers, ")");
  for (size_t l = 0; l < window_layers.size(); ++l) {
    BRAID_CONFIG_CHECK(window_layers[l] == 0 || window_layers[l] == 1,
                       "TransformerConfig.window_layers[", l, "] is ", window_layers[l],
                       "; each entry is 1 (window) or 0 (full attention)");
  }
  BRAID_CONFIG_CHECK(num_experts >= 0 && num_experts <= 1024,
                     "TransformerConfig.num_experts must be in [0, 1024] (0: a dense MLP), got ",
                     num_experts);
  if (num_experts > 0) {
    BRAID_CONFIG_CHECK(moe_router_topk >= 1 && moe_router_topk <= num_experts,
                       "TransformerConfig.moe_router_topk must be in [1, num_experts = ",
                       num_experts, "], got ", moe_router_topk);
    BRAID_CONFIG_CHECK(moe_ffn_hidden_size >= 0,
                       "TransformerConfig.moe_ffn_hidden_size must be >= 0 (0: ffn_hidden_size), "
                       "got ",
                       moe_ffn_hidden_size);
    BRAID_CONFIG_CHECK(moe_aux_loss_coeff >= 0 && std::isfinite(moe_aux_loss_coeff),
                       "TransformerConfig.moe_aux_loss_coeff must be >= 0 and finite, got ",
                       moe_aux_loss_coeff);
    BRAID_CONFIG_CHECK(
        moe_expert_capacity_factor >= 0 && std::isfinite(moe_expert_capacity_factor),
        "TransformerConfig.moe_expert_capacity_factor must be >= 0 and finite (0: dropless), got ",
        moe_expert_capacity_factor);
    BRAID_CONFIG_CHECK(moe_z_loss_coeff >= 0 && std::isfinite(moe_z_loss_coeff),
                       "TransformerConfig.moe_z_loss_coeff must be >= 0 and finite, got ",
                       moe_z_loss_coeff);
    BRAID_CONFIG_CHECK(
        moe_router_topk_scaling_factor > 0 && std::isfinite(moe_router_topk_scaling_factor),
        "TransformerConfig.moe_router_topk_scaling_factor must be > 0 and finite, got ",
        moe_router_topk_scaling_factor);
    BRAID_CONFIG_CHECK(
        moe_router_bias_update_rate >= 0 && std::isfinite(moe_router_bias_update_rate),
        "TransformerConfig.moe_router_bias_update_rate must be >= 0 and finite, got ",
        moe_router_bias_update_rate);
    BRAID_CONFIG_CHECK(
        !moe_router_enable_expert_bias || moe_router_score_function == MoeScoreFunction::sigmoid,
        "TransformerConfig.moe_router_enable_expert_bias needs the sigmoid score function (as "
        "Megatron's)");
    BRAID_CONFIG_CHECK(
        !moe_router_pre_softmax || moe_router_score_function == MoeScoreFunction::softmax,
        "TransformerConfig.moe_router_pre_softmax is for the softmax score function");
    if (moe_router_num_groups > 0 || moe_router_group_topk > 0) {
      const int64_t g = moe_router_num_groups, gk = moe_router_group_topk;
      BRAID_CONFIG_CHECK(g >= 1 && num_experts % g == 0,
                         "TransformerConfig.moe_router_num_groups must divide num_experts = ",
                         num_experts, ", got ", g);
      BRAID_CONFIG_CHECK(gk >= 1 && gk <= g && moe_router_topk % gk == 0,
                         "TransformerConfig.moe_router_group_topk must be in [1, "
                         "moe_router_num_groups = ",
                         g, "] and divide moe_router_topk = ", moe_router_topk, ", got ", gk);
      BRAID_CONFIG_CHECK(moe_router_topk / gk <= num_experts / g,
                         "TransformerConfig: each of the moe_router_group_topk = ", gk,
                         " groups scores its best moe_router_topk / group_topk = ",
                         moe_router_topk / gk, " experts, more than a group's ", num_experts / g);
    }
    BRAID_CONFIG_CHECK(moe_shared_expert_intermediate_size >= 0,
                       "TransformerConfig.moe_shared_expert_intermediate_size must be >= 0 (0: no "
                       "shared expert), got ",
                       moe_shared_expert_intermediate_size);
  }
  BRAID_CONFIG_CHECK(moe_layers.empty() || num_experts > 0,
                     "TransformerConfig.moe_layers needs num_experts");
  BRAID_CONFIG_CHECK(moe_layers.empty() || int64_t(moe_layers.size()) == num_layers,
                     "TransformerConfig.moe_layers has ", moe_layers.size(),
                     " entries for num_layers = ", num_layers, " (one per layer, or none)");
  for (size_t l = 0; l < moe_layers.size(); ++l) {
    BRAID_CONFIG_CHECK(moe_layers[l] == 0 || moe_layers[l] == 1, "TransformerConfig.moe_layers[", l,
                       "] is ", moe_layers[l], "; each entry is 1 (experts) or 0 (dense MLP)");
  }
  BRAID_CONFIG_CHECK(num_experts > 0 || moe_shared_expert_intermediate_size == 0,
                     "TransformerConfig.moe_shared_expert_intermediate_size needs num_experts");
  BRAID_CONFIG_CHECK(moe_shared_expert_intermediate_size > 0 || !moe_shared_expert_gate,
                     "TransformerConfig.moe_shared_expert_gate needs a shared expert "
                     "(moe_shared_expert_intermediate_size)");
  BRAID_CONFIG_CHECK(!recompute_mla_up_proj || multi_latent_attention,
                     "TransformerConfig.recompute_mla_up_proj (--recompute-modules mla_up_proj) ",
                     "needs multi-latent attention");
  BRAID_CONFIG_CHECK(mtp_num_layers >= 0, "TransformerConfig.mtp_num_layers must be >= 0 (0: no ",
                     "multi-token prediction), got ", mtp_num_layers);
  BRAID_CONFIG_CHECK(std::isfinite(mtp_loss_scaling_factor) && mtp_loss_scaling_factor >= 0,
                     "TransformerConfig.mtp_loss_scaling_factor must be finite and >= 0, got ",
                     mtp_loss_scaling_factor);
  BRAID_CONFIG_CHECK(mtp_num_layers == 0 || position_embedding != PositionEmbedding::learned,
                     "multi-token prediction (mtp_num_layers = ", mtp_num_layers,
                     ") needs rotary positions: with learned absolute positions each depth would ",
                     "read shifted position ids, which braid does not implement");
  BRAID_CONFIG_CHECK(norm_eps > 0 && std::isfinite(norm_eps),
                     "TransformerConfig.norm_eps must be positive and finite, got ", norm_eps);
  BRAID_CONFIG_CHECK(init_std > 0 && std::isfinite(init_std),
                     "TransformerConfig.init_std must be positive and finite, got ", init_std);
  BRAID_CONFIG_CHECK(embedding_init_std >= 0 && std::isfinite(embedding_init_std),
                     "TransformerConfig.embedding_init_std must be positive and finite (0: "
                     "init_std), got ",
                     embedding_init_std);
  BRAID_CONFIG_CHECK(std::isfinite(glu_linear_offset),
                     "TransformerConfig.glu_linear_offset must be finite, got ", glu_linear_offset);
  BRAID_CONFIG_CHECK(activation_clamp >= 0 && std::isfinite(activation_clamp),
                     "TransformerConfig.activation_clamp must be >= 0 and finite (0: no clamp), "
                     "got ",
                     activation_clamp);
  BRAID_CONFIG_CHECK(gated_activation() || (glu_linear_offset == 0 && activation_clamp == 0),
                     "TransformerConfig.glu_linear_offset and activation_clamp (Megatron's "
                     "--glu-linear-offset, --activation-func-clamp-value) are for gated "
                     "activations (swiglu, quick_geglu), not ",
                     to_string(activation));
  BRAID_CONFIG_CHECK(softmax_type == SoftmaxType::vanilla || !multi_latent_attention,
                     "TransformerConfig.softmax_type ", to_string(softmax_type),
                     " with multi_latent_attention: braid's multi-latent attention computes the "
                     "vanilla softmax only");
  BRAID_CONFIG_CHECK(hidden_dropout >= 0 && hidden_dropout < 1,
                     "TransformerConfig.hidden_dropout must be in [0, 1), got ", hidden_dropout);
  BRAID_CONFIG_CHECK(attention_dropout >= 0 && attention_dropout < 1,
                     "TransformerConfig.attention_dropout must be in [0, 1), got ",
                     attention_dropout);
  BRAID_CONFIG_CHECK(params_dtype == DType::f32 || params_dtype == DType::bf16,
                     "TransformerConfig.params_dtype must be f32 or bf16, got ",
                     dtype_name(params_dtype));
}

std::vector<std::string> TransformerConfig::preset_names() {
  return {"gpt2-tiny", "llama-tiny", "gpt2-124m", "llama3-8b"};
}

TransformerConfig TransformerConfig::preset(const std::string& name) {
  TransformerConfig gpt2;  // defaults are GPT-2's numerics
  gpt2.normalization = Normalization::layernorm;
  gpt2.activation = Activation::gelu;
  gpt2.position_embedding = PositionEmbedding::learned;
  gpt2.add_bias_linear = true;
  gpt2.tie_embeddings = true;

  TransformerConfig llama;
  llama.normalization = Normalization::rmsnorm;
  llama.activation = Activation::swiglu;
  llama.position_embedding = PositionEmbedding::rope;
  llama.add_bias_linear = false;
  llama.tie_embeddings = false;

  // layers, hidden, heads, query groups, ffn, vocab, positions
  auto shaped = [](TransformerConfig base, int64_t layers, int64_t hidden, int64_t heads,
                   int64_t groups, int64_t ffn, int64_t vocab, int64_t positions) {
    base.num_layers = layers;
    base.hidden_size = hidden;
    base.num_attention_heads = heads;
    base.num_query_groups = groups;
    base.ffn_hidden_size = ffn;
    base.vocab_size = vocab;
    base.max_position_embeddings = positions;
    return base;
  };
  if (name == "gpt2-tiny") return shaped(gpt2, 2, 64, 4, 0, 256, 256, 128);
  if (name == "llama-tiny") return shaped(llama, 2, 64, 4, 2, 192, 256, 128);
  if (name == "gpt2-124m") return shaped(gpt2, 12, 768, 12, 0, 3072, 50257, 1024);
  if (name == "llama3-8b") {
    TransformerConfig config = shaped(llama, 32, 4096, 32, 8, 14336, 128256, 8192);
    config.rope_theta = 500000.0f;
    return config;
  }
  std::string valid;
  for (const std::string& n : preset_names()) valid += (valid.empty() ? "" : ", ") + n;
  throw ConfigError(
      detail::concat("unknown TransformerConfig preset '", name, "' (valid: ", valid, ")"),
      __FILE__, __LINE__);
}

}  // namespace braid::model
