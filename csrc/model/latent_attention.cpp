// Multi-latent attention (DeepSeek-V2/V3, megatron-core's MLASelfAttention): TransformerLayer's
// projections when config.multi_latent_attention (config.h). With Lq, Lkv the latent ranks,
// Dn + Dr = D the query/key head and Dv the value head, for the normed input h:
//   q           = norm(h W_qa^T) W_qb^T             (h W_q^T without a query latent)
//   c_kv        = norm(h W_kva[:Lkv]^T)             the latent, one per token
//   k_pe        = rope(h W_kva[Lkv:]^T)             one RoPE key part per token, every head's
//   [k_nope, v] = c_kv W_kvb^T                      per head: Dn key and Dv value channels
//   k = [k_nope | k_pe], q's last Dr channels rotated, v padded to D with zeros
// so that attention runs on heads of one width (its output's padding is zero and dropped before
// o_proj). Under TP the down projections and the latent norms are replicated and the up
// projections split by heads, so the gradients of the latents and of k_pe are each rank's heads'
// share, summed over TP (the backward of Megatron's column-parallel up projections):
// - without sequence parallelism every rank runs the replicated layers on every token, all-reduces
//   the three gradients, and adds their share of dh once (TP rank 0);
// - with it (megatron-core's MLA under SP) each rank runs them on its own tokens and all-gathers
//   [q latent | kv latent | k_pe] - Lq + Lkv + Dr channels a token instead of the hidden state's
//   H - and in the backward reduce-scatters their gradients the same way, so the replicated
//   layers' gradients are each rank's tokens' shares (GPTModel::finalize_grads sums them over TP)
//   and dh is the rank's own, with no further TP reduction. q_proj (no query latent) is column-
//   parallel on the gathered hidden state, as in Megatron.
// With YaRN, q is multiplied by config.softmax_scale_factor() after RoPE: the scores are linear
// in q, so attention's 1/sqrt(D) becomes DeepSeek's softmax scale. Every path that projects sees
// it (training, both recomputes, decoding: the KV cache holds k, which it leaves alone).

#include "braid/kernels/ops.h"
#include "braid/model/linear.h"
#include "braid/model/transformer_layer.h"
#include "model/layer_util.h"

