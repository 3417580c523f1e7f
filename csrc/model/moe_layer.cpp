// TransformerLayer's mixture-of-experts MLP: the router, the dispatch to the (local) experts and
// back, the shared expert, and the MLP block around them when each TP rank routes its own tokens.
#include "braid/kernels/ops.h"
#include "braid/model/linear.h"
#include "braid/model/transformer_layer.h"
#include "model/layer_util.h"

namespace braid::model {
namespace {

// [0, 1, ..., t - 1] i32 on `device`: gather_rows' index of a per-token scale.
Tensor token_index(int64_t t, Device device) {
  Tensor host = Tensor::empty({t}, DType::i32);
  for (int64_t i = 0; i < t; ++i) host.data_ptr<int32_t>()[i] = int32_t(i);
  return device.is_cpu() ? host : host.to(device);
}

// f(local expert, first row, rows) for each of this rank's experts that has rows, in expert
// order.
template <typename F>
void for_each_expert(const ExpertDispatch& d, F&& f) {
  for (size_t e = 0; e + 1 < d.offsets.size(); ++e) {
    const int64_t rows = d.offsets[e + 1] - d.offsets[e];
    if (rows > 0) f(e, d.offsets[e], rows);
  }
}

// [N, C] for the experts' rows of `r`, and a row of zeros after them when pairs were dropped
// (their token_rows point there).
Tensor expert_rows(const MoeRouting& r, int64_t c, DType dtype, Device device) {
  const int64_t n = r.row_token.size(0);
  Tensor t = Tensor::empty({n + (r.dropped > 0 ? 1 : 0), c}, dtype, device);
  if (r.dropped > 0) t.narrow(n, 1).zero_();
  return t;
}

}  // namespace

Tensor TransformerLayer::mlp_block_forward(const Tensor& h2, int64_t rows,
                                           LayerActivations* saved) const {
  if (!routes_own_tokens())
    return exit_tp_forward(tp_, mlp_forward(enter_tp_forward(tp_, h2), rows, saved));
  Tensor m = moe_forward(h2, rows, saved, /*decoding=*/false);
  if (config_.moe_shared_expert_intermediate_size > 0) {
    const Tensor h_full = enter_tp_forward(tp_, h2);
    Tensor shared = Tensor::zeros({h_full.size(0), config_.hidden_size}, h2.dtype(), h2.device());
    shared_expert_forward(shared, h_full, saved);
    ops::add(m, m, exit_tp_forward(tp_, shared));
  }
  return m;
}

Tensor TransformerLayer::mlp_block_backward(const Tensor& dm, LayerActivations& a,
                                            float loss_scale) const {
  if (!routes_own_tokens()) {
    Tensor dm_full = exit_tp_backward(tp_, dm);
    Tensor dh = mlp_backward(dm_full, enter_tp_forward(tp_, a.post_norm_out), a, loss_scale);
    release(dm_full);
    return enter_tp_backward(tp_, dh);
  }
  Tensor dh = moe_backward(dm, a.post_norm_out, a, loss_scale);
  if (config_.moe_shared_expert_intermediate_size > 0) {
    const Tensor h_full = enter_tp_forward(tp_, a.post_norm_out);
    Tensor d_shared = Tensor::zeros(h_full.shape(), h_full.dtype(), h_full.device());
    shared_expert_backward(d_shared, exit_tp_backward(tp_, dm), h_full, a);
    ops::add(dh, dh, enter_tp_backward(tp_, d_shared));
  }
  return dh;
}

Tensor TransformerLayer::moe_forward(const Tensor& h_full, int64_t batch_rows,
                                     LayerActivations* saved, bool decoding) const {
  const TransformerConfig& c = config_;
  const int64_t t = h_full.size(0), h = c.hidden_size;
  const DType dt = h_full.dtype();
  const Device dev = h_full.device();
  // Every TP rank routes every token alike (the router is replicated and h_full whole) and runs
  // its share of each expert's columns; the combine is linear, so the partial outputs sum. Or,
  // with whole experts, each routes its own shard, and its outputs are whole.
  Tensor logits = Tensor::empty({t, c.num_experts}, DType::f32, dev);
  linear_forward(logits, h_full, w_.router_weight, w_.router_bias);
  MoeRouting r = route_tokens(logits, batch_rows, w_.expert_bias, c, tp_, routes_own_tokens(), cp_,
                              saved != nullptr, !decoding);
  ExpertDispatch d = plan_dispatch(r, ep_);
  Tensor in = expert_input(h_full, r, d);
  const int64_t m = d.rows();
  Tensor fc1 = Tensor::empty({m, w_.experts[0].fc1_weight.size(0)}, dt, dev);
  for_each_expert(d, [&](size_t e, int64_t first, int64_t rows) {
    linear_forward(fc1.narrow(first, rows), in.narrow(first, rows), w_.experts[e].fc1_weight,
                   w_.experts[e].fc1_bias);
  });
  Tensor act = mlp_activation(fc1);
  Tensor y = expert_rows(r, h, dt, dev);
  Tensor y_local = ep_.active() ? Tensor::empty({m, h}, dt, dev) : y.narrow(0, m);
  for_each_expert(d, [&](size_t e, int64_t first, int64_t rows) {
    linear_forward(y_local.narrow(first, rows), act.narrow(first, rows), w_.experts[e].fc2_weight,
                   expert_row_bias(w_.experts[e].fc2_bias));
  });
  return_rows(y.narrow(0, r.row_token.size(0)), y_local, d, ep_);
  Tensor m_out = Tensor::empty({t, h}, dt, dev);
  ops::combine_rows(m_out, y, r.token_rows, r.probs);
  if (c.moe_shared_expert_intermediate_size > 0 && !routes_own_tokens())
    shared_expert_forward(m_out, h_full, saved);
  if (saved != nullptr) {
    saved->router_logits = logits;
    saved->routing = std::move(r);
    saved->dispatch = std::move(d);
    saved->expert_in = in;
    saved->fc1_out = fc1;
    saved->act_out = act;
    saved->expert_out = y;
  }
  return m_out;
}

Tensor TransformerLayer::moe_backward(const Tensor& dm, const Tensor& h_full, LayerActivations& a,
                                      float loss_scale) const {
  const TransformerConfig& c = config_;
  const MoeRouting& r = a.routing;
  const int64_t t = h_full.size(0), n = r.row_token.size(0);
  const Device dev = h_full.device();
  Tensor dh = Tensor::empty(h_full.shape(), h_full.dtype(), dev);
  // The probabilities' gradient: each rank's expert outputs are partial sums, so are the dots
  // (whole when the rank routes its own tokens).
  Tensor dprobs = Tensor::empty(r.probs.shape(), DType::f32, dev);
  ops::combine_rows_weight_grad(dprobs, dm, a.expert_out, r.token_rows);
  if (!routes_own_tokens()) all_reduce_tp(tp_, dprobs);
  release(a.expert_out);
  const ExpertDispatch& d = a.dispatch;
  Tensor dy = Tensor::empty({n, c.hidden_size}, dm.dtype(), dev);
  ops::gather_rows(dy, dm, r.row_token, r.row_prob);
  dy = dispatch_rows(dy, d, ep_);
  Tensor d_act = empty_like(a.act_out);
  for_each_expert(d, [&](size_t e, int64_t first, int64_t rows) {
    linear_backward(d_act.narrow(first, rows), g_.experts[e].fc2_weight, g_.experts[e].fc2_bias,
                    dy.narrow(first, rows), a.act_out.narrow(first, rows),
                    w_.experts[e].fc2_weight);
  });
  release(dy, a.act_out);
  Tensor d_fc1 = empty_like(a.fc1_out);
  mlp_activation_backward(d_fc1, d_act, a.fc1_out);
  release(d_act, a.fc1_out);
  // Selective recomputation gathers (and dispatches) the input again.
  if (!a.expert_in.defined()) a.expert_in = expert_input(h_full, r, d);
  Tensor d_in = expert_rows(r, c.hidden_size, h_full.dtype(), dev);
  Tensor d_in_local = ep_.active() ? Tensor::empty({d.rows(), c.hidden_size}, h_full.dtype(), dev)
                                   : d_in.narrow(0, n);
  for_each_expert(d, [&](size_t e, int64_t first, int64_t rows) {
    linear_backward(d_in_local.narrow(first, rows), g_.experts[e].fc1_weight,
                    g_.experts[e].fc1_bias, d_fc1.narrow(first, rows),
                    a.expert_in.narrow(first, rows), w_.experts[e].fc1_weight);
  });
  release(d_fc1, a.expert_in);
  return_rows(d_in.narrow(0, n), d_in_local, d, ep_);
  release(d_in_local);
  ops::combine_rows(dh, d_in, r.token_rows, {});
  release(d_in);
  if (c.moe_shared_expert_intermediate_size > 0 && !routes_own_tokens())
    shared_expert_backward(dh, dm, h_full, a);

  // The router: every TP rank computes the same gradients; its share of dh is added once. (Or,
  // routing its own tokens, its tokens' dh and share of the weight's gradient, which
  // GPTModel::finalize_grads sums over TP.)
  Tensor aux;
  if (r.aux_grad.defined()) {
    aux = empty_like(r.aux_grad);
    ops::scale(aux, r.aux_grad, loss_scale);
  }
  Tensor dlogits = Tensor::empty({t, c.num_experts}, DType::f32, dev);
  ops::moe_router_backward(dlogits, dprobs, a.router_logits, r.experts, router_spec(c), aux,
                           r.z_grad * loss_scale);
  replicated_linear_backward(dh, g_.router_weight, g_.router_bias, dlogits, h_full,
                             w_.router_weight, routes_own_tokens());
  release(a.router_logits);
  return dh;
}

Tensor TransformerLayer::expert_input(const Tensor& h_full, const MoeRouting& r,
                                      const ExpertDispatch& d) const {
  Tensor in = Tensor::empty({r.row_token.size(0), h_full.size(1)}, h_full.dtype(), h_full.device());
  ops::gather_rows(in, h_full, r.row_token, {});
  return dispatch_rows(in, d, ep_);
}

void TransformerLayer::shared_expert_forward(Tensor m, const Tensor& h_full,
                                             LayerActivations* saved) const {
  const int64_t t = h_full.size(0);
  const MlpTensors& w = w_.shared_expert;
  Tensor fc1 = Tensor::empty({t, w.fc1_weight.size(0)}, h_full.dtype(), h_full.device());
  Tensor y = empty_like(m);
  Tensor act = mlp_rows(w, fc1, y, h_full);
  Tensor logit;
  if (config_.moe_shared_expert_gate) {  // y *= sigmoid(h w_gate), per token
    logit = Tensor::empty({t, 1}, DType::f32, h_full.device());
    linear_forward(logit, h_full, w_.shared_expert_gate, {});
    Tensor gate = empty_like(logit);
    ops::sigmoid_forward(gate, logit);
    Tensor gated = empty_like(y);
    ops::gather_rows(gated, y, token_index(t, h_full.device()), gate.view({t}));
    ops::add(m, m, gated);
  } else {
    ops::add(m, m, y);
  }
  if (saved != nullptr) {
    saved->shared_fc1_out = fc1;
    saved->shared_act_out = act;
    saved->shared_out = logit.defined() ? y : Tensor();
    saved->shared_gate_logit = logit;
  }
}

void TransformerLayer::shared_expert_backward(Tensor dh, const Tensor& dm, const Tensor& h_full,
                                              LayerActivations& a) const {
  const int64_t t = h_full.size(0);
  if (!a.shared_act_out.defined()) a.shared_act_out = mlp_activation(a.shared_fc1_out);
  Tensor dy = dm;
  if (config_.moe_shared_expert_gate) {
    // out = g y with g = sigmoid(logit): dy = g dm, dg = dm . y (partial under TP, as y is).
    const Device dev = h_full.device();
    const Tensor index = token_index(t, dev);
    Tensor gate = empty_like(a.shared_gate_logit);
    ops::sigmoid_forward(gate, a.shared_gate_logit);
    dy = empty_like(dm);
    ops::gather_rows(dy, dm, index, gate.view({t}));
    Tensor dgate = empty_like(gate);
    ops::combine_rows_weight_grad(dgate, dm, a.shared_out, index.view({t, 1}));
    all_reduce_tp(tp_, dgate);
    Tensor dlogit = empty_like(gate);
    ops::sigmoid_backward(dlogit, dgate, a.shared_gate_logit);
    replicated_linear_backward(dh, g_.shared_expert_gate, {}, dlogit, h_full,
                               w_.shared_expert_gate);
    release(a.shared_out, a.shared_gate_logit);
  }
  mlp_rows_backward(w_.shared_expert, g_.shared_expert, dh, dy, h_full, a.shared_fc1_out,
                    a.shared_act_out, true);
  release(a.shared_fc1_out, a.shared_act_out);
}

}  // namespace braid::model
