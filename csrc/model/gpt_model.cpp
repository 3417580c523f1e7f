#include "braid/model/gpt_model.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "braid/kernels/ops.h"
#include "braid/model/init.h"
#include "braid/model/linear.h"
#include "model/gpt_model_internal.h"

namespace braid::model {

using namespace gpt_model_detail;

namespace {

// Weights of a shard: element j of a row-parallel shard's row r is global element
// r·in + start + j; other shards are contiguous runs of the global tensor.
void init_shard(const Tensor& value, const ParamSpec& spec, const ParamShard& shard,
                const TransformerConfig& config, uint64_t seed) {
  if (value.numel() == 0) return;
  if (spec.tp_dim == 1 && shard.shape[1] != spec.shape[1]) {
    for (int64_t r = 0; r < value.size(0); ++r)
      init_parameter(value.narrow(r, 1), spec, config, seed, r * spec.shape[1] + shard.start);
    return;
  }
  const int64_t row_elements = spec.shape.numel() / spec.shape[0];
  init_parameter(value, spec, config, seed, shard.start * row_elements);
}

}  // namespace

GPTModel::GPTModel(const TransformerConfig& config, Device device, uint64_t seed,
                   const TensorParallel& tp, const ModelChunk& chunk, int64_t buffer_elements,
                   const ContextParallel& cp, const ExpertParallel& ep)
    : config_(config), device_(device), seed_(seed), tp_(tp), cp_(cp), ep_(ep) {
  config_.validate();
  BRAID_CONFIG_CHECK(config_.params_dtype == DType::f32 || device_.is_cuda(),
                     "TransformerConfig.params_dtype = ", dtype_name(config_.params_dtype),
                     " needs a CUDA device (activations on the CPU are f32)");
  if (tp_.group != nullptr) {
    BRAID_CHECK(tp_.group->device() == device_, "GPTModel: the TP group works on ",
                tp_.group->device().str(), ", the model on ", device_.str());
  }
  BRAID_CONFIG_CHECK(!device_.is_cuda() || config_.head_dim() <= 256,
                     "the CUDA attention kernels take heads up to 256 channels wide; this model's ",
                     "are ", config_.head_dim(), " (kv_channels, or hidden_size / ",
                     "num_attention_heads)");
  check_expert_parallel(config_, ep_.size());
  check_whole_experts(ep_, tp_);
  if (ep_.group != nullptr) {
    BRAID_CHECK(ep_.group->device() == device_, "GPTModel: the EP group works on ",
                ep_.group->device().str(), ", the model on ", device_.str());
  }
  layout_ =
      parameter_layout(config_, tp_.rank(), tp_.size(), ep_.holding(chunk, config_.num_experts));
  first_layer_ = layout_.chunk.first_layer;
  if (cp_.group != nullptr) {
    BRAID_CHECK(cp_.group->device() == device_, "GPTModel: the CP group works on ",
                cp_.group->device().str(), ", the model on ", device_.str());
  }
  build_parameters(buffer_elements);
  if (tp_.size() > config_.kv_heads()) {
    const int sharing = tp_.size() / int(config_.kv_heads());
    kv_group_ = tp_.group->split(tp_.rank() / sharing, tp_.rank(), "tp_kv");
  }
}

GPTModel::~GPTModel() = default;

void GPTModel::build_parameters(int64_t buffer_elements) {
  const int64_t elements = std::max(layout_.num_elements, buffer_elements);
  flat_params_ = Tensor::zeros({elements}, config_.params_dtype, device_);
  flat_grads_ = Tensor::zeros({elements}, DType::f32, device_);
  params_.reserve(layout_.specs.size());
  const ModelChunk& chunk = layout_.chunk;
  const int end = held_layers_end(chunk, config_);
  layer_params_.resize(size_t(end - chunk.first_layer));
  for (size_t i = 0; i < layout_.specs.size(); ++i) {
    const ParamSpec& spec = layout_.specs[i];
    if (spec.layer >= 0) {
      layer_params_[size_t(spec.layer - chunk.first_layer)].push_back(i);
    } else if (is_embedding(spec) && chunk.embedding) {
      embedding_params_.push_back(i);
    } else {
      head_params_.push_back(i);  // final norm, lm_head, or the last stage's tied copy
    }
    const ParamShard& shard = layout_.shards[i];
    const int64_t offset = layout_.offsets[i];
    params_.push_back(Parameter{spec, shard, flat_params_.slice(offset, shard.valid_shape()),
                                flat_grads_.slice(offset, shard.valid_shape())});
    index_.emplace(spec.name, i);
    init_shard(params_.back().value, spec, shard, config_, seed_);
  }
  layers_.reserve(size_t(end - chunk.first_layer));
  for (int l = chunk.first_layer; l < end; ++l) {
    LayerTensors weights = layer_tensors(flat_params_, l);
    MoeStats& stats = moe_stats_.emplace_back();
    if (config_.moe_router_enable_expert_bias && config_.is_moe_layer(l)) {
      weights.expert_bias = Tensor::zeros({config_.num_experts}, DType::f32, device_);
      expert_biases_.emplace_back(expert_bias_name(l), weights.expert_bias);
      stats.tokens_per_expert.assign(size_t(config_.num_experts), 0);
    }
    layers_.emplace_back(config_, l, tp_, cp_, ep_, std::move(weights),
                         layer_tensors(flat_grads_, l));
  }
  mtp_losses_.resize(size_t(end - chunk.end_layer));
}

std::vector<std::pair<int64_t, MoeLosses>> GPTModel::take_moe_losses() {
  std::vector<std::pair<int64_t, MoeLosses>> out;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const int64_t layer = first_layer_ + int64_t(l);
    if (!config_.is_moe_layer(layer)) continue;
    out.emplace_back(layer, std::exchange(moe_stats_[l].losses, MoeLosses{}));
  }
  return out;
}

