#include "braid/model/parameters.h"

#include <algorithm>
#include <numeric>
#include <string>

namespace braid::model {
namespace {

// Accumulates specs and this rank's shards group by group, padding every group to
// kParamGroupAlignment.
class LayoutBuilder {
 public:
  LayoutBuilder(ParamLayout& layout, const TransformerConfig& config)
      : layout_(layout),
        config_(config),
        tp_(layout.tp_size),
        rank_(layout.tp_rank),
        whole_experts_(layout.chunk.whole_experts) {}

  // Starts a new group (aligned) and adds its first member.
  void group(ParamSpec spec) {
    layout_.num_elements = align(layout_.num_elements);
    member(std::move(spec));
  }
  // Adds a member right after the previous one (a fused group).
  void member(ParamSpec spec) {
    ParamShard shard = shard_of(spec);
    layout_.offsets.push_back(layout_.num_elements);
    layout_.num_elements += shard.shape.numel();
    layout_.num_parameters += spec.shape.numel();
    layout_.specs.push_back(std::move(spec));
    layout_.shards.push_back(std::move(shard));
  }
  void finish() { layout_.num_elements = align(layout_.num_elements); }
  // The next parameter starts at a multiple of `multiple` (and of kParamGroupAlignment).
  void align_to(int64_t multiple) {
    const int64_t step = std::lcm(kParamGroupAlignment, multiple);
    layout_.num_elements = (layout_.num_elements + step - 1) / step * step;
  }

 private:
  static int64_t align(int64_t n) {
    return (n + kParamGroupAlignment - 1) / kParamGroupAlignment * kParamGroupAlignment;
  }

  static Shape with_dim(const Shape& shape, int dim, int64_t size) {
    std::vector<int64_t> dims(shape.begin(), shape.end());
    dims[size_t(dim)] = size;
    return Shape(std::span<const int64_t>(dims));
  }

  ParamShard shard_of(const ParamSpec& spec) const {
    ParamShard s;
    if (spec.expert >= 0 && whole_experts_) {
      s.shape = spec.shape;  // no TP rank holds the same experts as another
      return s;
    }
    if (spec.tp_dim < 0 || tp_ == 1) {
      s.shape = spec.shape;
      s.replicas = spec.tp_dim < 0 ? tp_ : 1;
      if (is_embedding_or_output(spec)) pad_vocab(s, spec);
      return s;
    }
    const int64_t global = spec.shape[spec.tp_dim];
    if (is_embedding_or_output(spec)) return pad_vocab(s, spec);
    if (is_kv(spec) && tp_ > config_.kv_heads()) {  // each rank holds its query heads' kv head
      const int64_t d = config_.head_dim();
      const int sharing = tp_ / int(config_.kv_heads());
      s.shape = with_dim(spec.shape, 0, d);
      s.start = (rank_ / sharing) * d;
      s.replicas = sharing;
      return s;
    }
    const int64_t local = global / tp_;
    s.shape = with_dim(spec.shape, spec.tp_dim, local);
    s.start = rank_ * local;
    return s;
  }

  ParamShard& pad_vocab(ParamShard& s, const ParamSpec& spec) const {
    const int64_t rows = config_.padded_vocab_size(tp_) / tp_;
    s.shape = with_dim(spec.shape, 0, rows);
    s.start = rank_ * rows;
    s.padding = rows - std::clamp<int64_t>(spec.shape[0] - s.start, 0, rows);
    return s;
  }

  static bool is_kv(const ParamSpec& spec) {
    return spec.name.find("self_attn.k_proj.") != std::string::npos ||
           spec.name.find("self_attn.v_proj.") != std::string::npos;
  }

