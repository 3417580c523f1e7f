#include "braid/engine/adamw.h"

#include <cmath>

namespace braid::engine {

void AdamWConfig::validate() const {
  BRAID_CONFIG_CHECK(std::isfinite(lr) && lr >= 0, "AdamWConfig.lr must be >= 0, got ", lr);
  BRAID_CONFIG_CHECK(beta1 >= 0 && beta1 < 1, "AdamWConfig.beta1 must be in [0, 1), got ", beta1);
  BRAID_CONFIG_CHECK(beta2 >= 0 && beta2 < 1, "AdamWConfig.beta2 must be in [0, 1), got ", beta2);
  BRAID_CONFIG_CHECK(eps > 0 && std::isfinite(eps), "AdamWConfig.eps must be positive, got ", eps);
  BRAID_CONFIG_CHECK(weight_decay >= 0 && std::isfinite(weight_decay),
                     "AdamWConfig.weight_decay must be >= 0, got ", weight_decay);
  BRAID_CONFIG_CHECK(clip_grad >= 0 && std::isfinite(clip_grad),
                     "AdamWConfig.clip_grad must be >= 0 (0: off), got ", clip_grad);
}

AdamW::AdamW(model::GPTModel& model, AdamWConfig config) : model_(model), config_(config) {
  config_.validate();
  const Tensor& flat = model.flat_params();
  const bool f32_params = flat.dtype() == DType::f32;
  if (f32_params) {
    master_ = flat;
  } else {
    master_ = Tensor::empty(flat.shape(), DType::f32, flat.device());
    ops::cast(master_, flat);
  }
  exp_avg_ = Tensor::zeros(flat.shape(), DType::f32, flat.device());
  exp_avg_sq_ = Tensor::zeros(flat.shape(), DType::f32, flat.device());
  const model::ParamLayout& layout = model.layout();
  std::vector<model::Parameter>& params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const model::Parameter& p = params[i];
    const int64_t offset = layout.offsets[i];
    const Shape& shape = p.value.shape();  // this rank's shard
    groups_.push_back(ops::AdamWGroup{master_.slice(offset, shape), p.grad,
                                      exp_avg_.slice(offset, shape),
                                      exp_avg_sq_.slice(offset, shape), weight_decay_of(p.spec),
                                      f32_params ? Tensor() : p.value});
    grads_by_replicas_[p.shard.replicas].push_back(p.grad);
  }
}

float AdamW::weight_decay_of(const model::ParamSpec& spec) const {
  const bool decay = spec.weight_decay || (config_.decay_embeddings && model::is_embedding(spec));
  return decay ? config_.weight_decay : 0.0f;
}

float AdamW::grad_norm() const {
  // Every parameter counts once: a shard that k TP ranks hold adds 1/k of its squares on each.
  double local = 0;
  for (const auto& [replicas, grads] : grads_by_replicas_) {
    Tensor sum = Tensor::empty({1}, DType::f32, model_.device());
    ops::sum_of_squares(sum, grads);
    local += sum.item(0) / replicas;
  }
  const model::TensorParallel& tp = model_.tensor_parallel();
  if (!tp.active()) return float(std::sqrt(local));
  Tensor total = Tensor::empty({1}, DType::f32);
  total.data_ptr<float>()[0] = float(local);
  if (tp.group->device().is_cuda()) total = total.to(tp.group->device());
  tp.group->all_reduce(total)->wait();
  return float(std::sqrt(total.item(0)));
}

float AdamW::clip_and_step(float lr) {
  BRAID_CHECK(std::isfinite(lr) && lr >= 0, "AdamW: learning rate must be >= 0, got ", lr);
  const float norm = grad_norm();
  BRAID_CHECK(std::isfinite(norm), "AdamW: the global gradient norm is ", norm, " at step ",
              step_ + 1, "; parameters were not updated");
  ops::AdamWHyper hyper;
  hyper.lr = lr;
  hyper.beta1 = config_.beta1;
  hyper.beta2 = config_.beta2;
  hyper.eps = config_.eps;
  hyper.step = step_ + 1;
  if (config_.clip_grad > 0) {
    const float coeff = config_.clip_grad / (norm + 1e-6f);
    if (coeff < 1.0f) hyper.grad_scale = coeff;
  }
  ops::adamw_step(groups_, hyper);
  ++step_;
  return norm;
}

}  // namespace braid::engine