void GPTModel::update_expert_bias(comm::Communicator* group) {
  size_t b = 0;
  for (MoeStats& s : moe_stats_) {
    if (s.tokens_per_expert.empty()) continue;
    // Whole experts: each TP rank counted its own tokens.
    comm::Communicator* tp_group = ep_.whole_experts && tp_.active() ? tp_.group : nullptr;
    move_expert_bias(expert_biases_[b++].second, s.tokens_per_expert,
                     config_.moe_router_bias_update_rate, {group, tp_group});
  }
}

Parameter& GPTModel::parameter(const std::string& name) {
  auto it = index_.find(name);
  BRAID_CHECK(it != index_.end(), "GPTModel has no parameter named '", name, "'");
  return params_[it->second];
}

const ParamShard& GPTModel::shard_of(const std::string& name) const {
  return layout_.shards[index_.at(name)];
}

Tensor GPTModel::view_of(const Tensor& flat, const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return Tensor();
  return flat.slice(layout_.offsets[it->second], layout_.shards[it->second].valid_shape());
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
  const LayerShape n = LayerShape::of(c, tp_.size());
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t qkv_rows = (n.q_heads + 2 * n.kv_heads) * n.head_dim;
  const bool gated = c.gated_activation();
  const std::string fc1 = gated ? "gate_proj" : "up_proj";
  LayerTensors t;
  t.input_norm_weight = view_of(flat, p + "input_layernorm.weight");
  t.input_norm_bias = view_of(flat, p + "input_layernorm.bias");
  if (c.multi_latent_attention) {
    const std::string a = p + "self_attn.";
    t.q_a_weight = view_of(flat, a + "q_a_proj.weight");
    t.q_a_norm_weight = view_of(flat, a + "q_a_layernorm.weight");
    t.q_a_norm_bias = view_of(flat, a + "q_a_layernorm.bias");
    t.q_weight = view_of(flat, a + (c.q_lora_rank > 0 ? "q_b_proj.weight" : "q_proj.weight"));
    t.kv_a_weight = view_of(flat, a + "kv_a_proj_with_mqa.weight");
    t.kv_a_norm_weight = view_of(flat, a + "kv_a_layernorm.weight");
    t.kv_a_norm_bias = view_of(flat, a + "kv_a_layernorm.bias");
    t.kv_b_weight = view_of(flat, a + "kv_b_proj.weight");
  } else {
    t.qkv_weight = fused_view(flat, p + "self_attn.q_proj.weight", qkv_rows, c.hidden_size);
  }
  t.qkv_bias = fused_view(flat, p + "self_attn.q_proj.bias", qkv_rows, 0);
  t.q_norm_weight = view_of(flat, p + "self_attn.q_norm.weight");
  t.q_norm_bias = view_of(flat, p + "self_attn.q_norm.bias");
  t.k_norm_weight = view_of(flat, p + "self_attn.k_norm.weight");
  t.k_norm_bias = view_of(flat, p + "self_attn.k_norm.bias");
  t.o_weight = view_of(flat, p + "self_attn.o_proj.weight");
  t.o_bias = view_of(flat, p + "self_attn.o_proj.bias");
  t.sinks = view_of(flat, p + "self_attn.sinks");
  t.post_norm_weight = view_of(flat, p + "post_attention_layernorm.weight");
  t.post_norm_bias = view_of(flat, p + "post_attention_layernorm.bias");
  // An MLP of hidden size f (this rank's share) under `prefix`.
  auto mlp = [&](const std::string& prefix, int64_t f) {
    const int64_t rows = gated ? 2 * f : f;
    return MlpTensors{fused_view(flat, prefix + fc1 + ".weight", rows, c.hidden_size),
                      fused_view(flat, prefix + fc1 + ".bias", rows, 0),
                      view_of(flat, prefix + "down_proj.weight"),
                      view_of(flat, prefix + "down_proj.bias")};
  };
  if (!c.is_moe_layer(layer)) {
    t.mlp = mlp(p + "mlp.", c.ffn_hidden_size / tp_.size());
    return t;
  }
  t.router_weight = view_of(flat, p + "mlp.gate.weight");
  t.router_bias = view_of(flat, p + "mlp.gate.bias");
  const int64_t expert_ffn = layout_.chunk.whole_experts ? c.mlp_hidden_size() : n.ffn;
  for (int e = layout_.chunk.first_expert; e < layout_.chunk.end_expert; ++e)
    t.experts.push_back(mlp(p + "mlp.experts." + std::to_string(e) + ".", expert_ffn));
  if (c.moe_shared_expert_intermediate_size > 0)
    t.shared_expert =
        mlp(p + "mlp.shared_expert.", c.moe_shared_expert_intermediate_size / tp_.size());
  t.shared_expert_gate = view_of(flat, p + "mlp.shared_expert_gate.weight");
  return t;
}