  ParamLayout& layout_;
  const TransformerConfig& config_;
  int tp_, rank_;
  bool whole_experts_;
};

void add_norm(LayoutBuilder& b, const TransformerConfig& c, const std::string& prefix, int layer,
              int64_t size) {
  b.group({prefix + ".weight", Shape{size}, -1, layer, false});
  if (c.normalization == Normalization::layernorm)
    b.group({prefix + ".bias", Shape{size}, -1, layer, false});
}

void add_norm(LayoutBuilder& b, const TransformerConfig& c, const std::string& prefix, int layer) {
  add_norm(b, c, prefix, layer, c.hidden_size);
}

// One MLP of hidden size f (the dense one, an expert, the shared expert) under `prefix`:
// gate_proj (gated activations), up_proj, down_proj.
// `expert`: the expert's index (ParamSpec::expert), -1 for the others.
void add_mlp(LayoutBuilder& b, const TransformerConfig& c, const std::string& p, int layer,
             int64_t f, int expert = -1) {
  const int64_t h = c.hidden_size;
  const bool bias = c.add_bias_linear;
  if (c.gated_activation()) {
    b.group({p + "gate_proj.weight", Shape{f, h}, 0, layer, true, expert});
    b.member({p + "up_proj.weight", Shape{f, h}, 0, layer, true, expert});
    if (bias) {
      b.group({p + "gate_proj.bias", Shape{f}, 0, layer, false, expert});
      b.member({p + "up_proj.bias", Shape{f}, 0, layer, false, expert});
    }
  } else {
    b.group({p + "up_proj.weight", Shape{f, h}, 0, layer, true, expert});
    if (bias) b.group({p + "up_proj.bias", Shape{f}, 0, layer, false, expert});
  }
  b.group({p + "down_proj.weight", Shape{h, f}, 1, layer, true, expert});
  if (bias) b.group({p + "down_proj.bias", Shape{h}, -1, layer, false, expert});
}

// q, k, v (fused), their biases, the per-head q/k norms and o_proj under `p` (self_attn.).
void add_attention(LayoutBuilder& b, const TransformerConfig& c, const std::string& p, int layer) {
  const int64_t h = c.hidden_size;
  const int64_t q_out = c.num_attention_heads * c.head_dim();
  const int64_t kv_out = c.kv_heads() * c.head_dim();
  const bool bias = c.add_bias_linear;
  b.group({p + "q_proj.weight", Shape{q_out, h}, 0, layer, true});
  b.member({p + "k_proj.weight", Shape{kv_out, h}, 0, layer, true});
  b.member({p + "v_proj.weight", Shape{kv_out, h}, 0, layer, true});
  if (bias || c.add_qkv_bias) {
    b.group({p + "q_proj.bias", Shape{q_out}, 0, layer, false});
    b.member({p + "k_proj.bias", Shape{kv_out}, 0, layer, false});
    b.member({p + "v_proj.bias", Shape{kv_out}, 0, layer, false});
  }
  if (c.qk_layernorm) {
    add_norm(b, c, p + "q_norm", layer, c.head_dim());
    add_norm(b, c, p + "k_norm", layer, c.head_dim());
  }
  b.group({p + "o_proj.weight", Shape{h, q_out}, 1, layer, true});
  if (bias) b.group({p + "o_proj.bias", Shape{h}, -1, layer, false});
  if (c.softmax_type == SoftmaxType::learnable)
    b.group({p + "sinks", Shape{c.num_attention_heads}, 0, layer, false});
}

// Multi-latent attention under `p` (HF DeepSeek-V3's names): the down projections and latent
// norms replicated over TP, the up projections split by heads, o_proj by its input columns.
void add_latent_attention(LayoutBuilder& b, const TransformerConfig& c, const std::string& p,
                          int layer) {
  const int64_t h = c.hidden_size, heads = c.num_attention_heads;
  if (c.q_lora_rank > 0) {
    b.group({p + "q_a_proj.weight", Shape{c.q_lora_rank, h}, -1, layer, true});
    if (c.qk_layernorm) add_norm(b, c, p + "q_a_layernorm", layer, c.q_lora_rank);
    b.group({p + "q_b_proj.weight", Shape{heads * c.head_dim(), c.q_lora_rank}, 0, layer, true});
  } else {
    b.group({p + "q_proj.weight", Shape{heads * c.head_dim(), h}, 0, layer, true});
  }
  b.group({p + "kv_a_proj_with_mqa.weight", Shape{c.kv_lora_rank + c.qk_pos_emb_head_dim, h}, -1,
           layer, true});
  if (c.qk_layernorm) add_norm(b, c, p + "kv_a_layernorm", layer, c.kv_lora_rank);
  b.group({p + "kv_b_proj.weight", Shape{heads * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank}, 0,
           layer, true});
  b.group({p + "o_proj.weight", Shape{h, heads * c.v_head_dim}, 1, layer, true});
}

void add_layer(LayoutBuilder& b, const TransformerConfig& c, const ModelChunk& chunk, int layer) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t h = c.hidden_size;

