#include "braid/model/parameters.h"

#include <string>

namespace braid::model {
namespace {

// Accumulates specs group by group, padding every group to kParamGroupAlignment.
class LayoutBuilder {
 public:
  explicit LayoutBuilder(ParamLayout& layout) : layout_(layout) {}

  // Starts a new group (aligned) and adds its first member.
  void group(ParamSpec spec) {
    layout_.num_elements = align(layout_.num_elements);
    member(std::move(spec));
  }
  // Adds a member right after the previous one (a fused group).
  void member(ParamSpec spec) {
    int64_t n = spec.shape.numel();
    layout_.offsets.push_back(layout_.num_elements);
    layout_.num_elements += n;
    layout_.num_parameters += n;
    layout_.specs.push_back(std::move(spec));
  }
  void finish() { layout_.num_elements = align(layout_.num_elements); }

 private:
  static int64_t align(int64_t n) {
    return (n + kParamGroupAlignment - 1) / kParamGroupAlignment * kParamGroupAlignment;
  }
  ParamLayout& layout_;
};

void add_norm(LayoutBuilder& b, const TransformerConfig& c, const std::string& prefix, int layer) {
  b.group({prefix + ".weight", Shape{c.hidden_size}, -1, layer, false});
  if (c.normalization == Normalization::layernorm)
    b.group({prefix + ".bias", Shape{c.hidden_size}, -1, layer, false});
}

void add_layer(LayoutBuilder& b, const TransformerConfig& c, int layer) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t h = c.hidden_size;
  const int64_t q_out = c.num_attention_heads * c.head_dim();
  const int64_t kv_out = c.kv_heads() * c.head_dim();
  const int64_t f = c.ffn_hidden_size;
  const bool bias = c.add_bias_linear;

  add_norm(b, c, p + "input_layernorm", layer);
  b.group({p + "self_attn.q_proj.weight", Shape{q_out, h}, 0, layer, true});
  b.member({p + "self_attn.k_proj.weight", Shape{kv_out, h}, 0, layer, true});
  b.member({p + "self_attn.v_proj.weight", Shape{kv_out, h}, 0, layer, true});
  if (bias) {
    b.group({p + "self_attn.q_proj.bias", Shape{q_out}, 0, layer, false});
    b.member({p + "self_attn.k_proj.bias", Shape{kv_out}, 0, layer, false});
    b.member({p + "self_attn.v_proj.bias", Shape{kv_out}, 0, layer, false});
  }
  b.group({p + "self_attn.o_proj.weight", Shape{h, q_out}, 1, layer, true});
  if (bias) b.group({p + "self_attn.o_proj.bias", Shape{h}, -1, layer, false});

  add_norm(b, c, p + "post_attention_layernorm", layer);
  if (c.activation == Activation::swiglu) {
    b.group({p + "mlp.gate_proj.weight", Shape{f, h}, 0, layer, true});
    b.member({p + "mlp.up_proj.weight", Shape{f, h}, 0, layer, true});
    if (bias) {
      b.group({p + "mlp.gate_proj.bias", Shape{f}, 0, layer, false});
      b.member({p + "mlp.up_proj.bias", Shape{f}, 0, layer, false});
    }
  } else {
    b.group({p + "mlp.up_proj.weight", Shape{f, h}, 0, layer, true});
    if (bias) b.group({p + "mlp.up_proj.bias", Shape{f}, 0, layer, false});
  }
  b.group({p + "mlp.down_proj.weight", Shape{h, f}, 1, layer, true});
  if (bias) b.group({p + "mlp.down_proj.bias", Shape{h}, -1, layer, false});
}

}  // namespace

ParamLayout parameter_layout(const TransformerConfig& config) {
  config.validate();
  ParamLayout layout;
  LayoutBuilder b(layout);
  const int64_t h = config.hidden_size;
  b.group({"model.embed_tokens.weight", Shape{config.vocab_size, h}, 0, -1, false});
  if (config.position_embedding == PositionEmbedding::learned)
    b.group(
        {"model.embed_positions.weight", Shape{config.max_position_embeddings, h}, -1, -1, false});
  for (int layer = 0; layer < int(config.num_layers); ++layer) add_layer(b, config, layer);
  add_norm(b, config, "model.norm", -1);
  if (!config.tie_embeddings) b.group({"lm_head.weight", Shape{config.vocab_size, h}, 0, -1, true});
  b.finish();
  return layout;
}

std::vector<ParamSpec> parameter_specs(const TransformerConfig& config) {
  return parameter_layout(config).specs;
}

int64_t count_parameters(const TransformerConfig& config) {
  return parameter_layout(config).num_parameters;
}

bool is_embedding(const ParamSpec& spec) {
  return spec.name == "model.embed_tokens.weight" || spec.name == "model.embed_positions.weight";
}

}  // namespace braid::model
