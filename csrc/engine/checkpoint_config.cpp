#include "engine/checkpoint_config.h"

#include <utility>

#include "braid/core/dtype.h"
#include "braid/core/error.h"

namespace braid::engine {

nlohmann::json config_json(const model::TransformerConfig& c) {
  return nlohmann::json{
      {"num_layers", c.num_layers},
      {"hidden_size", c.hidden_size},
      {"num_attention_heads", c.num_attention_heads},
      {"num_query_groups", c.kv_heads()},
      {"kv_channels", c.head_dim()},
      {"ffn_hidden_size", c.ffn_hidden_size},
      {"vocab_size", c.vocab_size},
      {"max_position_embeddings", c.max_position_embeddings},
      {"normalization", model::to_string(c.normalization)},
      {"activation", model::to_string(c.activation)},
      {"position_embedding", model::to_string(c.position_embedding)},
      {"add_bias_linear", c.add_bias_linear},
      {"add_qkv_bias", c.add_qkv_bias},
      {"qk_layernorm", c.qk_layernorm},
      {"zero_centered_gamma", c.zero_centered_gamma},
      {"tie_embeddings", c.tie_embeddings},
      {"mtp_num_layers", c.mtp_num_layers},
      {"mtp_loss_scaling_factor", c.mtp_loss_scaling_factor},
      {"rope_theta", c.rope_theta},
      {"rope_scaling_factor", c.rope_scaling_factor},
      {"rope_low_freq_factor", c.rope_low_freq_factor},
      {"rope_high_freq_factor", c.rope_high_freq_factor},
      {"rope_original_max_position_embeddings", c.rope_original_max_position_embeddings},
      {"rope_yarn_factor", c.rope_yarn_factor},
      {"rope_yarn_beta_fast", c.rope_yarn_beta_fast},
      {"rope_yarn_beta_slow", c.rope_yarn_beta_slow},
      {"rope_yarn_mscale", c.rope_yarn_mscale},
      {"rope_yarn_mscale_all_dim", c.rope_yarn_mscale_all_dim},
      {"rope_linear_factor", c.rope_linear_factor},
      {"rotary_percent", c.rotary_percent},
      {"rotary_interleaved", c.rotary_interleaved},
      {"rope_yarn_truncate", c.rope_yarn_truncate},
      {"softmax_type", model::to_string(c.softmax_type)},
      {"glu_linear_offset", c.glu_linear_offset},
      {"activation_clamp", c.activation_clamp},
      {"window_size", c.window_size},
      {"window_layers", c.window_layers},
      {"num_experts", c.num_experts},
      {"moe_router_topk", c.moe_router_topk},
      {"moe_ffn_hidden_size", c.num_experts > 0 ? c.mlp_hidden_size() : 0},
      {"moe_router_pre_softmax", c.moe_router_pre_softmax},
      {"moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size},
      {"moe_shared_expert_gate", c.moe_shared_expert_gate},
      {"moe_layers", c.moe_layers},
      {"moe_router_score_function", model::to_string(c.moe_router_score_function)},
      {"moe_router_enable_expert_bias", c.moe_router_enable_expert_bias},
      {"moe_router_num_groups", c.moe_router_num_groups},
      {"moe_router_group_topk", c.moe_router_group_topk},
      {"moe_router_topk_scaling_factor", c.moe_router_topk_scaling_factor},
      {"moe_expert_capacity_factor", c.moe_expert_capacity_factor},
      {"moe_token_drop_policy", model::to_string(c.moe_token_drop_policy)},
      {"norm_eps", c.norm_eps},
      {"params_dtype", dtype_name(c.params_dtype)},
      {"multi_latent_attention", c.multi_latent_attention},
      {"q_lora_rank", c.q_lora_rank},
      {"kv_lora_rank", c.kv_lora_rank},
      {"qk_head_dim", c.qk_head_dim},
      {"qk_pos_emb_head_dim", c.qk_pos_emb_head_dim},
      {"v_head_dim", c.v_head_dim}};
}

int format_version(const model::TransformerConfig& c) {
  const bool new_router =
      c.num_experts > 0 &&
      (c.moe_router_score_function != model::MoeScoreFunction::softmax ||
       c.moe_router_enable_expert_bias || c.moe_router_num_groups > 0 ||
       c.moe_router_topk_scaling_factor != 1.0f || c.moe_expert_capacity_factor > 0);
  // A version-6 reader would run these as other numerics, or miss the router's bias.
  if (c.softmax_type != model::SoftmaxType::vanilla ||
      c.activation == model::Activation::quick_geglu || c.glu_linear_offset != 0 ||
      c.activation_clamp != 0 || (c.rope_yarn_factor > 0 && !c.rope_yarn_truncate) ||
      (c.num_experts > 0 && c.add_bias_linear))
    return 7;
  // A version-5 reader would ignore the interleaving and pair RoPE's channels as rotate_half.
  if (c.rotary_interleaved && !c.multi_latent_attention) return 6;
  // A version-4 reader would ignore the linear interpolation and turn RoPE by whole positions.
  if (c.rope_linear_factor > 0) return 5;
  // A version-3 reader would ignore the MTP depths' tensors and train without them.
  if (c.mtp_num_layers > 0) return 4;
  // A version-2 reader would ignore YaRN's fields and run the model with plain RoPE.
  if (c.multi_latent_attention || c.rope_yarn_factor > 0) return 3;
  return new_router ? 2 : 1;
}

void check_same_model(const nlohmann::json& saved, const model::TransformerConfig& config,
                      const std::string& where) {
  const nlohmann::json mine = config_json(config);
  for (const char* key :
       {"num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
        "vocab_size", "max_position_embeddings", "normalization", "activation",
        "position_embedding", "add_bias_linear", "tie_embeddings"}) {
    BRAID_CONFIG_CHECK(saved.contains(key), where, ": the saved config has no ", key);
    BRAID_CONFIG_CHECK(saved.at(key) == mine.at(key), where, ": a different model - ", key, " is ",
                       saved.at(key).dump(), " in the checkpoint and ", mine.at(key).dump(),
                       " in this run");
  }
  // Checkpoints from before MTP have none.
  const int64_t saved_mtp = saved.value("mtp_num_layers", int64_t(0));
  BRAID_CONFIG_CHECK(saved_mtp == config.mtp_num_layers, where,
                     ": a different model - mtp_num_layers (--mtp-num-layers) is ", saved_mtp,
                     " in the checkpoint and ", config.mtp_num_layers, " in this run");
  // Checkpoints from before kv_channels had hidden_size / num_attention_heads.
  const int64_t saved_head_dim =
      saved.value("kv_channels", saved.at("hidden_size").get<int64_t>() /
                                     saved.at("num_attention_heads").get<int64_t>());
  BRAID_CONFIG_CHECK(saved_head_dim == config.head_dim(), where,
                     ": a different model - kv_channels (the head width) is ", saved_head_dim,
                     " in the checkpoint and ", config.head_dim(), " in this run");
  // Checkpoints from before rotary_interleaved paired channels as rotate_half.
  const bool saved_interleaved = saved.value("rotary_interleaved", false);
  BRAID_CONFIG_CHECK(saved_interleaved == config.rotary_interleaved, where,
                     ": a different model - rotary_interleaved (--rotary-interleaved) is ",
                     saved_interleaved ? "true" : "false", " in the checkpoint and ",
                     config.rotary_interleaved ? "true" : "false",
                     " in this run (RoPE pairs its channels otherwise)");
  // Checkpoints from before softmax_type have the vanilla softmax; off-by-one and learnable
  // sinks are different models (the learnable ones are tensors of the checkpoint).
  const std::string saved_softmax = saved.value("softmax_type", std::string("vanilla"));
  BRAID_CONFIG_CHECK(saved_softmax == model::to_string(config.softmax_type), where,
                     ": a different model - softmax_type (--softmax-type) is ", saved_softmax,
                     " in the checkpoint and ", model::to_string(config.softmax_type),
                     " in this run");
  // Checkpoints from before rotary_percent turned whole heads. Percents that turn as many
  // channels are the same model.
  // MLA turns its qk_pos_emb_head_dim channels (compared with the other MLA fields below).
  const double saved_rotary = saved.value("rotary_percent", 1.0);
  const auto saved_rotary_dim = saved.value("multi_latent_attention", false)
                                    ? saved.value("qk_pos_emb_head_dim", int64_t(0))
                                    : int64_t(double(saved_head_dim) * saved_rotary);
  BRAID_CONFIG_CHECK(saved_rotary_dim == config.rotary_dim(), where,
                     ": a different model - rotary_percent is ", saved_rotary,
                     " in the checkpoint and ", config.rotary_percent, " in this run (RoPE turns ",
                     saved_rotary_dim, " and ", config.rotary_dim(), " channels of each head)");
  // Checkpoints from before experts are dense.
  const int64_t saved_experts = saved.value("num_experts", int64_t(0));
  BRAID_CONFIG_CHECK(saved_experts == config.num_experts, where,
                     ": a different model - num_experts is ", saved_experts,
                     " in the checkpoint and ", config.num_experts, " in this run");
  if (saved_experts > 0) {
    const int64_t saved_ffn = saved.value("moe_ffn_hidden_size", int64_t(0));
    BRAID_CONFIG_CHECK(saved_ffn == config.mlp_hidden_size(), where,
                       ": a different model - moe_ffn_hidden_size is ", saved_ffn,
                       " in the checkpoint and ", config.mlp_hidden_size(), " in this run");
    const int64_t saved_shared = saved.value("moe_shared_expert_intermediate_size", int64_t(0));
    BRAID_CONFIG_CHECK(saved_shared == config.moe_shared_expert_intermediate_size, where,
                       ": a different model - moe_shared_expert_intermediate_size is ",
                       saved_shared, " in the checkpoint and ",
                       config.moe_shared_expert_intermediate_size, " in this run");
    std::vector<int64_t> saved_layers, mine_layers;
    for (int64_t l = 0; l < config.num_layers; ++l) mine_layers.push_back(config.is_moe_layer(l));
    const auto listed = saved.value("moe_layers", std::vector<int64_t>{});
    BRAID_CONFIG_CHECK(listed.empty() || int64_t(listed.size()) == config.num_layers, where,
                       ": moe_layers has ", listed.size(), " entries for ", config.num_layers,
                       " layers");
    for (int64_t l = 0; l < config.num_layers; ++l)
      saved_layers.push_back(listed.empty() ? 1 : listed[size_t(l)]);
    BRAID_CONFIG_CHECK(saved_layers == mine_layers, where,
                       ": a different model - the layers with experts (moe_layers) are ",
                       nlohmann::json(saved_layers).dump(), " in the checkpoint and ",
                       nlohmann::json(mine_layers).dump(), " in this run");
    const bool saved_gate = saved.value("moe_shared_expert_gate", false);
    BRAID_CONFIG_CHECK(saved_gate == config.moe_shared_expert_gate, where,
                       ": a different model - moe_shared_expert_gate is ",
                       saved_gate ? "true" : "false", " in the checkpoint and ",
                       config.moe_shared_expert_gate ? "true" : "false", " in this run");
    // The expert biases are tensors of the checkpoint: with and without them are different
    // models (the score function and the groups are settings, like the top k).
    const bool saved_bias = saved.value("moe_router_enable_expert_bias", false);
    BRAID_CONFIG_CHECK(saved_bias == config.moe_router_enable_expert_bias, where,
                       ": a different model - moe_router_enable_expert_bias is ",
                       saved_bias ? "true" : "false", " in the checkpoint and ",
                       config.moe_router_enable_expert_bias ? "true" : "false", " in this run");
  }
  // Checkpoints from before multi-latent attention have none.
  const bool saved_mla = saved.value("multi_latent_attention", false);
  BRAID_CONFIG_CHECK(saved_mla == config.multi_latent_attention, where,
                     ": a different model - multi_latent_attention is ",
                     saved_mla ? "true" : "false", " in the checkpoint and ",
                     config.multi_latent_attention ? "true" : "false", " in this run");
  if (saved_mla) {
    for (const char* key :
         {"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"}) {
      BRAID_CONFIG_CHECK(saved.value(key, int64_t(-1)) == mine.at(key).get<int64_t>(), where,
                         ": a different model - ", key, " is ",
                         saved.value(key, nlohmann::json()).dump(), " in the checkpoint and ",
                         mine.at(key).dump(), " in this run");
    }
  }
  // Checkpoints from before these fields have neither.
  for (const auto& [key, mine_value] :
       {std::pair{"add_qkv_bias", config.add_qkv_bias},
        std::pair{"qk_layernorm", config.qk_layernorm},
        std::pair{"zero_centered_gamma", config.zero_centered_gamma}}) {
    const bool saved_value = saved.value(key, false);
    BRAID_CONFIG_CHECK(saved_value == mine_value, where, ": a different model - ", key, " is ",
                       saved_value ? "true" : "false", " in the checkpoint and ",
                       mine_value ? "true" : "false", " in this run");
  }
}

}  // namespace braid::engine
