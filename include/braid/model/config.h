#pragma once
// TransformerConfig: the shape and numerics of a GPT-2 / Llama style decoder, and the
// presets braid ships. Every field is checked by validate(), which throws ConfigError
// naming the field and the rule it broke.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "braid/core/dtype.h"

namespace braid::model {

enum class Normalization { layernorm, rmsnorm };
// gelu: GPT-2's (tanh form; Megatron's fused bias-GELU, --openai-gelu); gelu_exact: x Phi(x)
// with erf (megatron-core's unfused GELU, torch's F.gelu, HF "gelu"); swiglu: silu(gate) * up
// (Llama); squared_relu: relu(x)^2 (Nemotron-4, Megatron's --squared-relu), ungated like gelu;
// quick_geglu: gate sigmoid(1.702 gate) * up (Megatron's --quick-geglu; GPT-OSS's experts).
// swiglu and quick_geglu are gated (ops::glu_forward; glu_linear_offset, activation_clamp).
enum class Activation { gelu, swiglu, squared_relu, gelu_exact, quick_geglu };
// Each attention head's softmax (Megatron's --softmax-type): vanilla; off_by_one, one more logit
// of 0 in every row that weighs no value (softmax_1, "attention is off by one"); learnable, that
// logit a parameter per head (GPT-OSS's attention sinks, self_attn.sinks [heads]).
enum class SoftmaxType { vanilla, off_by_one, learnable };
enum class PositionEmbedding { learned, rope };
// How a router scores experts from its logits (Megatron's --moe-router-score-function).
enum class MoeScoreFunction { softmax, sigmoid };
// Which tokens a load-balancing loss balances over (Megatron's --moe-router-load-balancing-type):
// each microbatch's (aux_loss), or each sequence's, averaged over the microbatch (seq_aux_loss).
enum class MoeLoadBalancing { aux_loss, seq_aux_loss };
// Which of an expert's tokens past its capacity are dropped (Megatron's --moe-token-drop-policy):
// those of the lowest routing probabilities, or the last ones in token order.
enum class MoeTokenDropPolicy { probs, position };
// What a layer keeps for its backward (see transformer_layer.h for the exact lists).
enum class Recompute { none, selective, full };
// Which layers Recompute::full recomputes (Megatron's --recompute-method), per model chunk:
// uniform - the chunk's layers in groups of recompute_num_layers; only each group's input is
//           kept, and the backward reruns the whole group's forward (1: every layer alone);
// block   - the first recompute_num_layers layers (input only); the others keep everything.
enum class RecomputeMethod { uniform, block };

struct TransformerConfig {
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_query_groups = 0;  // key/value heads; 0 means num_attention_heads (no GQA)
  // Each query, key and value head's width (Megatron's --kv-channels, HF's head_dim);
  // 0 means hidden_size / num_attention_heads. Qwen3-0.6B, say, has 16 heads of 128 on a
  // hidden size of 1024: its attention is 2048 wide.
  int64_t kv_channels = 0;
  int64_t ffn_hidden_size = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  Normalization normalization = Normalization::layernorm;
  Activation activation = Activation::gelu;
  PositionEmbedding position_embedding = PositionEmbedding::learned;
  float rope_theta = 10000.0f;
  // Llama 3.1's RoPE frequency scaling (HF rope_type "llama3"; Megatron's --use-rope-scaling
  // --rope-scaling-factor), ops::RotaryFrequencies' rule; factor 0: none.
  float rope_scaling_factor = 0.0f;
  float rope_low_freq_factor = 1.0f;
  float rope_high_freq_factor = 4.0f;
  // The context the model was pretrained on: L of Llama 3.1's scaling and of YaRN's.
  int64_t rope_original_max_position_embeddings = 8192;
  // YaRN (HF rope_scaling "yarn": factor, beta_fast, beta_slow, mscale, mscale_all_dim;
  // Megatron's --rope-type yarn --rotary-scaling-factor --mscale --mscale-all-dim, with
  // megatron-core's betas; DeepSeek-V3's long context), ops::RotaryFrequencies' rule; factor 0:
  // none.
  // With g(m) = 0.1 m ln(factor) + 1, cos and sin are multiplied by rope_attention_factor(), and
  // with multi_latent_attention the softmax scale by softmax_scale_factor().
  float rope_yarn_factor = 0.0f;
  float rope_yarn_beta_fast = 32.0f;
  float rope_yarn_beta_slow = 1.0f;
  float rope_yarn_mscale = 1.0f;
  float rope_yarn_mscale_all_dim = 0.0f;
  // Linear position interpolation (HF rope_type "linear"; Megatron's
  // --rotary-seq-len-interpolation-factor): positions divided by the factor, as HF computes it
  // (ops::RotaryFrequencies::linear_factor); 0: none. At most one of the three scalings.
  float rope_linear_factor = 0.0f;
  // The fraction of each head RoPE turns: its first int(head_dim x rotary_percent) channels
  // (Megatron's --rotary-percent, HF's partial_rotary_factor: StableLM, GPT-NeoX, Phi).
  double rotary_percent = 1.0;
  // RoPE's channel pairs: false, HF Llama's rotate_half (channel i with i + R/2); true, GPT-J's
  // interleaved pairs (2i with 2i + 1; Megatron's --rotary-interleaved). Multi-latent attention
  // always interleaves (DeepSeek's).
  bool rotary_interleaved = false;
  // YaRN's correction range: floored and ceiled (true; DeepSeek's, HF's default) or kept
  // fractional (false; GPT-OSS's rope_parameters truncate: false, megatron-core's
  // correction_range_round_to_int False); ops::RotaryFrequencies::yarn_truncate.
  bool rope_yarn_truncate = true;
  float norm_eps = 1e-5f;
  bool add_bias_linear = true;
  // Biases on the query, key and value projections alone (Qwen2's; Megatron's --add-qkv-bias);
  // add_bias_linear gives them too.
  bool add_qkv_bias = false;
  // A norm (the model's normalization, weight [head_dim]) on every query and key head after
  // the projection, before RoPE (Qwen3's q_norm / k_norm; Megatron's --qk-layernorm).
  bool qk_layernorm = false;
  // Multi-latent attention (DeepSeek-V2/V3's; Megatron's --multi-latent-attention, its flag and
  // HF names): keys and values come from one compressed latent per token, c_kv = norm(x W_kv_a)
  // of kv_lora_rank (kv_a_proj_with_mqa, kv_a_layernorm), expanded per head by kv_b_proj into
  // qk_head_dim "nope" key channels and v_head_dim value channels; queries from x directly
  // (q_proj) or, with q_lora_rank > 0, through their own latent (q_a_proj, q_a_layernorm,
  // q_b_proj). Every head's query and key is qk_head_dim nope channels then
  // qk_pos_emb_head_dim RoPE channels (interleaved pairs, as DeepSeek's); the key's RoPE part is
  // one per token (kv_a_proj_with_mqa's last rows), shared by every head. With MLA,
  // qk_layernorm means the two latent norms (Megatron's), num_query_groups is the head count
  // and head_dim() is qk_head_dim + qk_pos_emb_head_dim.
  bool multi_latent_attention = false;
  int64_t q_lora_rank = 0;  // 0: q_proj straight from the hidden state
  int64_t kv_lora_rank = 32;
  int64_t qk_head_dim = 128;         // HF's qk_nope_head_dim
  int64_t qk_pos_emb_head_dim = 64;  // HF's qk_rope_head_dim
  int64_t v_head_dim = 128;
  // Every norm's weight holds gamma - 1: the norms scale by 1 + weight, and the weights start at
  // zero (Megatron's --apply-layernorm-1p, megatron-core's layernorm_zero_centered_gamma).
  bool zero_centered_gamma = false;
  bool tie_embeddings = true;
  // The gated activations' act(gate) * (up + glu_linear_offset), with the gate clamped to at
  // most activation_clamp and up to [-activation_clamp, activation_clamp] when that is > 0
  // (Megatron's --glu-linear-offset and --activation-func-clamp-value; GPT-OSS's 1 and
  // swiglu_limit 7); ops::GluSpec.
  float glu_linear_offset = 0.0f;
  float activation_clamp = 0.0f;
  SoftmaxType softmax_type = SoftmaxType::vanilla;
  // Sliding-window attention (Megatron's --window-size W,0): on a windowed layer each query sees
  // itself and the window_size keys before it (HF's sliding_window is window_size + 1: Mistral
  // v0.1's 4096 is 4095 here). -1: no window.
  int64_t window_size = -1;
  // Which layers are windowed, one entry per layer, 1: window, 0: full attention (the list form
  // of Megatron's --window-attn-skip-freq; Qwen2's max_window_layers, HF's layer_types). Empty:
  // every layer. Only with window_size >= 0.
  std::vector<int64_t> window_layers;
  // Mixture of experts (Megatron's --num-experts; Mixtral, Qwen3-MoE, OLMoE): every layer's MLP
  // is num_experts MLPs of moe_ffn_hidden_size (0: ffn_hidden_size) of which a router (a
  // [num_experts, hidden] linear layer, with a bias when add_bias_linear, Megatron's) picks
  // moe_router_topk per token; their outputs are summed weighted by the router's probabilities
  // (ops::moe_router_forward; with moe_router_pre_softmax the softmax runs over all experts before
  // the top k). Dropless: every expert takes every token routed to it. moe_aux_loss_coeff > 0 adds
  // the Switch Transformer load-balancing loss, as Megatron's aux_loss. 0 experts: a dense MLP.
  int64_t num_experts = 0;
  int64_t moe_router_topk = 2;
  int64_t moe_ffn_hidden_size = 0;
  bool moe_router_pre_softmax = false;
  float moe_aux_loss_coeff = 0.0f;
  MoeLoadBalancing moe_router_load_balancing_type = MoeLoadBalancing::aux_loss;
  // DeepSeek-V3's router (ops::MoeRouterSpec has the arithmetic): sigmoid scores; the experts
  // picked from the moe_router_group_topk best of moe_router_num_groups groups (0: no groups);
  // probabilities times moe_router_topk_scaling_factor (DeepSeek's routed_scaling_factor).
  MoeScoreFunction moe_router_score_function = MoeScoreFunction::softmax;
  int64_t moe_router_num_groups = 0;
  int64_t moe_router_group_topk = 0;
  float moe_router_topk_scaling_factor = 1.0f;
  // Auxiliary-loss-free balancing (Megatron's --moe-router-enable-expert-bias, DeepSeek-V3's
  // e_score_correction_bias): an f32 bias per expert, added to the scores for the choice only,
  // moved after every step by moe_router_bias_update_rate towards the experts that got fewer
  // than the mean of the step's tokens (GPTModel::update_expert_bias).
  bool moe_router_enable_expert_bias = false;
  float moe_router_bias_update_rate = 1e-3f;
  // Token dropping (Megatron's --moe-expert-capacity-factor, GShard's and Switch's): each expert
  // takes at most ceil(T · k / E · factor) of the T tokens a rank routes in a microbatch, the
  // others by moe_token_drop_policy are dropped: that choice of the token adds nothing and gets
  // no gradient. 0: dropless. T is every token of the microbatch under TP (Megatron's routers see
  // their sequence-parallel shard: its capacities are per TP rank, braid's do not depend on the
  // TP size) and this rank's share under CP (per rank, as Megatron's). Tokens are ordered as
  // Megatron's are, position-major ([S, B]), for the position policy and the probs policy's
  // ties. A double, as Megatron's (1.1 as a float would round some capacities up). KV-cache
  // decoding is dropless.
  double moe_expert_capacity_factor = 0.0;
  MoeTokenDropPolicy moe_token_drop_policy = MoeTokenDropPolicy::probs;
  // The router z-loss (ST-MoE; Megatron's --moe-z-loss-coeff): coeff x the mean over tokens of
  // logsumexp(logits)^2, per expert layer and microbatch. 0: none.
  float moe_z_loss_coeff = 0.0f;
  // A shared expert every token goes through besides its routed ones: an MLP of this hidden size
  // (0: none; Megatron's --moe-shared-expert-intermediate-size, Qwen2-MoE's and DeepSeek's),
  // with moe_shared_expert_gate its output scaled by sigmoid(x w), w [1, H] (Qwen2-MoE's
  // shared_expert_gate, Megatron's --moe-shared-expert-gate).
  int64_t moe_shared_expert_intermediate_size = 0;
  bool moe_shared_expert_gate = false;
  // Which layers have experts, one entry per layer, 1: experts, 0: the dense MLP of
  // ffn_hidden_size (the list form of Megatron's --moe-layer-freq; DeepSeek's first dense layers,
  // Qwen3-MoE's mlp_only_layers). Empty: every layer. Only with num_experts > 0.
  std::vector<int64_t> moe_layers;
  float init_std = 0.02f;
  // The std of the word and position embeddings' normal init (Megatron's
  // --embedding-init-method-std); 0: init_std.
  float embedding_init_std = 0.0f;
  float hidden_dropout = 0.0f;
  float attention_dropout = 0.0f;  // of the softmax probabilities (ops::AttentionDropout)
  DType params_dtype = DType::f32;
  // The vocabulary is padded to a multiple of this × tensor-parallel size (Megatron's rule).
  int64_t make_vocab_size_divisible_by = 128;
  // Multi-token prediction (DeepSeek-V3's; Megatron's --mtp-num-layers and
  // --mtp-loss-scaling-factor, megatron-core's MultiTokenPredictionBlock): mtp_num_layers depths
  // after the model's last layer, on its last pipeline stage. Depth k (1-based) reads the ids
  // and targets shifted left by k (the last k positions get id 0 and no target) and
  // h_0 = the final norm's output: h_k = shared_head.norm(layer(eh_proj([enorm(embed(ids_k)) |
  // hnorm(h_{k-1})]))), one transformer layer of the last layer's kind, as layer
  // num_layers + k - 1 (HF DeepSeek-V3's names: model.layers.{i}.enorm, .hnorm, .eh_proj,
  // .shared_head.norm), and its loss is the shared output head's cross-entropy on the targets
  // shifted by k. Training adds mtp_loss_scaling_factor / mtp_num_layers × each depth's summed
  // cross-entropy over the main loss's token count (Megatron's per-token loss); evaluation,
  // logits() and decode() run the main head alone. 0: none. Not with learned positions.
  int64_t mtp_num_layers = 0;
  float mtp_loss_scaling_factor = 0.1f;
  Recompute recompute = Recompute::none;
  RecomputeMethod recompute_method = RecomputeMethod::uniform;  // with Recompute::full
  int64_t recompute_num_layers = 1;                             // >= 1
  // With Recompute::selective and multi-latent attention, also recompute the up projections and
  // RoPE (megatron-core's --recompute-modules mla_up_proj): the layer keeps the latents and the
  // rotated k_pe instead of every head's q, k and v, and the backward projects them again.
  bool recompute_mla_up_proj = false;

