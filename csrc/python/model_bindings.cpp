// TransformerConfig and GPTModel.

#include <pybind11/stl.h>

#include <cstring>

#include "bindings.h"
#include "braid/model/config.h"
#include "braid/model/gpt_model.h"
#include "braid/model/kv_cache.h"
#include "braid/model/parameters.h"

namespace braid::python {
namespace {

using model::GPTModel;
using model::KVCache;
using model::TransformerConfig;

template <typename Enum>
void def_enum_property(py::class_<TransformerConfig>& cls, const char* name,
                       Enum TransformerConfig::*field) {
  cls.def_property(
      name, [field](const TransformerConfig& c) { return std::string(model::to_string(c.*field)); },
      [field](TransformerConfig& c, const std::string& value) {
        model::from_string(value, c.*field);
      });
}

}  // namespace

void bind_model(py::module_& m) {
  py::class_<TransformerConfig> cfg(
      m, "TransformerConfig", "GPT-2 / Llama model shape. Start from a preset and change fields.");
  cfg.def(py::init<>())
      .def_static("preset", &TransformerConfig::preset, py::arg("name"))
      .def_static("preset_names", &TransformerConfig::preset_names)
      .def("validate", &TransformerConfig::validate)
      .def_property_readonly("head_dim", &TransformerConfig::head_dim)
      .def_property_readonly("kv_heads", &TransformerConfig::kv_heads)
      .def("num_parameters", &model::count_parameters,
           "The model's parameters (vocabulary unpadded), counted without building it.")
      .def_readwrite("num_layers", &TransformerConfig::num_layers)
      .def_readwrite("hidden_size", &TransformerConfig::hidden_size)
      .def_readwrite("num_attention_heads", &TransformerConfig::num_attention_heads)
      .def_readwrite("num_query_groups", &TransformerConfig::num_query_groups)
      .def_readwrite("kv_channels", &TransformerConfig::kv_channels)
      .def_readwrite("ffn_hidden_size", &TransformerConfig::ffn_hidden_size)
      .def_readwrite("vocab_size", &TransformerConfig::vocab_size)
      .def_readwrite("max_position_embeddings", &TransformerConfig::max_position_embeddings)
      .def_readwrite("rope_theta", &TransformerConfig::rope_theta)
      .def_readwrite("rope_scaling_factor", &TransformerConfig::rope_scaling_factor)
      .def_readwrite("rope_low_freq_factor", &TransformerConfig::rope_low_freq_factor)
      .def_readwrite("rope_high_freq_factor", &TransformerConfig::rope_high_freq_factor)
      .def_readwrite("rope_original_max_position_embeddings",
                     &TransformerConfig::rope_original_max_position_embeddings)
      .def_readwrite("rope_yarn_factor", &TransformerConfig::rope_yarn_factor)
      .def_readwrite("rope_linear_factor", &TransformerConfig::rope_linear_factor)
      .def_readwrite("rotary_interleaved", &TransformerConfig::rotary_interleaved)
      .def_readwrite("rope_yarn_truncate", &TransformerConfig::rope_yarn_truncate)
      .def_readwrite("glu_linear_offset", &TransformerConfig::glu_linear_offset)
      .def_readwrite("activation_clamp", &TransformerConfig::activation_clamp)
      .def_readwrite("rope_yarn_beta_fast", &TransformerConfig::rope_yarn_beta_fast)
      .def_readwrite("rope_yarn_beta_slow", &TransformerConfig::rope_yarn_beta_slow)
      .def_readwrite("rope_yarn_mscale", &TransformerConfig::rope_yarn_mscale)
      .def_readwrite("rope_yarn_mscale_all_dim", &TransformerConfig::rope_yarn_mscale_all_dim)
      .def_property_readonly("rope_attention_factor", &TransformerConfig::rope_attention_factor)
      .def_property_readonly("softmax_scale_factor", &TransformerConfig::softmax_scale_factor)
      .def_readwrite("rotary_percent", &TransformerConfig::rotary_percent)
      .def_property_readonly("rotary_dim", &TransformerConfig::rotary_dim)
      .def_readwrite("norm_eps", &TransformerConfig::norm_eps)
      .def_readwrite("add_bias_linear", &TransformerConfig::add_bias_linear)
      .def_readwrite("add_qkv_bias", &TransformerConfig::add_qkv_bias)
      .def_readwrite("qk_layernorm", &TransformerConfig::qk_layernorm)
      .def_readwrite("multi_latent_attention", &TransformerConfig::multi_latent_attention)
      .def_readwrite("q_lora_rank", &TransformerConfig::q_lora_rank)
      .def_readwrite("kv_lora_rank", &TransformerConfig::kv_lora_rank)
      .def_readwrite("qk_head_dim", &TransformerConfig::qk_head_dim)
      .def_readwrite("qk_pos_emb_head_dim", &TransformerConfig::qk_pos_emb_head_dim)
      .def_readwrite("v_head_dim", &TransformerConfig::v_head_dim)
      .def_property_readonly("value_head_dim", &TransformerConfig::value_head_dim)
      .def_readwrite("window_size", &TransformerConfig::window_size)
      .def_readwrite("window_layers", &TransformerConfig::window_layers)
      .def_readwrite("num_experts", &TransformerConfig::num_experts)
      .def_readwrite("moe_router_topk", &TransformerConfig::moe_router_topk)
      .def_readwrite("moe_ffn_hidden_size", &TransformerConfig::moe_ffn_hidden_size)
      .def_readwrite("moe_router_pre_softmax", &TransformerConfig::moe_router_pre_softmax)
      .def_readwrite("moe_aux_loss_coeff", &TransformerConfig::moe_aux_loss_coeff)
      .def_readwrite("moe_router_num_groups", &TransformerConfig::moe_router_num_groups)
      .def_readwrite("moe_router_group_topk", &TransformerConfig::moe_router_group_topk)
      .def_readwrite("moe_router_topk_scaling_factor",
                     &TransformerConfig::moe_router_topk_scaling_factor)
      .def_readwrite("moe_router_enable_expert_bias",
                     &TransformerConfig::moe_router_enable_expert_bias)
      .def_readwrite("moe_router_bias_update_rate", &TransformerConfig::moe_router_bias_update_rate)
      .def_readwrite("moe_z_loss_coeff", &TransformerConfig::moe_z_loss_coeff)
      .def_readwrite("moe_expert_capacity_factor", &TransformerConfig::moe_expert_capacity_factor)
      .def_readwrite("moe_shared_expert_intermediate_size",
                     &TransformerConfig::moe_shared_expert_intermediate_size)
      .def_readwrite("moe_shared_expert_gate", &TransformerConfig::moe_shared_expert_gate)
      .def_readwrite("moe_layers", &TransformerConfig::moe_layers)
      .def_readwrite("zero_centered_gamma", &TransformerConfig::zero_centered_gamma)
      .def_readwrite("tie_embeddings", &TransformerConfig::tie_embeddings)
      .def_readwrite("mtp_num_layers", &TransformerConfig::mtp_num_layers)
      .def_readwrite("mtp_loss_scaling_factor", &TransformerConfig::mtp_loss_scaling_factor)
      .def_readwrite("init_std", &TransformerConfig::init_std)
      .def_readwrite("embedding_init_std", &TransformerConfig::embedding_init_std)
      .def_readwrite("hidden_dropout", &TransformerConfig::hidden_dropout)
      .def_readwrite("attention_dropout", &TransformerConfig::attention_dropout)
      .def_readwrite("make_vocab_size_divisible_by",
                     &TransformerConfig::make_vocab_size_divisible_by)
      .def_property(
          "params_dtype", [](const TransformerConfig& c) { return dtype_name(c.params_dtype); },
          [](TransformerConfig& c, const std::string& v) { c.params_dtype = dtype_from_name(v); });
  def_enum_property(cfg, "normalization", &TransformerConfig::normalization);
  def_enum_property(cfg, "activation", &TransformerConfig::activation);
  def_enum_property(cfg, "position_embedding", &TransformerConfig::position_embedding);
  def_enum_property(cfg, "recompute", &TransformerConfig::recompute);
  def_enum_property(cfg, "recompute_method", &TransformerConfig::recompute_method);
  def_enum_property(cfg, "moe_router_score_function",
                    &TransformerConfig::moe_router_score_function);
  def_enum_property(cfg, "moe_router_load_balancing_type",
                    &TransformerConfig::moe_router_load_balancing_type);
  def_enum_property(cfg, "moe_token_drop_policy", &TransformerConfig::moe_token_drop_policy);
  def_enum_property(cfg, "softmax_type", &TransformerConfig::softmax_type);
  cfg.def_readwrite("recompute_num_layers", &TransformerConfig::recompute_num_layers);
  cfg.def_readwrite("recompute_mla_up_proj", &TransformerConfig::recompute_mla_up_proj);

  py::class_<KVCache>(m, "KVCache",
                      "Keys and values of the positions a model has seen, per layer (inference). "
                      "Make one with GPTModel.kv_cache; GPTModel.decode fills it.")
      .def_property_readonly("batch", &KVCache::batch)
      .def_property_readonly("capacity", &KVCache::capacity)
      .def_property_readonly("length", &KVCache::length, "Positions filled so far.")
      .def_property_readonly("num_layers", &KVCache::layers)
      .def("keys", &KVCache::keys, py::arg("layer"),
           "[batch, capacity, kv_heads, head_dim] (after rope); positions [0, length) are set.")
      .def("values", &KVCache::values, py::arg("layer"))
      .def("reset", &KVCache::reset, "Forgets every position; the buffers stay allocated.");

  py::class_<GPTModel>(m, "GPTModel",
                       "A GPT-2 / Llama model in one process, with explicit "
                       "forward and backward.")
      .def(py::init([](const TransformerConfig& config, const std::string& device, uint64_t seed) {
             return std::make_unique<GPTModel>(config, device_from_name(device), seed);
           }),
           py::arg("config"), py::arg("device") = "cpu", py::arg("seed") = 1234)
      .def_property_readonly(
          "config", [](const GPTModel& g) { return g.config(); },
          "A copy of the model's configuration (changing it does not change the model).")
      .def_property_readonly("device", [](const GPTModel& g) { return g.device().str(); })
      .def("num_parameters", &GPTModel::num_parameters)
      .def(
          "forward",
          [](GPTModel& g, py::handle ids, py::handle targets, int microbatch) {
            Tensor i = token_tensor(ids, "ids"), t = token_tensor(targets, "targets");
            py::gil_scoped_release release;
            return g.forward(i, t, microbatch);
          },
          py::arg("ids"), py::arg("targets"), py::arg("microbatch") = 0,
          "Mean loss over the targets that are >= 0; keeps activations for backward.")
      .def(
          "backward",
          [](GPTModel& g, int microbatch, float grad_scale) {
            py::gil_scoped_release release;
            g.backward(microbatch, grad_scale);
          },
          py::arg("microbatch") = 0, py::arg("grad_scale") = 1.0f)
      .def(
          "logits",
          [](GPTModel& g, py::handle ids) {
            Tensor i = token_tensor(ids, "ids");
            py::gil_scoped_release release;
            return g.logits(i);
          },
          py::arg("ids"), "Logits [B, S, V] (f32, CPU) without keeping activations.")
      .def("zero_grad", &GPTModel::zero_grad)
      .def("set_document_masking", &GPTModel::set_document_masking, py::arg("eod"),
           py::arg("reset_attention_mask"), py::arg("reset_position_ids"),
           "Megatron's --reset-attention-mask / --reset-position-ids: documents end at each "
           "`eod` token; attention stays within a document, positions restart at each.")
      .def(
          "take_moe_losses",
          [](GPTModel& g) {
            model::MoeLosses sum;
            for (const auto& [layer, l] : g.take_moe_losses()) {
              sum.load_balancing += l.load_balancing;
              sum.z += l.z;
            }
            return py::make_tuple(sum.load_balancing, sum.z);
          },
          "Mixture of experts: (load-balancing loss, z-loss), each without its coefficient, "
          "summed over the layers and the microbatches whose backward ran since the last call "
          "(0 for a loss whose coefficient is 0); resets them.")
      .def(
          "take_mtp_losses",
          [](GPTModel& g) {
            py::list out;
            for (const GPTModel::MtpLoss& l : g.take_mtp_losses())
              out.append(py::make_tuple(l.sum, l.count));
            return out;
          },
          "Multi-token prediction: per depth, (sum of its cross-entropies, count of its "
          "non-ignored shifted targets) over the training forwards since the last call; resets "
          "them.")
      .def(
          "expert_biases",
          [](GPTModel& g) {
            py::dict out;
            for (const auto& [name, bias] : g.expert_biases()) out[py::str(name)] = bias;
            return out;
          },
          "moe_router_enable_expert_bias: name -> each expert layer's bias [E] f32 (the "
          "tensors the routers read: writes change the model).")
      .def(
          "update_expert_bias", [](GPTModel& g) { g.update_expert_bias(nullptr); },
          "Moves each expert bias by the tokens its experts took since the last call "
          "(one process; the Trainer does this after every step).")
      .def("kv_cache", &GPTModel::kv_cache, py::arg("batch"), py::arg("capacity") = 0,
           "An empty KVCache for `batch` sequences of up to `capacity` positions (0: "
           "max_position_embeddings).")
      .def(
          "decode",
          [](GPTModel& g, py::handle ids, KVCache& cache, bool last_only) {
            Tensor i = token_tensor(ids, "ids");
            py::gil_scoped_release release;
            return g.decode(i, cache, last_only);
          },
          py::arg("ids"), py::arg("cache"), py::arg("last_only") = false,
          "ids [B, n]: the next n tokens after the cache.length positions the cache holds. "
          "Appends them to the cache and returns their logits [B, n, V] (f32, CPU), or with "
          "last_only [B, 1, V] of the last one. ValueError past max_position_embeddings.")
      .def(
          "parameters",
          [](GPTModel& g) {
            py::dict out;
            for (auto& p : g.parameters()) out[py::str(p.spec.name)] = p.value;
            return out;
          },
          "Parameter name -> Tensor (views into the flat buffer: writes change the model).")
      .def(
          "gradients",
          [](GPTModel& g) {
            py::dict out;
            for (auto& p : g.parameters()) out[py::str(p.spec.name)] = p.grad;
            return out;
          },
          "Parameter name -> f32 gradient Tensor (views into the flat gradient buffer).")
      .def_property_readonly("flat_params", &GPTModel::flat_params)
      .def_property_readonly("flat_grads", &GPTModel::flat_grads);
}

}  // namespace braid::python