namespace braid::model {
namespace {

// A latent's norm (q_a_layernorm, kv_a_layernorm) with qk_layernorm; x itself without.
Tensor latent_norm(const TransformerConfig& c, NormStats& stats, const Tensor& x,
                   const Tensor& weight, const Tensor& bias) {
  return c.qk_layernorm ? norm_forward(c, stats, x, weight, bias) : x;
}

Tensor latent_norm_backward(const TransformerConfig& c, const Tensor& dy, const Tensor& x,
                            const Tensor& weight, Tensor dweight, Tensor dbias,
                            const NormStats& stats) {
  if (!c.qk_layernorm) return dy;
  Tensor dx = empty_like(x);
  norm_backward(c, dx, dweight, dbias, dy, x, weight, stats);
  return dx;
}

// Columns [first, first + width) of `all` [R, C] as a tensor of their own.
Tensor columns(const Tensor& all, int64_t first, int64_t width) {
  Tensor out = Tensor::empty({all.size(0), width}, all.dtype(), all.device());
  ops::copy_columns(out, 0, all, first, width);
  return out;
}

}  // namespace

TransformerLayer::Projection TransformerLayer::project_latent(const Tensor& h, Tokens tokens,
                                                              int64_t position_offset) const {
  const TransformerConfig& c = config_;
  const bool sharded = tp_.sharded_tokens();  // h is this rank's tokens
  const int64_t b = tokens.batch, s = tokens.seq, local = h.size(0);
  const int64_t dr = c.qk_pos_emb_head_dim, lq = c.q_lora_rank, lkv = c.kv_lora_rank;
  const DType dt = h.dtype();
  const Device dev = h.device();
  Projection p;
  // The replicated down projections and latent norms, on the tokens this rank holds.
  if (lq > 0) {
    p.q_latent_in = Tensor::empty({local, lq}, dt, dev);
    linear_forward(p.q_latent_in, h, w_.q_a_weight, {});
    p.q_latent =
        latent_norm(c, p.q_latent_stats, p.q_latent_in, w_.q_a_norm_weight, w_.q_a_norm_bias);
  }
  p.kv_latent_in = Tensor::empty({local, lkv}, dt, dev);
  linear_forward(p.kv_latent_in, h, w_.kv_a_weight.narrow(0, lkv), {});
  p.kv_latent =
      latent_norm(c, p.kv_latent_stats, p.kv_latent_in, w_.kv_a_norm_weight, w_.kv_a_norm_bias);
  Tensor k_pe = Tensor::empty({local, dr}, dt, dev);
  linear_forward(k_pe, h, w_.kv_a_weight.narrow(lkv, dr), {});
  if (sharded) {  // every token's [q latent | kv latent | k_pe], in one all-gather
    Tensor mine = Tensor::empty({local, lq + lkv + dr}, dt, dev);
    if (lq > 0) ops::copy_columns(mine, 0, p.q_latent, 0, lq);
    ops::copy_columns(mine, lq, p.kv_latent, 0, lkv);
    ops::copy_columns(mine, lq + lkv, k_pe, 0, dr);
    const Tensor all = enter_tp_forward(tp_, mine);
    if (lq > 0) p.q_latent = columns(all, 0, lq);
    p.kv_latent = columns(all, lq, lkv);
    k_pe = columns(all, lq + lkv, dr);
  }

  rotate(k_pe.view({b, s, 1, dr}), tokens, position_offset, false);
  p.k_pe = k_pe;
  latent_up(p, lq > 0 ? p.q_latent : enter_tp_forward(tp_, h), tokens, position_offset);
  return p;
}

void TransformerLayer::latent_up(Projection& p, const Tensor& q_in, Tokens tokens,
                                 int64_t position_offset) const {
  const TransformerConfig& c = config_;
  const int64_t b = tokens.batch, s = tokens.seq, t = tokens.count();
  const int64_t heads = shape_.q_heads, d = shape_.head_dim, dn = c.qk_head_dim;
  const int64_t dv = c.v_head_dim;
  const DType dt = q_in.dtype();
  const Device dev = q_in.device();
  p.q = Tensor::empty({b, s, heads, d}, dt, dev);
  linear_forward(p.q.view({t, heads * d}), q_in, w_.q_weight, {});
  rotate(p.q, tokens, position_offset, false, dn);
  if (c.softmax_scale_factor() != 1.0f) ops::scale(p.q, p.q, c.softmax_scale_factor());

  Tensor kv = Tensor::empty({t * heads, dn + dv}, dt, dev);
  linear_forward(kv.view({t, heads * (dn + dv)}), p.kv_latent, w_.kv_b_weight, {});
  p.k = Tensor::empty({b, s, heads, d}, dt, dev);
  ops::copy_columns(p.k.view({t * heads, d}), 0, kv, 0, dn);
  ops::broadcast_heads(p.k.view({t, heads, d}), dn, p.k_pe);
  p.v = Tensor::zeros({b, s, heads, d}, dt, dev);
  ops::copy_columns(p.v.view({t * heads, d}), 0, kv, dn, dv);
}

bool TransformerLayer::recomputes_up_projections(Recompute policy) const {
  return policy == Recompute::selective && config_.recompute_mla_up_proj;
}

Tensor TransformerLayer::latent_backward(Tensor dq, const Tensor& dk, const Tensor& dv,
                                         const Tensor& h, Tokens tokens,
                                         LayerActivations& a) const {
  const TransformerConfig& c = config_;
  const bool sharded = tp_.sharded_tokens();
  const int64_t b = tokens.batch, s = tokens.seq, t = tokens.count();
  const int64_t heads = shape_.q_heads, d = shape_.head_dim, dn = c.qk_head_dim;
  const int64_t dr = c.qk_pos_emb_head_dim, lq = c.q_lora_rank, lkv = c.kv_lora_rank;
  const DType dt = h.dtype();
  const Device dev = h.device();
  if (c.softmax_scale_factor() != 1.0f) ops::scale(dq, dq, c.softmax_scale_factor());
  rotate(dq, tokens, 0, true, dn);
  // The keys' RoPE part is every head's: its gradient is the sum over the heads, turned back.
  Tensor dk_pe = Tensor::empty({b, s, 1, dr}, dt, dev);
  ops::sum_heads(dk_pe.view({t, dr}), dk.view({t, heads, d}), dn);
  rotate(dk_pe, tokens, 0, true);
  Tensor dkv = Tensor::empty({t * heads, dn + c.v_head_dim}, dt, dev);
  ops::copy_columns(dkv, 0, dk.view({t * heads, d}), 0, dn);
  ops::copy_columns(dkv, dn, dv.view({t * heads, d}), 0, c.v_head_dim);
  Tensor d_kv_latent = Tensor::empty({t, lkv}, dt, dev);
  linear_backward(d_kv_latent, g_.kv_b_weight, {}, dkv.view({t, heads * (dn + c.v_head_dim)}),
                  a.kv_latent, w_.kv_b_weight);
  release(dkv);
  Tensor d_q_latent;
  if (lq > 0) {
    d_q_latent = Tensor::empty({t, lq}, dt, dev);
    linear_backward(d_q_latent, g_.q_weight, {}, dq.view({t, heads * d}), a.q_latent, w_.q_weight);
  }
  // The heads' shares summed over TP: all of them, or (SP) this rank's tokens' in one
  // reduce-scatter.
  Tensor dk_pe_rows = dk_pe.view({t, dr});
  if (sharded) {
    Tensor all = Tensor::empty({t, lq + lkv + dr}, dt, dev);
    if (lq > 0) ops::copy_columns(all, 0, d_q_latent, 0, lq);
    ops::copy_columns(all, lq, d_kv_latent, 0, lkv);
    ops::copy_columns(all, lq + lkv, dk_pe_rows, 0, dr);
    const Tensor mine = exit_tp_forward(tp_, all);
    if (lq > 0) d_q_latent = columns(mine, 0, lq);
    d_kv_latent = columns(mine, lq, lkv);
    dk_pe_rows = columns(mine, lq + lkv, dr);
  } else {
    for (const Tensor& g : {d_q_latent, d_kv_latent, dk_pe_rows})
      if (g.defined()) all_reduce_tp(tp_, g);
  }

  // dh: the replicated layers' share added once (TP rank 0) when every rank ran them on every
  // token; each rank's own under SP.
  Tensor dh = lq > 0 || !sharded ? Tensor::empty(h.shape(), dt, dev) : Tensor();
  const bool adds_dh = sharded || tp_.rank() == 0;
  if (lq > 0) {
    const Tensor d_q_in =
        latent_norm_backward(c, d_q_latent, a.q_latent_in, w_.q_a_norm_weight, g_.q_a_norm_weight,
                             g_.q_a_norm_bias, a.q_latent_stats);
    if (!adds_dh) dh.zero_();
    linear_backward(adds_dh ? dh : Tensor(), g_.q_a_weight, {}, d_q_in, h, w_.q_a_weight);
  } else if (sharded) {  // q_proj, column-parallel on the gathered h: its dh reduce-scattered
    const Tensor h_all = enter_tp_forward(tp_, h);
    Tensor dh_all = Tensor::empty(h_all.shape(), dt, dev);
    linear_backward(dh_all, g_.q_weight, {}, dq.view({t, heads * d}), h_all, w_.q_weight);
    dh = exit_tp_forward(tp_, dh_all);
  } else {
    linear_backward(dh, g_.q_weight, {}, dq.view({t, heads * d}), h, w_.q_weight);
  }
  const Tensor d_kv_in =
      latent_norm_backward(c, d_kv_latent, a.kv_latent_in, w_.kv_a_norm_weight, g_.kv_a_norm_weight,
                           g_.kv_a_norm_bias, a.kv_latent_stats);
  linear_backward(adds_dh ? dh : Tensor(), g_.kv_a_weight.narrow(0, lkv), {}, d_kv_in, h,
                  w_.kv_a_weight.narrow(0, lkv), true);
  linear_backward(adds_dh ? dh : Tensor(), g_.kv_a_weight.narrow(lkv, dr), {}, dk_pe_rows, h,
                  w_.kv_a_weight.narrow(lkv, dr), true);
  release(a.q_latent_in, a.q_latent, a.kv_latent_in, a.kv_latent, a.k_pe);
  a.q_latent_stats = a.kv_latent_stats = NormStats{};
  if (!sharded) all_reduce_tp(tp_, dh);  // the ranks' partial sums (without TP: nothing)
  return dh;
}

Tensor TransformerLayer::o_input(const Tensor& attn) const {
  const int64_t t = attn.size(0) * attn.size(1), heads = shape_.q_heads, d = shape_.head_dim;
  if (!config_.multi_latent_attention) return attn.view({t, heads * d});
  const int64_t dv = config_.v_head_dim;
  Tensor out = Tensor::empty({t, heads * dv}, attn.dtype(), attn.device());
  ops::copy_columns(out.view({t * heads, dv}), 0, attn.view({t * heads, d}), 0, dv);
  return out;
}

Tensor TransformerLayer::o_input_grad(const Tensor& d_o_in, Tokens tokens) const {
  const int64_t t = tokens.count(), heads = shape_.q_heads, d = shape_.head_dim;
  if (!config_.multi_latent_attention) return d_o_in.view({tokens.batch, tokens.seq, heads, d});
  const int64_t dv = config_.v_head_dim;
  Tensor out = Tensor::zeros({tokens.batch, tokens.seq, heads, d}, d_o_in.dtype(), d_o_in.device());
  ops::copy_columns(out.view({t * heads, d}), 0, d_o_in.view({t * heads, dv}), 0, dv);
  return out;
}

}  // namespace braid::model