const Tensor& GPTModel::output_weight() const {
  const std::string& name = config_.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  return params_[index_.at(name)].value;
}

Tensor& GPTModel::output_grad() {
  return parameter(config_.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight").grad;
}

int64_t GPTModel::vocab_start() const {
  // embed_tokens and lm_head split the padded vocabulary alike; a chunk may hold either.
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight"})
    if (index_.count(name)) return shard_of(name).start;
  return 0;
}

Tokens GPTModel::tokens_of(const Microbatch& mb) const {
  return {mb.ids.size(0), mb.ids.size(1), mb.key_start, mb.doc_positions};
}

int64_t GPTModel::region_tokens(const Microbatch& mb) const {
  return tokens_of(mb).count() / (tp_.sharded_tokens() ? tp_.size() : 1);
}

Tensor GPTModel::lookup_tokens(const Tensor& ids) const {
  const int64_t t = ids.numel();
  Tensor x = Tensor::empty({t, config_.hidden_size}, config_.params_dtype, device_);
  ops::embedding_forward(x, ids.view({t}), view_of(flat_params_, "model.embed_tokens.weight"),
                         vocab_start());
  return exit_tp_forward(tp_, x);  // vocab-parallel: each rank looked up the ids it owns
}

void GPTModel::lookup_tokens_backward(const Tensor& dx, const Tensor& ids) {
  ops::embedding_backward(parameter("model.embed_tokens.weight").grad, exit_tp_backward(tp_, dx),
                          ids.view({ids.numel()}), vocab_start());
}

Tensor GPTModel::embed(Microbatch& mb, bool training, int64_t position_offset) {
  param_use(embedding_params_);
  const Tokens tokens = tokens_of(mb);
  const int64_t h = config_.hidden_size, region = region_tokens(mb);
  Tensor x = lookup_tokens(mb.ids);
  const int64_t first_token = tp_.sharded_tokens() ? tp_.rank() * region : 0;
  if (config_.position_embedding == PositionEmbedding::learned) {
    Tensor host = Tensor::empty({region}, DType::i32);
    int32_t* p = host.data_ptr<int32_t>();
    const Tensor& own = mb.doc_positions_host;  // --reset-position-ids, else undefined
    for (int64_t i = 0; i < region; ++i) {
      const int64_t token = first_token + i;
      p[i] = int32_t(position_offset + (own.defined() ? own.data_ptr<int32_t>()[token]
                                        : cp_.active()
                                            ? cp_.position(token, tokens.batch / 2, tokens.seq)
                                            : token % tokens.seq));
    }
    mb.positions = host.to(device_);
    Tensor pos = Tensor::empty({region, h}, config_.params_dtype, device_);
    ops::embedding_forward(pos, mb.positions,
                           view_of(flat_params_, "model.embed_positions.weight"));
    ops::add(x, x, pos);
  }
  return dropout(mb, x, 0, training);
}

Tensor GPTModel::run_layers(Microbatch& mb, Tensor x, bool training) {
  if (training) mb.layers.resize(trunk_layers());
  const size_t group = recompute_group();
  for (size_t l = 0; l < trunk_layers(); ++l) {
    param_use(layer_params_[l]);
    const bool keep = training && l % group == 0;
    x = layers_[l].forward(x, tokens_of(mb), dropout_context(mb, first_layer_ + int(l), training),
                           layer_policy(l), keep ? &mb.layers[l] : nullptr);
  }
  return x;
}

Recompute GPTModel::layer_policy(size_t l) const {
  if (config_.recompute != Recompute::full || config_.recompute_method == RecomputeMethod::uniform)
    return config_.recompute;
  return int64_t(l) < config_.recompute_num_layers ? Recompute::full : Recompute::none;
}

size_t GPTModel::recompute_group() const {
  const bool grouped =
      config_.recompute == Recompute::full && config_.recompute_method == RecomputeMethod::uniform;
  return grouped ? size_t(config_.recompute_num_layers) : 1;
}

void GPTModel::rerun_group(Microbatch& mb, size_t begin, size_t end) const {
  Tensor x = mb.layers[begin].input;  // forward() below resets mb.layers[begin] first
  for (size_t l = begin; l < end; ++l) {
    x = layers_[l].forward(x, tokens_of(mb), dropout_context(mb, first_layer_ + int(l), true),
                           Recompute::none, &mb.layers[l]);
  }
}

GPTModel::Microbatch GPTModel::prepare(const Tensor& ids, const Tensor& targets,
                                       bool documents) const {
  BRAID_CONFIG_CHECK(ids.defined() && ids.dim() == 2 && ids.dtype() == DType::i32,
                     "GPTModel: ids must be [B, S] i32, got ",
                     ids.defined() ? dtype_name(ids.dtype()) : "", ids.shape());
  const int64_t b = ids.size(0), s = ids.size(1);
  BRAID_CONFIG_CHECK(b > 0 && s > 0, "GPTModel: empty batch ", ids.shape());
  BRAID_CONFIG_CHECK(s <= config_.max_position_embeddings, "GPTModel: sequence length ", s,
                     " exceeds max_position_embeddings ", config_.max_position_embeddings);
  BRAID_CONFIG_CHECK(!tp_.sharded_tokens() || s % (tp_.size() * cp_.size()) == 0,
                     "sequence parallelism: the sequence length (", s,
                     ") is not divisible by --tensor-model-parallel-size (", tp_.size(), ")",
                     cp_.active()
                         ? " × --context-parallel-size (" + std::to_string(cp_.size()) + ")"
                         : std::string());
  const Tensor host_ids = host_copy(ids);
  const int32_t* id = host_ids.data_ptr<int32_t>();
  for (int64_t i = 0; i < b * s; ++i)
    BRAID_CONFIG_CHECK(id[i] >= 0 && id[i] < config_.vocab_size, "GPTModel: token id ", id[i],
                       " (sample ", i / s, " of the microbatch, position ", i % s,
                       ") is outside the vocabulary [0, ", config_.vocab_size, ")");
  Microbatch mb;
  // Copies, not views: the caller may refill its buffers before backward reads them.
  mb.ids = cp_.active() ? split_sequence(cp_, ids).to(device_) : ids.to(device_);
  if (documents) prepare_documents(mb, id, b, s);
  if (targets.defined()) {
    BRAID_CONFIG_CHECK(targets.dtype() == DType::i32 && targets.shape() == ids.shape(),
                       "GPTModel: targets must be i32 ", ids.shape(), " like ids, got ",
                       dtype_name(targets.dtype()), targets.shape());
    const Tensor host_targets = host_copy(targets);
    const int32_t* t = host_targets.data_ptr<int32_t>();
    for (int64_t i = 0; i < b * s; ++i) {
      BRAID_CONFIG_CHECK(t[i] < config_.vocab_size, "GPTModel: target ", t[i], " (sample ", i / s,
                         " of the microbatch, position ", i % s, ") is outside the vocabulary [0, ",
                         config_.vocab_size, ")");
      mb.head.count += t[i] >= 0;
    }
    mb.head.targets = cp_.active() ? split_sequence(cp_, targets).to(device_) : targets.to(device_);
  }
  return mb;
}

Tensor GPTModel::final_norm(const Tensor& x, NormStats& stats) const {
  param_use(head_params_);
  return norm_forward(config_, stats, x, view_of(flat_params_, "model.norm.weight"),
                      view_of(flat_params_, "model.norm.bias"));
}

void GPTModel::cross_entropy_partials(HeadPass& pass, Tensor& target_logit) const {
  const int64_t t = pass.logits.size(0);
  const Tensor targets = pass.targets.view({t});
  pass.max = Tensor::empty({t}, DType::f32, device_);
  pass.sumexp = Tensor::empty({t}, DType::f32, device_);
  target_logit = Tensor::empty({t}, DType::f32, device_);
  if (pass.logits.size(1) > 0) {
    ops::cross_entropy_partials(pass.max, pass.sumexp, target_logit, pass.logits, targets,
                                vocab_start());
  } else {  // this rank's vocabulary slice is all padding
    pass.max = filled({t}, -std::numeric_limits<float>::infinity(), device_);
    pass.sumexp = filled({t}, 0.0f, device_);
    target_logit = filled({t}, 0.0f, device_);
  }
  if (!tp_.active()) return;
  // Never gather the logits: reduce the max, re-base each rank's sum on it, sum the sums and
  // the target logit (which one rank holds).
  Tensor global_max = pass.max.clone();
  tp_.group->all_reduce(global_max, comm::ReduceOp::max)->wait();
  ops::cross_entropy_rescale(pass.sumexp, pass.max, global_max);
  pass.max = global_max;
  tp_.group->all_reduce(pass.sumexp)->wait();
  tp_.group->all_reduce(target_logit)->wait();
}

double GPTModel::head_forward(HeadPass& pass, const Tensor& hf) {
  const int64_t tokens = pass.targets.numel();
  const Tensor hf_full = enter_tp_forward(tp_, hf);
  const Tensor& w = output_weight();
  pass.logits = Tensor::empty({tokens, w.size(0)}, config_.params_dtype, device_);
  if (w.size(0) > 0)
    linear_forward(pass.logits, hf_full.view({tokens, config_.hidden_size}), w, {});
  Tensor target_logit;
  cross_entropy_partials(pass, target_logit);
  Tensor losses = Tensor::empty({tokens}, DType::f32, device_);
  ops::cross_entropy_loss(losses, pass.max, pass.sumexp, target_logit, pass.targets.view({tokens}));
  const Tensor host_losses = host_copy(losses);
  double sum = 0;
  for (int64_t i = 0; i < tokens; ++i) sum += host_losses.data_ptr<float>()[i];
  return sum;
}

Tensor GPTModel::head_backward(HeadPass& pass, const Tensor& hf, float dloss) {
  const int64_t t = pass.targets.numel();
  if (pass.logits.size(1) > 0) {
    ops::cross_entropy_backward(pass.logits, pass.logits, pass.targets.view({t}), pass.max,
                                pass.sumexp, filled({t}, dloss, device_), vocab_start());
  }
  const Tensor hf_full = enter_tp_forward(tp_, hf);
  Tensor dhf = Tensor::zeros({t, config_.hidden_size}, config_.params_dtype, device_);
  if (pass.logits.size(1) > 0)
    linear_backward(dhf, output_grad(), {}, pass.logits, hf_full, output_weight());
  pass.logits = Tensor();
  return enter_tp_backward(tp_, dhf);
}

float GPTModel::forward(const Tensor& ids, const Tensor& targets, int microbatch) {
  BRAID_CHECK(chunk().embedding && chunk().head, "GPTModel::forward: this model chunk is a ",
              "pipeline stage; use forward_stage");
  float loss = 0;
  forward_stage(ids, targets, Tensor(), microbatch, &loss);
  return loss;
}

void GPTModel::backward(int microbatch, float grad_scale) {
  BRAID_CHECK(chunk().embedding && chunk().head, "GPTModel::backward: this model chunk is a ",
              "pipeline stage; use backward_stage");
  backward_stage(Tensor(), microbatch, grad_scale);
}

Tensor GPTModel::forward_stage(const Tensor& ids, const Tensor& targets, const Tensor& input,
                               int microbatch, float* loss, bool training, int64_t first_sample) {
  BRAID_CHECK(!has_activations(microbatch), "GPTModel::forward: microbatch ", microbatch,
              " still holds the activations of a forward without backward");
  BRAID_CHECK(targets.defined() || !chunk().head, "GPTModel::forward: targets are required");
  auto mb = std::make_unique<Microbatch>(prepare(ids, chunk().head ? targets : Tensor()));
  if (training) {
    BRAID_CHECK(first_sample >= -1, "GPTModel::forward_stage: first_sample must be a sample ",
                "index or -1, got ", first_sample);
    if (first_sample < 0) {
      first_sample = dropout_samples_;
      dropout_samples_ += ids.size(0);
    }
    mb->first_sample = first_sample;
    mb->first_token = first_sample * ids.size(1);
  }
  const int64_t h = config_.hidden_size;
  const bool mtp = training && chunk().head && config_.mtp_num_layers > 0;
  if (mtp) mtp_prepare(*mb, ids, targets);

  Tensor x;
  if (chunk().embedding) {
    x = embed(*mb, training);
  } else {
    BRAID_CHECK(input.defined() && input.dim() == 2 && input.size(0) == region_tokens(*mb) &&
                    input.size(1) == h && input.dtype() == config_.params_dtype,
                "GPTModel::forward_stage: the input activation must be [", region_tokens(*mb), ", ",
                h, "] ", dtype_name(config_.params_dtype), ", got ",
                input.defined() ? dtype_name(input.dtype()) : "undefined ", input.shape());
    x = input;
  }
  x = run_layers(*mb, x, training);
  if (!chunk().head) {
    if (training) activations_.emplace(microbatch, std::move(mb));
    return x;
  }
  NormStats stats;
  Tensor hf = final_norm(x, stats);
  double sum = head_forward(mb->head, hf);
  if (cp_.active()) sum = sum_over(*cp_.group, sum);  // the other chunks' losses
  if (mtp) mtp_forward(*mb, hf);

  mb->trunk_out = x;
  if (config_.recompute == Recompute::none || mtp) {  // MTP keeps hf as its first depth's input
    mb->final_stats = stats;
    mb->final_out = hf;
  }
  const int64_t count = mb->head.count;
  if (training) activations_.emplace(microbatch, std::move(mb));
  if (loss != nullptr) *loss = count > 0 ? float(sum / double(count)) : 0.0f;
  return Tensor();
}

Tensor GPTModel::backward_stage(const Tensor& dout, int microbatch, float grad_scale) {
  auto it = activations_.find(microbatch);
  BRAID_CHECK(it != activations_.end(), "GPTModel::backward: microbatch ", microbatch,
              " has no activations (no forward, or its backward already ran)");
  Microbatch& mb = *it->second;
  const Tokens tokens = tokens_of(mb);
  const int64_t h = config_.hidden_size;

  Tensor dx;
  if (chunk().head) {  // the MTP depths, cross-entropy, LM head, final norm
    const Tensor dh0 = mb.mtp.empty() ? Tensor() : mtp_backward(mb, microbatch, grad_scale);
    NormStats stats = mb.final_stats;
    Tensor hf = mb.final_out.defined() ? mb.final_out : final_norm(mb.trunk_out, stats);
    Tensor dhf =
        head_backward(mb.head, hf, mb.head.count > 0 ? grad_scale / float(mb.head.count) : 0.0f);
    if (dh0.defined()) ops::add(dhf, dhf, dh0);
    mb.final_out = Tensor();
    hf = Tensor();
    dx = Tensor::empty(mb.trunk_out.shape(), config_.params_dtype, device_);
    norm_backward(config_, dx, parameter("model.norm.weight").grad,
                  view_of(flat_grads_, "model.norm.bias"), dhf, mb.trunk_out,
                  view_of(flat_params_, "model.norm.weight"), stats);
    dhf = Tensor();
    mb.trunk_out = Tensor();
    grads_done(microbatch, head_params_);
  } else {
    BRAID_CHECK(
        dout.defined() && dout.dim() == 2 && dout.size(0) == region_tokens(mb) && dout.size(1) == h,
        "GPTModel::backward_stage: the output gradient must be [", region_tokens(mb), ", ", h,
        "], got ", dout.shape());
    dx = dout;
  }

  // Blocks, last to first; a uniform recompute group of several blocks reruns its forward
  // first, all of it kept, and its blocks then go back as Recompute::none.
  const size_t group = recompute_group();
  for (size_t end = trunk_layers(); end > 0;) {
    const size_t begin = (end - 1) / group * group;
    if (group > 1) rerun_group(mb, begin, end);
    for (size_t l = end; l-- > begin;) {
      dx = layers_[l].backward(dx, tokens, dropout_context(mb, first_layer_ + int(l), true),
                               group > 1 ? Recompute::none : layer_policy(l), mb.layers[l],
                               grad_scale, &moe_stats_[l]);
      grads_done(microbatch, layer_params_[l]);
    }
    end = begin;
  }
  if (!chunk().embedding) {
    activations_.erase(it);
    return dx;
  }

  // Embeddings.
  dx = dropout_backward(mb, dx, 0);
  if (config_.position_embedding == PositionEmbedding::learned)
    ops::embedding_backward(parameter("model.embed_positions.weight").grad, dx, mb.positions);
  lookup_tokens_backward(dx, mb.ids);
  activations_.erase(it);
  grads_done(microbatch, embedding_params_);
  return Tensor();
}

void GPTModel::finalize_grads() {
  // Tied embeddings or MTP under pipeline parallelism: the first stage's lookup table and the
  // last stage's output weight or MTP lookup table are two copies of one parameter; their
  // gradients are summed.
  const bool holds_copy = (chunk().embedding || chunk().head) && config_.head_uses_embedding();
  if (embedding_group_ != nullptr && embedding_group_->size() > 1 && holds_copy)
    embedding_group_->all_reduce(parameter("model.embed_tokens.weight").grad)->wait();
  for (Parameter& p : params_) {
    // Gradients that are this rank's share: q_norm and k_norm (used on its heads only), a router
    // it runs on its own tokens (whole experts), and under SP the replicated layers used on its
    // tokens only - norms (MLA's latent norms too), MLA's down projections and position
    // embeddings, and MTP's eh_proj. (Row-parallel biases take their gradient from the gathered
    // output gradient, complete on every rank.)
    const std::string& name = p.spec.name;
    const bool partial =
        name.find("self_attn.q_norm.") != std::string::npos ||
        name.find("self_attn.k_norm.") != std::string::npos ||
        (ep_.whole_experts && name.find(".mlp.gate.") != std::string::npos) ||
        (p.spec.tp_dim < 0 && tp_.sharded_tokens() &&
         (name.find("norm.") != std::string::npos || name.find("_a_proj") != std::string::npos ||
          name.ends_with(".eh_proj.weight") || name == "model.embed_positions.weight"));
    if (partial) all_reduce_tp(tp_, p.grad);
    if (kv_group_ != nullptr && p.shard.replicas > 1 && p.spec.tp_dim == 0) {
      kv_group_->all_reduce(p.grad)->wait();  // each rank saw its own query heads' share
    }
  }
}

Tensor GPTModel::logits(const Tensor& ids) {
  BRAID_CHECK(chunk().embedding && chunk().head, "GPTModel::logits needs the whole model");
  BRAID_CONFIG_CHECK(!cp_.active(), "GPTModel::logits: not with context parallelism (each rank ",
                     "holds part of every sequence)");
  Microbatch mb = prepare(ids, Tensor());
  const int64_t b = ids.size(0), s = ids.size(1);
  NormStats stats;
  const Tensor hf =
      enter_tp_forward(tp_, final_norm(run_layers(mb, embed(mb, false), false), stats));
  return head_logits(hf, b, s);
}

Tensor GPTModel::head_logits(const Tensor& hf, int64_t b, int64_t s) {
  const int64_t t = b * s, v = config_.vocab_size;
  // Each rank's slice, padding rows included, so that the slices gather into one buffer.
  const ParamShard& vocab =
      shard_of(config_.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
  const std::string& head = config_.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  const Tensor w = flat_params_.slice(layout_.offsets[index_.at(head)], vocab.shape);
  Tensor local = Tensor::empty({t, w.size(0)}, config_.params_dtype, device_);
  linear_forward(local, hf, w, {});
  if (local.dtype() != DType::f32) {
    Tensor f32 = Tensor::empty(local.shape(), DType::f32, device_);
    ops::cast(f32, local);
    local = f32;
  }
  Tensor slices = local;
  if (tp_.active()) {
    slices = Tensor::empty({tp_.size(), t, w.size(0)}, DType::f32, device_);
    tp_.group->all_gather(local, slices)->wait();
  }
  const Tensor host = host_copy(slices);
  Tensor out = Tensor::empty({b, s, v}, DType::f32);
  const int64_t rows = w.size(0);
  for (int r = 0; r < tp_.size(); ++r) {
    const int64_t first = r * rows, width = std::clamp<int64_t>(v - first, 0, rows);
    for (int64_t i = 0; i < t; ++i) {
      std::memcpy(out.data_ptr<float>() + i * v + first,
                  host.data_ptr<float>() + (int64_t(r) * t + i) * rows, size_t(width) * 4);
    }
  }
  return out;
}

void GPTModel::zero_grad() { flat_grads_.zero_(); }

KVCache GPTModel::kv_cache(int64_t batch, int64_t capacity) const {
  const int64_t max_positions = config_.max_position_embeddings;
  if (capacity == 0) capacity = max_positions;
  BRAID_CONFIG_CHECK(batch > 0 && capacity > 0 && capacity <= max_positions,
                     "GPTModel::kv_cache: batch ", batch, " and capacity ", capacity,
                     " must be positive, the capacity at most max_position_embeddings ",
                     max_positions);
  const LayerShape n = LayerShape::of(config_, tp_.size());
  return KVCache(int(trunk_layers()), batch, capacity, n.kv_heads, n.head_dim, config_.params_dtype,
                 device_);
}

Tensor GPTModel::decode(const Tensor& ids, KVCache& cache, bool last_only) {
  BRAID_CHECK(chunk().embedding && chunk().head, "GPTModel::decode needs the whole model");
  BRAID_CONFIG_CHECK(!tp_.sharded_tokens() && !cp_.active(),
                     "GPTModel::decode: not with sequence or context parallelism");
  BRAID_CONFIG_CHECK(ids.defined() && ids.dim() == 2 && ids.dtype() == DType::i32,
                     "GPTModel::decode: ids must be [B, n] i32, got ",
                     ids.defined() ? dtype_name(ids.dtype()) : "", ids.shape());
  const int64_t b = ids.size(0), s = ids.size(1), offset = cache.length();
  BRAID_CONFIG_CHECK(cache.layers() == int(trunk_layers()) && cache.batch() == b &&
                         (cache.layers() == 0 || cache.keys(0).device() == device_),
                     "GPTModel::decode: the cache holds ", cache.batch(), " sequences of ",
                     cache.layers(), " layers; ids are ", ids.shape(), " for ", trunk_layers(),
                     " layers on ", device_.str(), " (make it with this model's kv_cache)");
  BRAID_CONFIG_CHECK(offset + s <= config_.max_position_embeddings,
                     "GPTModel::decode: positions up to ", offset + s,
                     " exceed max_position_embeddings ", config_.max_position_embeddings, " (",
                     offset, " in the cache + ", s, " new)");
  BRAID_CONFIG_CHECK(offset + s <= cache.capacity(), "GPTModel::decode: ", offset,
                     " positions in the cache + ", s, " new exceed its capacity ",
                     cache.capacity());
  Microbatch mb = prepare(ids, Tensor(), false);
  Tensor x = embed(mb, false, offset);
  const Tokens tokens = tokens_of(mb);  // no document masking over a KV cache
  for (size_t l = 0; l < trunk_layers(); ++l) {
    param_use(layer_params_[l]);
    x = layers_[l].forward_cached(x, tokens, cache, int(l));
  }
  cache.advance(s);
  int64_t rows = s;
  if (last_only && s > 1) {  // the head (a [T, V] GEMM) on each sequence's last position only
    const int64_t h = config_.hidden_size;
    Tensor last = Tensor::empty({b, h}, x.dtype(), device_);
    for (int64_t i = 0; i < b; ++i) last.narrow(i, 1).copy_from(x.narrow(i * s + s - 1, 1));
    x = last;
    rows = 1;
  }
  NormStats stats;
  return head_logits(enter_tp_forward(tp_, final_norm(x, stats)), b, rows);
}

}  // namespace braid::model
