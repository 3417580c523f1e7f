// Multi-token prediction (config.h; megatron-core's MultiTokenPredictionBlock): the depths after
// the last layer of the last pipeline stage.
//
// Depth k reads the ids shifted left by k and h_{k-1} (h_0: the final norm's output):
//   x = eh_proj([enorm(dropout(lookup(ids_k))) | hnorm(h_{k-1})]),
//   h_k = shared_head.norm(layer_k(x)),
// and its loss is the shared output head's cross-entropy on the targets shifted left by k.
// Every tensor is a residual-stream region (this rank's tokens under SP and CP). eh_proj is
// replicated over TP: under SP each rank projects its own tokens, with no collective, and
// finalize_grads sums its gradient (and the norms') over TP; without SP every rank projects
// every token. The layer is a TransformerLayer like the others, with the config's recompute.

#include <string>

#include "braid/kernels/ops.h"
#include "braid/model/linear.h"
#include "braid/model/norm.h"
#include "model/gpt_model_internal.h"

namespace braid::model {

using namespace gpt_model_detail;

namespace {

std::string depth_prefix(const TransformerConfig& c, int64_t k) {
  return "model.layers." + std::to_string(c.num_layers + k - 1) + ".";
}

// Dropout site of depth k's embedding output (after every block's, gpt_model_internal.h).
uint64_t embedding_site(const TransformerConfig& c, int64_t k) {
  return 2 * uint64_t(c.num_layers + c.mtp_num_layers) + uint64_t(k);
}

}  // namespace

std::vector<GPTModel::MtpLoss> GPTModel::take_mtp_losses() {
  std::vector<MtpLoss> out(mtp_losses_.size());
  std::swap(out, mtp_losses_);
  return out;
}

void GPTModel::mtp_prepare(Microbatch& mb, const Tensor& ids, const Tensor& targets) const {
  const Tensor host_ids = host_copy(ids), host_targets = host_copy(targets);
  const int64_t b = ids.size(0), s = ids.size(1);
  mb.mtp.resize(size_t(config_.mtp_num_layers));
  for (int64_t k = 1; k <= config_.mtp_num_layers; ++k) {
    // Megatron's roll: position i reads position i + k; the last k get id 0 and no target.
    Tensor shifted_ids = Tensor::empty({b, s}, DType::i32);
    Tensor shifted_targets = Tensor::empty({b, s}, DType::i32);
    MtpDepth& d = mb.mtp[size_t(k - 1)];
    for (int64_t r = 0; r < b; ++r) {
      for (int64_t i = 0; i < s; ++i) {
        const bool inside = i + k < s;
        const int64_t from = r * s + i + k;
        shifted_ids.data_ptr<int32_t>()[r * s + i] =
            inside ? host_ids.data_ptr<int32_t>()[from] : 0;
        const int32_t target = inside ? host_targets.data_ptr<int32_t>()[from] : -1;
        shifted_targets.data_ptr<int32_t>()[r * s + i] = target;
        d.head.count += target >= 0;
      }
    }
    if (cp_.active()) {
      shifted_ids = split_sequence(cp_, shifted_ids);
      shifted_targets = split_sequence(cp_, shifted_targets);
    }
    d.ids = shifted_ids.to(device_);
    d.head.targets = shifted_targets.to(device_);
  }
}

void GPTModel::mtp_forward(Microbatch& mb, const Tensor& h0) {
  const int64_t h = config_.hidden_size, rows = region_tokens(mb);
  Tensor hidden = h0;
  for (int64_t k = 1; k <= config_.mtp_num_layers; ++k) {
    MtpDepth& d = mb.mtp[size_t(k - 1)];
    const size_t l = trunk_layers() + size_t(k - 1);
    const std::string p = depth_prefix(config_, k);
    param_use(layer_params_[l]);
    d.embedded = dropout(mb, lookup_tokens(d.ids), embedding_site(config_, k), true);
    d.hidden = hidden;
    d.projection_input = Tensor::empty({rows, 2 * h}, config_.params_dtype, device_);
    const Tensor e =
        norm_forward(config_, d.enorm_stats, d.embedded, view_of(flat_params_, p + "enorm.weight"),
                     view_of(flat_params_, p + "enorm.bias"));
    ops::copy_columns(d.projection_input, 0, e, 0, h);
    const Tensor hn =
        norm_forward(config_, d.hnorm_stats, d.hidden, view_of(flat_params_, p + "hnorm.weight"),
                     view_of(flat_params_, p + "hnorm.bias"));
    ops::copy_columns(d.projection_input, h, hn, 0, h);
    Tensor x = Tensor::empty({rows, h}, config_.params_dtype, device_);
    linear_forward(x, d.projection_input, view_of(flat_params_, p + "eh_proj.weight"), {});
    const int layer = first_layer_ + int(l);
    d.layer_out = layers_[l].forward(x, tokens_of(mb), dropout_context(mb, layer, true),
                                     config_.recompute, &d.layer);
    d.out = norm_forward(config_, d.out_stats, d.layer_out,
                         view_of(flat_params_, p + "shared_head.norm.weight"),
                         view_of(flat_params_, p + "shared_head.norm.bias"));
    double sum = head_forward(d.head, d.out);
    if (cp_.active()) sum = sum_over(*cp_.group, sum);  // the other chunks' losses
    mtp_losses_[size_t(k - 1)].sum += sum;
    mtp_losses_[size_t(k - 1)].count += d.head.count;
    hidden = d.out;
  }
}

Tensor GPTModel::mtp_backward(Microbatch& mb, int microbatch, float grad_scale) {
  const int64_t h = config_.hidden_size, rows = region_tokens(mb);
  // Each depth's cross-entropies weigh mtp_loss_scaling_factor / depths over the main loss's
  // token count (Megatron's per-token loss).
  const float dloss = mb.head.count > 0 ? grad_scale * config_.mtp_loss_scaling_factor /
                                              float(config_.mtp_num_layers) / float(mb.head.count)
                                        : 0.0f;
  Tensor dhidden;  // d(h_k), from depth k + 1's hnorm
  for (int64_t k = config_.mtp_num_layers; k >= 1; --k) {
    MtpDepth& d = mb.mtp[size_t(k - 1)];
    const size_t l = trunk_layers() + size_t(k - 1);
    const std::string p = depth_prefix(config_, k);
    Tensor dout = head_backward(d.head, d.out, dloss);
    if (dhidden.defined()) ops::add(dout, dout, dhidden);
    d.out = Tensor();
    Tensor dlayer_out = Tensor::empty({rows, h}, config_.params_dtype, device_);
    norm_backward(config_, dlayer_out, parameter(p + "shared_head.norm.weight").grad,
                  view_of(flat_grads_, p + "shared_head.norm.bias"), dout, d.layer_out,
                  view_of(flat_params_, p + "shared_head.norm.weight"), d.out_stats);
    dout = Tensor();
    d.layer_out = Tensor();
    const int layer = first_layer_ + int(l);
    const Tensor dx =
        layers_[l].backward(dlayer_out, tokens_of(mb), dropout_context(mb, layer, true),
                            config_.recompute, d.layer, grad_scale, &moe_stats_[l]);
    dlayer_out = Tensor();
    Tensor dprojection = Tensor::empty({rows, 2 * h}, config_.params_dtype, device_);
    linear_backward(dprojection, parameter(p + "eh_proj.weight").grad, {}, dx, d.projection_input,
                    view_of(flat_params_, p + "eh_proj.weight"));
    d.projection_input = Tensor();
    Tensor de = Tensor::empty({rows, h}, config_.params_dtype, device_);
    Tensor dhn = Tensor::empty({rows, h}, config_.params_dtype, device_);
    ops::copy_columns(de, 0, dprojection, 0, h);
    ops::copy_columns(dhn, 0, dprojection, h, h);
    dprojection = Tensor();
    Tensor dembedded = Tensor::empty({rows, h}, config_.params_dtype, device_);
    norm_backward(config_, dembedded, parameter(p + "enorm.weight").grad,
                  view_of(flat_grads_, p + "enorm.bias"), de, d.embedded,
                  view_of(flat_params_, p + "enorm.weight"), d.enorm_stats);
    lookup_tokens_backward(dropout_backward(mb, dembedded, embedding_site(config_, k)), d.ids);
    dhidden = Tensor::empty({rows, h}, config_.params_dtype, device_);
    norm_backward(config_, dhidden, parameter(p + "hnorm.weight").grad,
                  view_of(flat_grads_, p + "hnorm.bias"), dhn, d.hidden,
                  view_of(flat_params_, p + "hnorm.weight"), d.hnorm_stats);
    d = MtpDepth{};  // its lookup, input and statistics, freed before the next depth's backward
    grads_done(microbatch, layer_params_[l]);
  }
  mb.mtp.clear();
  return dhidden;
}

}  // namespace braid::model
