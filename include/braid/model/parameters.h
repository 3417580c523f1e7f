#pragma once
// Parameter specs and the flat-buffer layout of one model chunk.
//
// Names are HF Llama-style global names, so HF conversion is a rename; weights are
// [out, in] (HF Linear layout). Flat-buffer order, per model chunk:
//   model.embed_tokens.weight, model.embed_positions.weight (learned positions),
//   per layer i (prefix model.layers.{i}.):
//     input_layernorm.{weight,bias}, self_attn.{q,k,v}_proj.weight, self_attn.{q,k,v}_proj.bias,
//     self_attn.o_proj.{weight,bias}, self_attn.sinks ([heads], split by heads over TP; with
//     SoftmaxType::learnable) (or, with multi-latent attention, DeepSeek-V3's
//     self_attn.q_a_proj.weight, q_a_layernorm.*, q_b_proj.weight (or q_proj.weight without a
//     query latent), kv_a_proj_with_mqa.weight, kv_a_layernorm.*, kv_b_proj.weight and
//     o_proj.weight: the down projections and latent norms replicated over TP, the up
//     projections column-parallel by heads), post_attention_layernorm.{weight,bias},
//     mlp.{gate_proj,up_proj}.weight, mlp.{gate_proj,up_proj}.bias, mlp.down_proj.{weight,bias}
//     or, with experts: mlp.gate.{weight,bias} (the router, [E, H] and [E], replicated over TP),
//     expert j's MLP under mlp.experts.{j}. (the dense MLP's names and shapes, moe_ffn_hidden_size
//     wide), then the shared expert's under mlp.shared_expert. and its gate
//     mlp.shared_expert_gate.weight ([1, H], replicated) when the config has them,
//   model.norm.{weight,bias}, lm_head.weight (absent when embeddings are tied).
// Multi-token prediction depths (config.h) come after the last layer, as layers num_layers + k - 1:
//   enorm.{weight,bias}, hnorm.{weight,bias}, eh_proj.weight ([H, 2H], replicated over TP), the
//   layer's parameters as above, shared_head.norm.{weight,bias}.
// Biases exist when add_bias_linear (q, k and v also with add_qkv_bias; the router's too); q_norm
// and k_norm (weight [head_dim], replicated over TP) with qk_layernorm; norm biases with layernorm;
// gate_proj with a gated activation.
//
// Fused groups are stored back to back with no padding: q/k/v weights (one [q; k; v]
// view is the weight of one GEMM), q/k/v biases, gate/up weights (one GEMM gives
// [gate | up] per row, the layout ops::glu_forward takes) and gate/up biases. Every
// group (a fused group or a single parameter) starts at a multiple of
// kParamGroupAlignment elements. Gradients live in an f32 buffer at the same offsets.
//
// Tensor parallelism (tp ranks): the buffer of rank r holds each parameter's shard
// (ParamShard). Column-parallel parameters (tp_dim 0) keep rows [r·n/tp, (r+1)·n/tp);
// row-parallel ones (tp_dim 1) those columns; replicated ones (tp_dim -1) everything. The
// vocabulary (embed_tokens, lm_head) is split after padding it to a multiple of
// make_vocab_size_divisible_by × tp rows (Megatron's rule); padding rows sit at the end of a
// shard, stay zero, and are outside the parameter's value/grad views. k_proj/v_proj split by
// kv heads when tp divides num_query_groups, and otherwise (num_query_groups divides tp) each
// rank holds the one kv head its query heads read, shared with tp / num_query_groups ranks.

#include <cstdint>
#include <string>
#include <vector>

#include "braid/core/tensor.h"
#include "braid/model/config.h"

