#include "braid/model/transformer_layer.h"

#include "braid/kernels/ops.h"
#include "braid/model/linear.h"

namespace braid::model {
namespace {

Tensor empty_like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), t.device()); }

// Inverted dropout into a new tensor; `x` itself when dropout is off.
Tensor dropout(const Tensor& x, float p, uint64_t seed, uint64_t offset) {
  if (p == 0.0f) return x;
  Tensor out = empty_like(x);
  ops::dropout_forward(out, x, p, seed, offset);
  return out;
}

Tensor dropout_grad(const Tensor& dout, float p, uint64_t seed, uint64_t offset) {
  if (p == 0.0f) return dout;
  Tensor dx = empty_like(dout);
  ops::dropout_backward(dx, dout, p, seed, offset);
  return dx;
}

// Drops these references now, so that memory is returned as early as possible.
template <typename... Tensors>
void release(Tensors&... tensors) {
  ((tensors = Tensor()), ...);
}

// Row slices of the fused [q; k; v] weight or bias (dim 0): the q, k and v parts.
struct QKV {
  Tensor q, k, v;
};
QKV split_qkv(const Tensor& fused, int64_t q_rows, int64_t kv_rows) {
  if (!fused.defined()) return {};
  return {fused.narrow(0, q_rows), fused.narrow(q_rows, kv_rows),
          fused.narrow(q_rows + kv_rows, kv_rows)};
}

}  // namespace

TransformerLayer::TransformerLayer(const TransformerConfig& config, LayerTensors weights,
                                   LayerTensors grads)
    : config_(config), w_(std::move(weights)), g_(std::move(grads)) {}

Tensor TransformerLayer::mlp_activation(const Tensor& fc1_out) const {
  const int64_t f = config_.ffn_hidden_size;
  Tensor act =
      Tensor::empty({fc1_out.size(0), fc1_out.size(1), f}, fc1_out.dtype(), fc1_out.device());
  if (config_.activation == Activation::swiglu) {
    ops::swiglu_forward(act, fc1_out);
  } else {
    ops::gelu_forward(act, fc1_out);
  }
  return act;
}

Tensor TransformerLayer::forward(const Tensor& x, const DropoutContext& drop, Recompute policy,
                                 LayerActivations* saved) const {
  const TransformerConfig& c = config_;
  BRAID_CHECK(x.dim() == 3 && x.size(2) == c.hidden_size, "TransformerLayer: input must be [B, S, ",
              c.hidden_size, "], got ", x.shape());
  const int64_t b = x.size(0), s = x.size(1), d = c.head_dim();
  const int64_t hq = c.num_attention_heads, hkv = c.kv_heads();
  const int64_t fc1_cols =
      c.activation == Activation::swiglu ? 2 * c.ffn_hidden_size : c.ffn_hidden_size;
  const DType dt = x.dtype();
  const Device dev = x.device();

  NormStats s1;
  Tensor h1 =
      norm_forward(c.normalization, c.norm_eps, s1, x, w_.input_norm_weight, w_.input_norm_bias);
  const QKV wqkv = split_qkv(w_.qkv_weight, hq * d, hkv * d);
  const QKV bqkv = split_qkv(w_.qkv_bias, hq * d, hkv * d);
  Tensor q = Tensor::empty({b, s, hq, d}, dt, dev);
  Tensor k = Tensor::empty({b, s, hkv, d}, dt, dev);
  Tensor v = Tensor::empty({b, s, hkv, d}, dt, dev);
  linear_forward(q.view({b, s, hq * d}), h1, wqkv.q, bqkv.q);
  linear_forward(k.view({b, s, hkv * d}), h1, wqkv.k, bqkv.k);
  linear_forward(v.view({b, s, hkv * d}), h1, wqkv.v, bqkv.v);
  if (c.position_embedding == PositionEmbedding::rope) {
    ops::rope_forward(q, q, c.rope_theta);
    ops::rope_forward(k, k, c.rope_theta);
  }
  Tensor attn = Tensor::empty({b, s, hq, d}, dt, dev);
  Tensor lse = Tensor::empty({b, hq, s}, DType::f32, dev);
  ops::attention_forward(attn, lse, q, k, v);

  Tensor a = Tensor::empty({b, s, c.hidden_size}, dt, dev);
  linear_forward(a, attn.view({b, s, hq * d}), w_.o_weight, w_.o_bias);
  a = dropout(a, drop.p, drop.seed, drop.attention_offset);
  Tensor mid = a;  // the residual add writes over the branch output
  ops::add(mid, x, a);

  NormStats s2;
  Tensor h2 =
      norm_forward(c.normalization, c.norm_eps, s2, mid, w_.post_norm_weight, w_.post_norm_bias);
  Tensor fc1 = Tensor::empty({b, s, fc1_cols}, dt, dev);
  linear_forward(fc1, h2, w_.fc1_weight, w_.fc1_bias);
  Tensor act = mlp_activation(fc1);
  Tensor m = Tensor::empty({b, s, c.hidden_size}, dt, dev);
  linear_forward(m, act, w_.fc2_weight, w_.fc2_bias);
  m = dropout(m, drop.p, drop.seed, drop.mlp_offset);
  Tensor out = m;
  ops::add(out, mid, m);

  if (saved != nullptr) {
    *saved = LayerActivations{};
    saved->input = x;
    if (policy != Recompute::full) {
      saved->q = q;
      saved->k = k;
      saved->v = v;
      saved->attn_out = attn;
      saved->lse = lse;
      saved->mid = mid;
      saved->fc1_out = fc1;
    }
    if (policy == Recompute::none) {
      saved->input_norm_stats = s1;
      saved->input_norm_out = h1;
      saved->post_norm_stats = s2;
      saved->post_norm_out = h2;
      saved->act_out = act;
    }
  }
  return out;
}