  void validate() const;
  // The width of each query and key head (and of the value heads but with MLA): kv_channels,
  // or hidden_size / num_attention_heads when that is 0; qk_head_dim + qk_pos_emb_head_dim
  // with MLA.
  int64_t head_dim() const;
  // num_query_groups, or num_attention_heads when that is 0 (and with MLA).
  int64_t kv_heads() const;
  // The channels RoPE turns: int(head_dim() x rotary_percent); qk_pos_emb_head_dim with MLA.
  int64_t rotary_dim() const;
  // The width of each value head: head_dim(), or v_head_dim with MLA.
  int64_t value_head_dim() const;
  // YaRN's factor on RoPE's cos and sin: g(rope_yarn_mscale) / g(rope_yarn_mscale_all_dim)
  // (megatron-core's; HF's when mscale_all_dim is set or mscale is 1), 1 without YaRN.
  float rope_attention_factor() const;
  // The factor on multi-latent attention's softmax scale 1/sqrt(head_dim()):
  // g(rope_yarn_mscale_all_dim)^2 with YaRN (HF's DeepseekV3Attention, megatron-core's MLA),
  // else 1 (and without MLA: HF's other YaRN models keep their softmax scale).
  float softmax_scale_factor() const;
  // The attention window of layer `layer` (0-based): window_size on a windowed layer, else -1.
  int64_t attention_window(int64_t layer) const;
  // Whether the MLP activation is gated (swiglu, quick_geglu): fc1 is [gate; up].
  bool gated_activation() const;
  // The hidden size of each expert: moe_ffn_hidden_size, or ffn_hidden_size.
  int64_t mlp_hidden_size() const;
  // Whether layer `layer` (0-based; num_layers + k - 1 is MTP depth k's, of the last layer's
  // kind) has experts; num_moe_layers() counts them, MTP's included.
  bool is_moe_layer(int64_t layer) const;
  int64_t num_moe_layers() const;
  // The layer's index among the main layers whose kind (experts, window) it has: MTP depths
  // take the last layer's.
  int64_t kind_of_layer(int64_t layer) const;
  // Whether the last pipeline stage holds its own embed_tokens: tied to the output weight, or
  // read by the MTP depths.
  bool head_uses_embedding() const { return tie_embeddings || mtp_num_layers > 0; }
  int64_t padded_vocab_size(int tp_size = 1) const;

  // "gpt2-tiny", "llama-tiny", "gpt2-124m", "llama3-8b"; ConfigError listing the valid names.
  static TransformerConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
};

// Names as they appear in configs and on the command line ("layernorm", "swiglu", "rope",
// "selective", ...). from_string throws ConfigError listing the valid names.
const char* to_string(Normalization value);
const char* to_string(Activation value);
const char* to_string(PositionEmbedding value);
const char* to_string(Recompute value);
const char* to_string(RecomputeMethod value);
const char* to_string(MoeScoreFunction value);
const char* to_string(MoeLoadBalancing value);
const char* to_string(MoeTokenDropPolicy value);
const char* to_string(SoftmaxType value);
void from_string(std::string_view name, SoftmaxType& out);
void from_string(std::string_view name, Normalization& out);
void from_string(std::string_view name, MoeScoreFunction& out);
void from_string(std::string_view name, MoeLoadBalancing& out);
void from_string(std::string_view name, MoeTokenDropPolicy& out);
void from_string(std::string_view name, Activation& out);
void from_string(std::string_view name, PositionEmbedding& out);
void from_string(std::string_view name, Recompute& out);
void from_string(std::string_view name, RecomputeMethod& out);

}  // namespace braid::model