  add_norm(b, c, p + "input_layernorm", layer);
  if (c.multi_latent_attention) {
    add_latent_attention(b, c, p + "self_attn.", layer);
  } else {
    add_attention(b, c, p + "self_attn.", layer);
  }
  add_norm(b, c, p + "post_attention_layernorm", layer);
  if (!c.is_moe_layer(layer)) return add_mlp(b, c, p + "mlp.", layer, c.ffn_hidden_size);
  b.group({p + "mlp.gate.weight", Shape{c.num_experts, h}, -1, layer, true});
  if (c.add_bias_linear) b.group({p + "mlp.gate.bias", Shape{c.num_experts}, -1, layer, false});
  b.align_to(chunk.expert_alignment);
  for (int e = chunk.first_expert; e < chunk.end_expert; ++e)
    add_mlp(b, c, p + "mlp.experts." + std::to_string(e) + ".", layer, c.mlp_hidden_size(), e);
  b.align_to(chunk.expert_alignment);
  if (c.moe_shared_expert_intermediate_size == 0) return;
  add_mlp(b, c, p + "mlp.shared_expert.", layer, c.moe_shared_expert_intermediate_size);
  if (c.moe_shared_expert_gate)
    b.group({p + "mlp.shared_expert_gate.weight", Shape{1, h}, -1, layer, true});
}

// MTP depth `layer` - num_layers + 1 (HF DeepSeek-V3's names): enorm, hnorm, eh_proj ([H, 2H],
// replicated over TP: under SP each rank projects its own tokens), the layer, shared_head.norm.
void add_mtp_depth(LayoutBuilder& b, const TransformerConfig& c, const ModelChunk& chunk,
                   int layer) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  add_norm(b, c, p + "enorm", layer);
  add_norm(b, c, p + "hnorm", layer);
  b.group({p + "eh_proj.weight", Shape{c.hidden_size, 2 * c.hidden_size}, -1, layer, true});
  add_layer(b, c, chunk, layer);
  add_norm(b, c, p + "shared_head.norm", layer);
}

}  // namespace

int held_layers_end(const ModelChunk& chunk, const TransformerConfig& config) {
  return chunk.end_layer + (chunk.head ? int(config.mtp_num_layers) : 0);
}

Shape ParamShard::valid_shape() const {
  std::vector<int64_t> dims(shape.begin(), shape.end());
  dims[0] -= padding;
  return Shape(std::span<const int64_t>(dims));
}

void check_tensor_parallel(const TransformerConfig& c, int tp) {
  BRAID_CONFIG_CHECK(tp >= 1, "--tensor-model-parallel-size must be at least 1, got ", tp);
  if (tp == 1) return;
  BRAID_CONFIG_CHECK(c.num_attention_heads % tp == 0, "tensor parallelism: num_attention_heads (",
                     c.num_attention_heads, ") is not divisible by --tensor-model-parallel-size (",
                     tp, ")");
  if (c.num_moe_layers() < c.num_layers + c.mtp_num_layers) {
    BRAID_CONFIG_CHECK(c.ffn_hidden_size % tp == 0, "tensor parallelism: ffn_hidden_size (",
                       c.ffn_hidden_size, ") is not divisible by --tensor-model-parallel-size (",
                       tp, ")");
  }
  if (c.num_experts > 0) {
    BRAID_CONFIG_CHECK(c.mlp_hidden_size() % tp == 0, "tensor parallelism: moe_ffn_hidden_size (",
                       c.mlp_hidden_size(), ") is not divisible by --tensor-model-parallel-size (",
                       tp, ")");
  }
  BRAID_CONFIG_CHECK(c.moe_shared_expert_intermediate_size % tp == 0,
                     "tensor parallelism: moe_shared_expert_intermediate_size (",
                     c.moe_shared_expert_intermediate_size,
                     ") is not divisible by --tensor-model-parallel-size (", tp, ")");
  const int64_t kv = c.kv_heads();
  BRAID_CONFIG_CHECK(kv % tp == 0 || tp % kv == 0, "tensor parallelism: num_query_groups (", kv,
                     ") and --tensor-model-parallel-size (", tp,
                     ") do not fit: kv heads are split when the TP size divides them and "
                     "replicated when they divide the TP size");
}