Tensor TransformerLayer::backward(const Tensor& dout, const DropoutContext& drop, Recompute policy,
                                  LayerActivations& saved) const {
  const TransformerConfig& c = config_;
  BRAID_CHECK(saved.input.defined(), "TransformerLayer::backward: no saved activations");
  if (policy == Recompute::full) {
    const Tensor input = saved.input;  // forward() resets `saved` before refilling it
    forward(input, drop, Recompute::none, &saved);
  } else if (policy == Recompute::selective) {
    saved.input_norm_out = norm_forward(c.normalization, c.norm_eps, saved.input_norm_stats,
                                        saved.input, w_.input_norm_weight, w_.input_norm_bias);
    saved.post_norm_out = norm_forward(c.normalization, c.norm_eps, saved.post_norm_stats,
                                       saved.mid, w_.post_norm_weight, w_.post_norm_bias);
    saved.act_out = mlp_activation(saved.fc1_out);
  }
  LayerActivations& a = saved;
  const int64_t b = dout.size(0), s = dout.size(1), d = c.head_dim();
  const int64_t hq = c.num_attention_heads, hkv = c.kv_heads();

  // MLP block.
  Tensor dm = dropout_grad(dout, drop.p, drop.seed, drop.mlp_offset);
  Tensor d_act = empty_like(a.act_out);
  linear_backward(d_act, g_.fc2_weight, g_.fc2_bias, dm, a.act_out, w_.fc2_weight);
  release(dm, a.act_out);
  Tensor d_fc1 = empty_like(a.fc1_out);
  if (c.activation == Activation::swiglu) {
    ops::swiglu_backward(d_fc1, d_act, a.fc1_out);
  } else {
    ops::gelu_backward(d_fc1, d_act, a.fc1_out);
  }
  release(d_act, a.fc1_out);
  Tensor dh2 = empty_like(a.mid);
  linear_backward(dh2, g_.fc1_weight, g_.fc1_bias, d_fc1, a.post_norm_out, w_.fc1_weight);
  release(d_fc1, a.post_norm_out);
  Tensor dmid = empty_like(a.mid);
  norm_backward(c.normalization, dmid, g_.post_norm_weight, g_.post_norm_bias, dh2, a.mid,
                w_.post_norm_weight, a.post_norm_stats);
  ops::add(dmid, dmid, dout);
  release(dh2, a.mid, a.post_norm_stats.mean, a.post_norm_stats.rstd);

  // Attention block.
  Tensor da = dropout_grad(dmid, drop.p, drop.seed, drop.attention_offset);
  Tensor d_attn = empty_like(a.attn_out);
  linear_backward(d_attn.view({b, s, hq * d}), g_.o_weight, g_.o_bias, da,
                  a.attn_out.view({b, s, hq * d}), w_.o_weight);
  release(da);
  Tensor dq = empty_like(a.q), dk = empty_like(a.k), dv = empty_like(a.v);
  ops::attention_backward(dq, dk, dv, d_attn, a.q, a.k, a.v, a.attn_out, a.lse);
  release(d_attn, a.q, a.k, a.v);
  release(a.attn_out, a.lse);
  if (c.position_embedding == PositionEmbedding::rope) {
    ops::rope_backward(dq, dq, c.rope_theta);
    ops::rope_backward(dk, dk, c.rope_theta);
  }
  const QKV wqkv = split_qkv(w_.qkv_weight, hq * d, hkv * d);
  const QKV gw = split_qkv(g_.qkv_weight, hq * d, hkv * d);
  const QKV gb = split_qkv(g_.qkv_bias, hq * d, hkv * d);
  const Tensor& h1 = a.input_norm_out;
  Tensor dh1 = empty_like(h1);
  linear_backward(dh1, gw.q, gb.q, dq.view({b, s, hq * d}), h1, wqkv.q);
  linear_backward(dh1, gw.k, gb.k, dk.view({b, s, hkv * d}), h1, wqkv.k, true);
  linear_backward(dh1, gw.v, gb.v, dv.view({b, s, hkv * d}), h1, wqkv.v, true);
  release(dq, dk, dv, a.input_norm_out);
  Tensor dx = empty_like(a.input);
  norm_backward(c.normalization, dx, g_.input_norm_weight, g_.input_norm_bias, dh1, a.input,
                w_.input_norm_weight, a.input_norm_stats);
  ops::add(dx, dx, dmid);
  saved = LayerActivations{};
  return dx;
}

}  // namespace braid::model