namespace braid::model {

constexpr int64_t kParamGroupAlignment = 64;

struct ParamSpec {
  std::string name;
  Shape shape;        // global (unsharded) shape
  int tp_dim = -1;    // -1 replicated, 0 column-parallel (split dim 0), 1 row-parallel (dim 1)
  int layer = -1;     // global layer index; -1 outside the transformer layers
  bool weight_decay;  // true for the weight matrices of linear layers (incl. lm_head)
  int expert = -1;    // j for expert j's parameters (mlp.experts.{j}.*); -1 for the rest
};

// How one TP rank holds a parameter.
struct ParamShard {
  Shape shape;                // what the flat buffer holds (vocabulary padding rows included)
  int64_t start = 0;          // global index, along spec.tp_dim, of the first local row or column
  int64_t padding = 0;        // vocabulary padding: rows at the end of dim 0 that exist on no rank
  int replicas = 1;           // TP ranks holding this same shard (tp for replicated parameters)
  Shape valid_shape() const;  // `shape` without the padding rows
};

struct Parameter {
  ParamSpec spec;
  ParamShard shard;
  Tensor value;  // this rank's shard without padding: view into the flat buffer (params_dtype)
  Tensor grad;   // view into the flat f32 gradient buffer, same element offset
};

// The part of the model one pipeline chunk holds: layers [first_layer, end_layer), the
// embeddings when it is the first chunk, the final norm and the LM head when it is the last.
// The last chunk also holds the MTP depths (layers [end_layer, held_layers_end)). With tied
// embeddings or MTP the last chunk holds its own copy of embed_tokens, the output weight or the
// depths' lookup table (initialised alike; GPTModel::finalize_grads sums the two copies'
// gradients over the embedding group, so they stay equal). The default is the whole model.
// Under expert parallelism a rank holds the experts [first_expert, end_expert) of every expert
// layer (its EP rank's share, ExpertParallel::holding), and each layer's run of expert
// parameters starts and ends at a multiple of expert_alignment elements (the number of shards
// gradient buckets split into - dp · cp, or its lcm with the expert-DP size - so that buckets can
// keep experts apart from the rest).
struct ModelChunk {
  int first_layer = 0;
  int end_layer = -1;  // -1: through the last layer
  bool embedding = true;
  bool head = true;
  int first_expert = 0;
  int end_expert = -1;  // -1: through the last expert
  int64_t expert_alignment = 1;
  // Expert TP 1 under TP > 1 (--expert-tensor-parallel-size 1): every TP rank holds its experts
  // whole (ParamShard: the whole shape, replicas 1) instead of their TP shards.
  bool whole_experts = false;
};

// One past the last layer `chunk` holds: end_layer, and on the last chunk past the MTP depths.
int held_layers_end(const ModelChunk& chunk, const TransformerConfig& config);

// Where each parameter sits in the flat buffer of one TP rank.
struct ParamLayout {
  std::vector<ParamSpec> specs;    // flat-buffer order
  std::vector<ParamShard> shards;  // this rank's shard of specs[i]
  std::vector<int64_t> offsets;    // element offset of shards[i]
  int64_t num_elements = 0;        // buffer size in elements, all padding included
  int64_t num_parameters = 0;      // sum of the specs' global element counts
  int tp_rank = 0;
  int tp_size = 1;
  ModelChunk chunk;  // end_layer resolved
};

// The specs of the whole model in flat-buffer order; allocates nothing, so it works for
// shapes far larger than memory (Llama-3 8B). Validates the config, and the split for tp
// ranks (check_tensor_parallel).
std::vector<ParamSpec> parameter_specs(const TransformerConfig& config);
ParamLayout parameter_layout(const TransformerConfig& config, int tp_rank = 0, int tp_size = 1,
                             const ModelChunk& chunk = {});
int64_t count_parameters(const TransformerConfig& config);

// ConfigError unless the model splits over tp ranks: num_attention_heads, ffn_hidden_size and
// the kv heads (tp divides num_query_groups, or num_query_groups divides tp).
void check_tensor_parallel(const TransformerConfig& config, int tp_size);

// model.embed_tokens.weight and model.embed_positions.weight: excluded from weight decay
// unless the optimizer is asked to decay embeddings.
bool is_embedding(const ParamSpec& spec);
// The vocabulary matrices, model.embed_tokens.weight (every copy) and lm_head.weight: Megatron's
// is_embedding_or_output_parameter (vocab-parallel; --decoupled-lr's parameters).
bool is_embedding_or_output(const ParamSpec& spec);

}  // namespace braid::model