ParamLayout parameter_layout(const TransformerConfig& config, int tp_rank, int tp_size,
                             const ModelChunk& chunk) {
  config.validate();
  check_tensor_parallel(config, tp_size);
  BRAID_CHECK(tp_rank >= 0 && tp_rank < tp_size, "parameter_layout: TP rank ", tp_rank, " of ",
              tp_size);
  ParamLayout layout;
  layout.tp_rank = tp_rank;
  layout.tp_size = tp_size;
  layout.chunk = chunk;
  if (layout.chunk.end_layer < 0) layout.chunk.end_layer = int(config.num_layers);
  const ModelChunk& c = layout.chunk;
  BRAID_CONFIG_CHECK(
      0 <= c.first_layer && c.first_layer <= c.end_layer && c.end_layer <= config.num_layers,
      "model chunk: layers [", c.first_layer, ", ", c.end_layer, ") are not within the model's ",
      config.num_layers, " layers");
  BRAID_CONFIG_CHECK(!c.head || config.mtp_num_layers == 0 || c.end_layer == config.num_layers,
                     "model chunk: the head's chunk holds the MTP depths after the model's last ",
                     "layer, so it must end there (layer ", config.num_layers, "), not at ",
                     c.end_layer);
  if (layout.chunk.end_expert < 0) layout.chunk.end_expert = int(config.num_experts);
  BRAID_CHECK(c.expert_alignment >= 1, "model chunk: expert_alignment must be at least 1, got ",
              c.expert_alignment);
  BRAID_CONFIG_CHECK(
      0 <= c.first_expert && c.first_expert <= c.end_expert && c.end_expert <= config.num_experts,
      "model chunk: experts [", c.first_expert, ", ", c.end_expert, ") are not within the model's ",
      config.num_experts, " experts");
  LayoutBuilder b(layout, config);
  const int64_t h = config.hidden_size;
  if (c.embedding || (c.head && config.head_uses_embedding()))
    b.group({"model.embed_tokens.weight", Shape{config.vocab_size, h}, 0, -1, false});
  if (c.embedding && config.position_embedding == PositionEmbedding::learned)
    b.group(
        {"model.embed_positions.weight", Shape{config.max_position_embeddings, h}, -1, -1, false});
  for (int layer = c.first_layer; layer < c.end_layer; ++layer) add_layer(b, config, c, layer);
  if (c.head) {
    for (int layer = c.end_layer; layer < held_layers_end(c, config); ++layer)
      add_mtp_depth(b, config, c, layer);
    add_norm(b, config, "model.norm", -1);
    if (!config.tie_embeddings)
      b.group({"lm_head.weight", Shape{config.vocab_size, h}, 0, -1, true});
  }
  b.finish();
  return layout;
}

std::vector<ParamSpec> parameter_specs(const TransformerConfig& config) {
  return parameter_layout(config).specs;
}

int64_t count_parameters(const TransformerConfig& config) {
  return parameter_layout(config).num_parameters;
}

bool is_embedding_or_output(const ParamSpec& spec) {
  return spec.name == "model.embed_tokens.weight" || spec.name == "lm_head.weight";
}

bool is_embedding(const ParamSpec& spec) {
  return spec.name == "model.embed_tokens.weight" || spec.name == "model.embed_positions.weight";
}

}  // namespace braid::model
