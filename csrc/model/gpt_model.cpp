#include "braid/model/gpt_model.h"

#include <cstring>

#include "braid/kernels/ops.h"
#include "braid/model/init.h"
#include "braid/model/linear.h"

namespace braid::model {

struct GPTModel::Microbatch {
  Tensor ids;         // [B, S] i32 on the model's device
  Tensor targets;     // [B, S] i32 on the model's device
  Tensor positions;   // [B, S] i32, learned position embeddings only
  int64_t count = 0;  // non-ignored targets
  uint64_t forward_index = 0;
  std::vector<LayerActivations> layers;
  Tensor trunk_out;       // the last block's output: the final norm's input
  NormStats final_stats;  // Recompute::none only
  Tensor final_out;       // Recompute::none only
  Tensor logits;          // [B*S, V]; becomes dlogits in backward
  Tensor max, sumexp;     // [B*S] f32
};

namespace {

// The Philox seed of dropout masks: distinct from the parameter streams' seed.
constexpr uint64_t kDropoutSeedSalt = 0xD6E8FEB86659FD93ull;

Tensor host_copy(const Tensor& t) { return t.device().is_cpu() ? t : t.to(Device::cpu()); }

// The Philox stream of one dropout site of one training forward: the embedding output is
// site 0; block l's attention and MLP outputs are sites 2l + 1 and 2l + 2.
uint64_t dropout_stream(uint64_t forward_index, uint64_t site) {
  return (forward_index << 32) + site;
}

}  // namespace

GPTModel::GPTModel(const TransformerConfig& config, Device device, uint64_t seed)
    : config_(config), device_(device), seed_(seed) {
  config_.validate();
  BRAID_CONFIG_CHECK(config_.params_dtype == DType::f32 || device_.is_cuda(),
                     "TransformerConfig.params_dtype = ", dtype_name(config_.params_dtype),
                     " needs a CUDA device (activations on the CPU are f32)");
  layout_ = parameter_layout(config_);
  build_parameters();
}

GPTModel::~GPTModel() = default;

void GPTModel::build_parameters() {
  flat_params_ = Tensor::zeros({layout_.num_elements}, config_.params_dtype, device_);
  flat_grads_ = Tensor::zeros({layout_.num_elements}, DType::f32, device_);
  params_.reserve(layout_.specs.size());
  for (size_t i = 0; i < layout_.specs.size(); ++i) {
    const ParamSpec& spec = layout_.specs[i];
    const int64_t offset = layout_.offsets[i];
    params_.push_back(Parameter{spec, flat_params_.slice(offset, spec.shape),
                                flat_grads_.slice(offset, spec.shape)});
    index_.emplace(spec.name, i);
    init_parameter(params_.back().value, spec, config_, seed_);
  }
  layers_.reserve(size_t(config_.num_layers));
  for (int l = 0; l < int(config_.num_layers); ++l)
    layers_.emplace_back(config_, layer_tensors(flat_params_, l), layer_tensors(flat_grads_, l));
}

Parameter& GPTModel::parameter(const std::string& name) {
  auto it = index_.find(name);
  BRAID_CHECK(it != index_.end(), "GPTModel has no parameter named '", name, "'");
  return params_[it->second];
}

Tensor GPTModel::view_of(const Tensor& flat, const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return Tensor();
  return flat.slice(layout_.offsets[it->second], layout_.specs[it->second].shape);
}

Tensor GPTModel::fused_view(const Tensor& flat, const std::string& first, int64_t rows,
                            int64_t cols) const {
  auto it = index_.find(first);
  if (it == index_.end()) return Tensor();
  const Shape shape = cols > 0 ? Shape{rows, cols} : Shape{rows};
  return flat.slice(layout_.offsets[it->second], shape);
}

LayerTensors GPTModel::layer_tensors(const Tensor& flat, int layer) const {
  const TransformerConfig& c = config_;
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t qkv_rows = (c.num_attention_heads + 2 * c.kv_heads()) * c.head_dim();
  const bool swiglu = c.activation == Activation::swiglu;
  const int64_t fc1_rows = swiglu ? 2 * c.ffn_hidden_size : c.ffn_hidden_size;
  const std::string fc1 = swiglu ? "mlp.gate_proj" : "mlp.up_proj";
  LayerTensors t;
  t.input_norm_weight = view_of(flat, p + "input_layernorm.weight");
  t.input_norm_bias = view_of(flat, p + "input_layernorm.bias");
  t.qkv_weight = fused_view(flat, p + "self_attn.q_proj.weight", qkv_rows, c.hidden_size);
  t.qkv_bias = fused_view(flat, p + "self_attn.q_proj.bias", qkv_rows, 0);
  t.o_weight = view_of(flat, p + "self_attn.o_proj.weight");
  t.o_bias = view_of(flat, p + "self_attn.o_proj.bias");
  t.post_norm_weight = view_of(flat, p + "post_attention_layernorm.weight");
  t.post_norm_bias = view_of(flat, p + "post_attention_layernorm.bias");
  t.fc1_weight = fused_view(flat, p + fc1 + ".weight", fc1_rows, c.hidden_size);
  t.fc1_bias = fused_view(flat, p + fc1 + ".bias", fc1_rows, 0);
  t.fc2_weight = view_of(flat, p + "mlp.down_proj.weight");
  t.fc2_bias = view_of(flat, p + "mlp.down_proj.bias");
  return t;
}

const Tensor& GPTModel::output_weight() const {
  const std::string& name = config_.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  return params_[index_.at(name)].value;
}

Tensor& GPTModel::output_grad() {
  return parameter(config_.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight").grad;
}

DropoutContext GPTModel::dropout_context(uint64_t forward_index, int layer, bool training) const {
  DropoutContext d;
  if (!training || config_.hidden_dropout == 0.0f) return d;
  d.p = config_.hidden_dropout;
  d.seed = seed_ ^ kDropoutSeedSalt;
  d.attention_offset = dropout_stream(forward_index, 2 * uint64_t(layer) + 1);
  d.mlp_offset = dropout_stream(forward_index, 2 * uint64_t(layer) + 2);
  return d;
}

Tensor GPTModel::run_trunk(Microbatch& mb, bool training) {
  const int64_t b = mb.ids.size(0), s = mb.ids.size(1), h = config_.hidden_size;
  Tensor x = Tensor::empty({b, s, h}, config_.params_dtype, device_);
  ops::embedding_forward(x, mb.ids, view_of(flat_params_, "model.embed_tokens.weight"));
  if (config_.position_embedding == PositionEmbedding::learned) {
    Tensor host = Tensor::empty({b, s}, DType::i32);
    int32_t* p = host.data_ptr<int32_t>();
    for (int64_t i = 0; i < b * s; ++i) p[i] = int32_t(i % s);
    mb.positions = host.to(device_);
    Tensor pos = Tensor::empty({b, s, h}, config_.params_dtype, device_);
    ops::embedding_forward(pos, mb.positions,
                           view_of(flat_params_, "model.embed_positions.weight"));
    ops::add(x, x, pos);
  }
  const DropoutContext drop = dropout_context(mb.forward_index, 0, training);
  if (drop.p > 0) {
    Tensor dropped = Tensor::empty(x.shape(), x.dtype(), device_);
    ops::dropout_forward(dropped, x, drop.p, drop.seed, dropout_stream(mb.forward_index, 0));
    x = dropped;
  }
  if (training) mb.layers.resize(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    x = layers_[l].forward(x, dropout_context(mb.forward_index, int(l), training),
                           config_.recompute, training ? &mb.layers[l] : nullptr);
  }
  return x;
}

GPTModel::Microbatch GPTModel::prepare(const Tensor& ids, const Tensor& targets) const {
  BRAID_CONFIG_CHECK(ids.defined() && ids.dim() == 2 && ids.dtype() == DType::i32,
                     "GPTModel: ids must be [B, S] i32, got ",
                     ids.defined() ? dtype_name(ids.dtype()) : "", ids.shape());
  const int64_t b = ids.size(0), s = ids.size(1);
  BRAID_CONFIG_CHECK(b > 0 && s > 0, "GPTModel: empty batch ", ids.shape());
  BRAID_CONFIG_CHECK(s <= config_.max_position_embeddings, "GPTModel: sequence length ", s,
                     " exceeds max_position_embeddings ", config_.max_position_embeddings);
  const Tensor host_ids = host_copy(ids);
  const int32_t* id = host_ids.data_ptr<int32_t>();
  for (int64_t i = 0; i < b * s; ++i)
    BRAID_CONFIG_CHECK(id[i] >= 0 && id[i] < config_.vocab_size, "GPTModel: token id ", id[i],
                       " at position ", i, " is outside the vocabulary [0, ", config_.vocab_size,
                       ")");
  Microbatch mb;
  // Copies, not views: the caller may refill its buffers before backward reads them.
  mb.ids = ids.to(device_);
  if (targets.defined()) {
    BRAID_CONFIG_CHECK(targets.dtype() == DType::i32 && targets.shape() == ids.shape(),
                       "GPTModel: targets must be i32 ", ids.shape(), " like ids, got ",
                       dtype_name(targets.dtype()), targets.shape());
    const Tensor host_targets = host_copy(targets);
    const int32_t* t = host_targets.data_ptr<int32_t>();
    for (int64_t i = 0; i < b * s; ++i) {
      BRAID_CONFIG_CHECK(t[i] < config_.vocab_size, "GPTModel: target ", t[i], " at position ", i,
                         " is outside the vocabulary [0, ", config_.vocab_size, ")");
      mb.count += t[i] >= 0;
    }
    mb.targets = targets.to(device_);
  }
  return mb;
}

Tensor GPTModel::final_norm(const Tensor& x, NormStats& stats) const {
  return norm_forward(config_.normalization, config_.norm_eps, stats, x,
                      view_of(flat_params_, "model.norm.weight"),
                      view_of(flat_params_, "model.norm.bias"));
}

float GPTModel::forward(const Tensor& ids, const Tensor& targets, int microbatch) {
  BRAID_CHECK(!has_activations(microbatch), "GPTModel::forward: microbatch ", microbatch,
              " still holds the activations of a forward without backward");
  BRAID_CHECK(targets.defined(), "GPTModel::forward: targets are required");
  auto mb = std::make_unique<Microbatch>(prepare(ids, targets));
  mb->forward_index = forward_count_++;
  const int64_t tokens = ids.numel(), v = config_.vocab_size;

  Tensor x = run_trunk(*mb, true);
  NormStats stats;
  Tensor hf = final_norm(x, stats);
  mb->logits = Tensor::empty({tokens, v}, config_.params_dtype, device_);
  linear_forward(mb->logits, hf.view({tokens, config_.hidden_size}), output_weight(), {});
  mb->max = Tensor::empty({tokens}, DType::f32, device_);
  mb->sumexp = Tensor::empty({tokens}, DType::f32, device_);
  Tensor target_logit = Tensor::empty({tokens}, DType::f32, device_);
  const Tensor flat_targets = mb->targets.view({tokens});
  ops::cross_entropy_partials(mb->max, mb->sumexp, target_logit, mb->logits, flat_targets);
  Tensor losses = Tensor::empty({tokens}, DType::f32, device_);
  ops::cross_entropy_loss(losses, mb->max, mb->sumexp, target_logit, flat_targets);
  const Tensor host_losses = host_copy(losses);
  double sum = 0;
  for (int64_t i = 0; i < tokens; ++i) sum += host_losses.data_ptr<float>()[i];

  mb->trunk_out = x;
  if (config_.recompute == Recompute::none) {
    mb->final_stats = stats;
    mb->final_out = hf;
  }
  const int64_t count = mb->count;
  activations_.emplace(microbatch, std::move(mb));
  return count > 0 ? float(sum / double(count)) : 0.0f;
}

void GPTModel::backward(int microbatch, float grad_scale) {
  auto it = activations_.find(microbatch);
  BRAID_CHECK(it != activations_.end(), "GPTModel::backward: microbatch ", microbatch,
              " has no activations (no forward, or its backward already ran)");
  Microbatch& mb = *it->second;
  const int64_t tokens = mb.ids.numel(), h = config_.hidden_size;

  // Head: cross-entropy, LM head, final norm.
  Tensor dloss_host = Tensor::empty({tokens}, DType::f32);
  const float dloss = mb.count > 0 ? grad_scale / float(mb.count) : 0.0f;
  for (int64_t i = 0; i < tokens; ++i) dloss_host.data_ptr<float>()[i] = dloss;
  const Tensor dloss_t = dloss_host.to(device_);
  ops::cross_entropy_backward(mb.logits, mb.logits, mb.targets.view({tokens}), mb.max, mb.sumexp,
                              dloss_t);
  NormStats stats = mb.final_stats;
  Tensor hf = mb.final_out.defined() ? mb.final_out : final_norm(mb.trunk_out, stats);
  Tensor dhf = Tensor::empty(mb.trunk_out.shape(), config_.params_dtype, device_);
  linear_backward(dhf, output_grad(), {}, mb.logits, hf.view({tokens, h}), output_weight());
  mb.logits = Tensor();
  mb.final_out = Tensor();
  hf = Tensor();
  Tensor dx = Tensor::empty(mb.trunk_out.shape(), config_.params_dtype, device_);
  norm_backward(config_.normalization, dx, parameter("model.norm.weight").grad,
                view_of(flat_grads_, "model.norm.bias"), dhf, mb.trunk_out,
                view_of(flat_params_, "model.norm.weight"), stats);
  dhf = Tensor();
  mb.trunk_out = Tensor();

  // Blocks, last to first.
  for (size_t l = layers_.size(); l-- > 0;) {
    dx = layers_[l].backward(dx, dropout_context(mb.forward_index, int(l), true), config_.recompute,
                             mb.layers[l]);
  }

  // Embeddings.
  const DropoutContext drop = dropout_context(mb.forward_index, 0, true);
  if (drop.p > 0) {
    Tensor d = Tensor::empty(dx.shape(), dx.dtype(), device_);
    ops::dropout_backward(d, dx, drop.p, drop.seed, dropout_stream(mb.forward_index, 0));
    dx = d;
  }
  ops::embedding_backward(parameter("model.embed_tokens.weight").grad, dx, mb.ids);
  if (config_.position_embedding == PositionEmbedding::learned)
    ops::embedding_backward(parameter("model.embed_positions.weight").grad, dx, mb.positions);
  activations_.erase(it);
}

Tensor GPTModel::logits(const Tensor& ids) {
  Microbatch mb = prepare(ids, Tensor());
  const int64_t b = ids.size(0), s = ids.size(1);
  NormStats stats;
  Tensor hf = final_norm(run_trunk(mb, false), stats);
  Tensor out = Tensor::empty({b, s, config_.vocab_size}, config_.params_dtype, device_);
  linear_forward(out, hf, output_weight(), {});
  if (out.dtype() != DType::f32) {
    Tensor f32 = Tensor::empty(out.shape(), DType::f32, device_);
    ops::cast(f32, out);
    out = f32;
  }
  return out.to(Device::cpu());
}

void GPTModel::zero_grad() { flat_grads_.zero_(); }

}  // namespace braid::model
