#include "braid/model/moe.h"

#include "braid/kernels/ops.h"

namespace braid::model {
namespace {

Tensor host_copy(const Tensor& t) { return t.device().is_cpu() ? t : t.to(Device::cpu()); }

Tensor on(Device device, const Tensor& host) { return device.is_cpu() ? host : host.to(device); }

}  // namespace

MoeRouting route_tokens(const Tensor& logits, const TransformerConfig& config,
                        const TensorParallel& tp, const ContextParallel& cp, bool load_balancing) {
  const int64_t t_count = logits.size(0), e_count = config.num_experts;
  const int64_t k = config.moe_router_topk, n = t_count * k;
  const Device device = logits.device();
  const bool aux = load_balancing && config.moe_aux_loss_coeff > 0;
  MoeRouting r;
  r.probs = Tensor::empty({t_count, k}, DType::f32, device);
  r.experts = Tensor::empty({t_count, k}, DType::i32, device);
  Tensor score_sums = aux ? Tensor::empty({e_count}, DType::f32, device) : Tensor();
  ops::moe_router_forward(r.probs, r.experts, score_sums, logits, config.moe_router_pre_softmax);
  if (tp.active()) {
    tp.group->broadcast(r.experts, 0)->wait();
    tp.group->broadcast(r.probs, 0)->wait();
  }

  // Counting sort of the (token, choice) pairs by expert, stable in token order.
  const Tensor chosen = host_copy(r.experts);
  const int32_t* ex = chosen.data_ptr<int32_t>();
  r.offsets.assign(size_t(e_count + 1), 0);
  for (int64_t i = 0; i < n; ++i) ++r.offsets[size_t(ex[i]) + 1];
  for (int64_t e = 0; e < e_count; ++e) r.offsets[size_t(e + 1)] += r.offsets[size_t(e)];
  Tensor row_token = Tensor::empty({n}, DType::i32), row_slot = Tensor::empty({n}, DType::i32);
  Tensor token_rows = Tensor::empty({t_count, k}, DType::i32);
  std::vector<int64_t> next(r.offsets.begin(), r.offsets.end() - 1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = next[size_t(ex[i])]++;
    row_token.data_ptr<int32_t>()[row] = int32_t(i / k);
    row_slot.data_ptr<int32_t>()[row] = int32_t(i);
    token_rows.data_ptr<int32_t>()[i] = int32_t(row);
  }
  r.row_token = on(device, row_token);
  r.token_rows = on(device, token_rows);
  r.row_prob = Tensor::empty({n}, DType::f32, device);
  ops::gather_rows(r.row_prob.view({n, 1}), r.probs.view({n, 1}), on(device, row_slot), {});
  if (!aux) return r;

  Tensor counts = Tensor::empty({e_count}, DType::f32);
  for (int64_t e = 0; e < e_count; ++e)
    counts.data_ptr<float>()[e] = float(r.offsets[size_t(e + 1)] - r.offsets[size_t(e)]);
  if (cp.active()) {
    Tensor reduced = on(cp.group->device(), counts);
    cp.group->all_reduce(reduced)->wait();
    counts = host_copy(reduced);
  }
  const double tokens = double(t_count) * cp.size();
  const double unit = double(e_count) / (double(k) * tokens * tokens);
  const Tensor sums = host_copy(score_sums);
  Tensor grad = Tensor::empty({e_count}, DType::f32);
  for (int64_t e = 0; e < e_count; ++e) {
    const double c = counts.data_ptr<float>()[e];
    grad.data_ptr<float>()[e] = float(config.moe_aux_loss_coeff * unit * c);
    r.aux_loss += unit * c * sums.data_ptr<float>()[e];
  }
  r.aux_grad = on(device, grad);
  return r;
}

}  // namespace braid::model
