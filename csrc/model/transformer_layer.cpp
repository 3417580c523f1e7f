#include "braid/model/transformer_layer.h"

#include <algorithm>

#include "braid/kernels/ops.h"
#include "braid/model/linear.h"
#include "model/layer_util.h"

namespace braid::model {
namespace {

// RoPE on each head's channels [first_channel, first_channel + rotary_dim()); MLA's pairs are
// always interleaved (DeepSeek's and megatron-core's), the others with rotary_interleaved.
ops::RotaryFrequencies rotary(const TransformerConfig& c, int64_t first_channel) {
  return {.theta = c.rope_theta,
          .llama3_factor = c.rope_scaling_factor,
          .low_freq_factor = c.rope_low_freq_factor,
          .high_freq_factor = c.rope_high_freq_factor,
          .original_max_positions = float(c.rope_original_max_position_embeddings),
          .rotary_dim = c.rotary_dim(),
          .first_channel = first_channel,
          .interleaved = c.multi_latent_attention || c.rotary_interleaved,
          .linear_factor = c.rope_linear_factor,
          .yarn_factor = c.rope_yarn_factor,
          .yarn_beta_fast = c.rope_yarn_beta_fast,
          .yarn_beta_slow = c.rope_yarn_beta_slow,
          .yarn_truncate = c.rope_yarn_truncate,
          .attention_factor = c.rope_attention_factor()};
}

ops::GluSpec glu_spec(const TransformerConfig& c) {
  return {.quick_gelu = c.activation == Activation::quick_geglu,
          .clamp = c.activation_clamp,
          .linear_offset = c.glu_linear_offset};
}

// Per-head q and k norms (qk_layernorm without MLA, whose qk_layernorm norms the latents).
bool per_head_qk_norms(const TransformerConfig& c) {
  return c.qk_layernorm && !c.multi_latent_attention;
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

std::vector<DropoutContext::TokenRun> DropoutContext::token_runs_of(int64_t rows, int64_t len,
                                                                    int cp_rank, int cp_size,
                                                                    int64_t shard, int64_t count,
                                                                    int64_t first_token) {
  const bool chunked = cp_size > 1;
  const int64_t seq = chunked ? 2 * cp_size * len : len;
  std::vector<TokenRun> runs;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t sequence = chunked ? r % (rows / 2) : r;
    const int64_t position =
        chunked ? ContextParallel::chunk_of(cp_rank, cp_size, int(r / (rows / 2))) * len : 0;
    const int64_t begin = std::max(r * len, shard), end = std::min((r + 1) * len, shard + count);
    if (begin >= end) continue;
    const int64_t first = first_token + sequence * seq + position + (begin - r * len);
    if (!runs.empty() && runs.back().local + runs.back().count == begin - shard &&
        runs.back().first + runs.back().count == first) {
      runs.back().count += end - begin;  // the next tokens of the run's too: one call
    } else {
      runs.push_back({begin - shard, end - begin, first});
    }
  }
  return runs;
}

Tensor DropoutContext::apply(const Tensor& x, uint64_t offset) const {
  if (p == 0.0f) return x;
  const int64_t per_token = x.numel() / x.size(0);
  const std::vector<TokenRun> runs =
      token_runs.empty() ? std::vector<TokenRun>{{0, x.size(0), 0}} : token_runs;
  int64_t covered = 0;
  for (const TokenRun& run : runs) covered += run.count;
  BRAID_CHECK(covered == x.size(0), "DropoutContext: its token runs cover ", covered,
              " tokens, the activation has ", x.size(0));
  Tensor out = empty_like(x);
  for (const TokenRun& run : runs)
    ops::dropout_forward(out.narrow(run.local, run.count), x.narrow(run.local, run.count), p, seed,
                         offset, run.first * per_token);
  return out;
}

LayerShape LayerShape::of(const TransformerConfig& c, int tp) {
  LayerShape s;
  s.head_dim = c.head_dim();
  s.q_heads = c.num_attention_heads / tp;
  s.kv_heads = c.kv_heads() >= tp ? c.kv_heads() / tp : 1;
  s.ffn = c.mlp_hidden_size() / tp;
  return s;
}

TransformerLayer::TransformerLayer(const TransformerConfig& config, int64_t layer,
                                   const TensorParallel& tp, const ContextParallel& cp,
                                   const ExpertParallel& ep, LayerTensors weights,
                                   LayerTensors grads)
    : config_(config),
      tp_(tp),
      cp_(cp),
      ep_(ep),
      shape_(LayerShape::of(config, tp.size())),
      window_(config.attention_window(layer)),
      moe_(config.is_moe_layer(layer)),
      w_(std::move(weights)),
      g_(std::move(grads)) {
  if (config.softmax_type == SoftmaxType::off_by_one)
    zero_sinks_ = Tensor::zeros({shape_.q_heads}, w_.o_weight.dtype(), w_.o_weight.device());
}

Tensor TransformerLayer::mlp_activation(const Tensor& fc1_out) const {
  const bool gated = config_.gated_activation();
  Tensor act = Tensor::empty({fc1_out.size(0), gated ? fc1_out.size(1) / 2 : fc1_out.size(1)},
                             fc1_out.dtype(), fc1_out.device());
  switch (config_.activation) {
    case Activation::swiglu:
    case Activation::quick_geglu:
      ops::glu_forward(act, fc1_out, glu_spec(config_));
      break;
    case Activation::squared_relu:
      ops::squared_relu_forward(act, fc1_out);
      break;
    case Activation::gelu:
      ops::gelu_forward(act, fc1_out);
      break;
    case Activation::gelu_exact:
      ops::gelu_exact_forward(act, fc1_out);
      break;
  }
  return act;
}

void TransformerLayer::mlp_activation_backward(Tensor d_fc1, const Tensor& d_act,
                                               const Tensor& fc1_out) const {
  switch (config_.activation) {
    case Activation::swiglu:
    case Activation::quick_geglu:
      ops::glu_backward(d_fc1, d_act, fc1_out, glu_spec(config_));
      break;
    case Activation::squared_relu:
      ops::squared_relu_backward(d_fc1, d_act, fc1_out);
      break;
    case Activation::gelu:
      ops::gelu_backward(d_fc1, d_act, fc1_out);
      break;
    case Activation::gelu_exact:
      ops::gelu_exact_backward(d_fc1, d_act, fc1_out);
      break;
  }
}

Tensor TransformerLayer::mlp_rows(const MlpTensors& w, Tensor fc1, Tensor y,
                                  const Tensor& x) const {
  linear_forward(fc1, x, w.fc1_weight, w.fc1_bias);
  Tensor act = mlp_activation(fc1);
  linear_forward(y, act, w.fc2_weight, row_bias(w.fc2_bias));
  return act;
}

void TransformerLayer::mlp_rows_backward(const MlpTensors& w, const MlpTensors& g, Tensor dx,
                                         const Tensor& dy, const Tensor& x, const Tensor& fc1,
                                         const Tensor& act, bool accumulate) const {
  Tensor d_act = empty_like(act);
  linear_backward(d_act, g.fc2_weight, g.fc2_bias, dy, act, w.fc2_weight);
  Tensor d_fc1 = empty_like(fc1);
  mlp_activation_backward(d_fc1, d_act, fc1);
  release(d_act);
  linear_backward(dx, g.fc1_weight, g.fc1_bias, d_fc1, x, w.fc1_weight, accumulate);
}

Tensor TransformerLayer::mlp_forward(const Tensor& h_full, int64_t rows, LayerActivations* saved,
                                     bool decoding) const {
  if (moe_) return moe_forward(h_full, rows, saved, decoding);
  const int64_t t = h_full.size(0);
  Tensor fc1 = Tensor::empty({t, w_.mlp.fc1_weight.size(0)}, h_full.dtype(), h_full.device());
  Tensor m = Tensor::empty({t, config_.hidden_size}, h_full.dtype(), h_full.device());
  Tensor act = mlp_rows(w_.mlp, fc1, m, h_full);
  if (saved != nullptr) {
    saved->fc1_out = fc1;
    saved->act_out = act;
  }
  return m;
}

Tensor TransformerLayer::mlp_backward(const Tensor& dm, const Tensor& h_full, LayerActivations& a,
                                      float loss_scale) const {
  if (moe_) return moe_backward(dm, h_full, a, loss_scale);
  Tensor dh = Tensor::empty(h_full.shape(), h_full.dtype(), h_full.device());
  mlp_rows_backward(w_.mlp, g_.mlp, dh, dm, h_full, a.fc1_out, a.act_out, false);
  release(a.fc1_out, a.act_out);
  return dh;
}

// A replicated linear layer with f32 output (the router, the shared expert's gate): on the whole
// tokens every TP rank computes the same weight gradient and its share of dx is added once; on
// each rank's own tokens (own_tokens) each adds its dx and holds a share of the weight gradient.
void TransformerLayer::replicated_linear_backward(Tensor dx, Tensor dweight, Tensor dbias,
                                                  const Tensor& dy, const Tensor& x,
                                                  const Tensor& weight, bool own_tokens) const {
  Tensor d = dy;
  if (x.dtype() != DType::f32) {  // the GEMMs take operands of one dtype
    d = Tensor::empty(dy.shape(), x.dtype(), dy.device());
    ops::cast(d, dy);
  }
  linear_backward(own_tokens || tp_.rank() == 0 ? dx : Tensor(), dweight, dbias, d, x, weight,
                  true);
}

// A row-parallel layer's bias is added once, by TP rank 0, before the partial sums are
// reduced; its gradient is the column sum of the reduced output's gradient on every rank.
Tensor TransformerLayer::row_bias(const Tensor& bias) const {
  return tp_.rank() == 0 ? bias : Tensor();
}

Tensor TransformerLayer::attention_input(const Tensor& h1) const {
  return config_.multi_latent_attention ? h1 : enter_tp_forward(tp_, h1);
}

TransformerLayer::Projection TransformerLayer::project(const Tensor& h, Tokens tokens,
                                                       int64_t position_offset) const {
  return config_.multi_latent_attention ? project_latent(h, tokens, position_offset)
                                        : project_qkv(h, tokens, position_offset);
}

TransformerLayer::Projection TransformerLayer::project_qkv(const Tensor& h, Tokens tokens,
                                                           int64_t position_offset) const {
  const LayerShape& n = shape_;
  const int64_t b = tokens.batch, s = tokens.seq, t = tokens.count(), d = n.head_dim;
  const DType dt = h.dtype();
  const Device dev = h.device();
  const QKV wqkv = split_qkv(w_.qkv_weight, n.q_heads * d, n.kv_heads * d);
  const QKV bqkv = split_qkv(w_.qkv_bias, n.q_heads * d, n.kv_heads * d);
  Projection p;
  p.q = Tensor::empty({b, s, n.q_heads, d}, dt, dev);
  p.k = Tensor::empty({b, s, n.kv_heads, d}, dt, dev);
  p.v = Tensor::empty({b, s, n.kv_heads, d}, dt, dev);
  linear_forward(p.q.view({t, n.q_heads * d}), h, wqkv.q, bqkv.q);
  linear_forward(p.k.view({t, n.kv_heads * d}), h, wqkv.k, bqkv.k);
  linear_forward(p.v.view({t, n.kv_heads * d}), h, wqkv.v, bqkv.v);
  if (config_.qk_layernorm) {
    p.q_raw = p.q;
    p.k_raw = p.k;
  }
  finish_qk(p, tokens, position_offset);
  return p;
}

void TransformerLayer::finish_qk(Projection& p, Tokens tokens, int64_t position_offset) const {
  const TransformerConfig& c = config_;
  const LayerShape& n = shape_;
  const int64_t b = tokens.batch, s = tokens.seq, t = tokens.count(), d = n.head_dim;
  if (c.qk_layernorm) {
    p.q = norm_forward(c, p.q_stats, p.q_raw.view({t * n.q_heads, d}), w_.q_norm_weight,
                       w_.q_norm_bias)
              .view({b, s, n.q_heads, d});
    p.k = norm_forward(c, p.k_stats, p.k_raw.view({t * n.kv_heads, d}), w_.k_norm_weight,
                       w_.k_norm_bias)
              .view({b, s, n.kv_heads, d});
  }
  if (c.position_embedding == PositionEmbedding::rope) {
    rotate(p.q, tokens, position_offset, false);
    rotate(p.k, tokens, position_offset, false);
  }
}

void TransformerLayer::rotate(Tensor x, const Tokens& tokens, int64_t position_offset, bool inverse,
                              int64_t first_channel) const {
  const ops::RotaryFrequencies freqs = rotary(config_, first_channel);
  auto apply = [&](const Tensor& t, int64_t offset, const Tensor& positions = {}) {
    if (inverse) {
      ops::rope_backward(t, t, freqs, offset, positions);
    } else {
      ops::rope_forward(t, t, freqs, offset, positions);
    }
  };
  if (tokens.positions.defined()) return apply(x, position_offset, tokens.positions);
  if (!cp_.active()) return apply(x, position_offset);
  const int64_t batch = x.size(0) / 2, length = x.size(1);
  for (int j = 0; j < 2; ++j) apply(x.narrow(j * batch, batch), cp_.chunk(j) * length);
}

void TransformerLayer::attention_forward(Tensor out, Tensor lse, const Tensor& q, const Tensor& k,
                                         const Tensor& v, const Tokens& tokens,
                                         const ops::AttentionDropout& dropout) const {
  if (!cp_.active()) {
    ops::attention_forward(out, lse, q, k, v, window_, tokens.key_start, dropout);
  } else {
    context_attention_forward(cp_, out, lse, q, gather_sequence(cp_, k), gather_sequence(cp_, v),
                              window_, tokens.key_start, dropout);
  }
  if (sinks().defined()) ops::attention_sink_forward(out, lse, sinks());
}

void TransformerLayer::attention_backward(Tensor dq, Tensor& dk, Tensor& dv, const Tensor& dout,
                                          const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& out, const Tensor& lse,
                                          const Tokens& tokens,
                                          const ops::AttentionDropout& dropout) const {
  // out and lse are the sink softmax's: the backward below recomputes its probabilities.
  if (g_.sinks.defined()) ops::attention_sink_backward(g_.sinks, dout, out, lse, w_.sinks);
  if (!cp_.active()) {
    return ops::attention_backward(dq, dk, dv, dout, q, k, v, out, lse, window_, tokens.key_start,
                                   dropout);
  }
  // The keys and values are gathered again rather than kept: cp times their local size.
  const Tensor k_all = gather_sequence(cp_, k), v_all = gather_sequence(cp_, v);
  Tensor dk_all = Tensor::empty(k_all.shape(), DType::f32, k_all.device());
  Tensor dv_all = Tensor::empty(v_all.shape(), DType::f32, v_all.device());
  context_attention_backward(cp_, dq, dk_all, dv_all, dout, q, k_all, v_all, out, lse, window_,
                             tokens.key_start, dropout);
  // Summed over the group in f32, rounded to the activation dtype once.
  auto to_local = [&](const Tensor& all, const Tensor& like) {
    const Tensor summed = scatter_sequence(cp_, all);
    if (like.dtype() == DType::f32) return summed;
    Tensor local = empty_like(like);
    ops::cast(local, summed);
    return local;
  };
  dk = to_local(dk_all, k);
  dv = to_local(dv_all, v);
}

Tensor TransformerLayer::qkv_backward(Tensor dq, Tensor dk, const Tensor& dv, const Tensor& h,
                                      Tokens tokens, LayerActivations& a) const {
  const TransformerConfig& c = config_;
  const LayerShape& n = shape_;
  const int64_t t = tokens.count(), d = n.head_dim;
  if (c.position_embedding == PositionEmbedding::rope) {
    rotate(dq, tokens, 0, true);
    rotate(dk, tokens, 0, true);
  }
  if (c.qk_layernorm) {  // dq, dk of the normed heads -> of the projections
    Tensor dq_raw = empty_like(a.q_raw), dk_raw = empty_like(a.k_raw);
    norm_backward(c, dq_raw.view({t * n.q_heads, d}), g_.q_norm_weight, g_.q_norm_bias,
                  dq.view({t * n.q_heads, d}), a.q_raw.view({t * n.q_heads, d}), w_.q_norm_weight,
                  a.q_norm_stats);
    norm_backward(c, dk_raw.view({t * n.kv_heads, d}), g_.k_norm_weight, g_.k_norm_bias,
                  dk.view({t * n.kv_heads, d}), a.k_raw.view({t * n.kv_heads, d}), w_.k_norm_weight,
                  a.k_norm_stats);
    release(a.q_raw, a.k_raw, a.q_norm_stats.mean, a.q_norm_stats.rstd, a.k_norm_stats.mean,
            a.k_norm_stats.rstd);
    dq = dq_raw;
    dk = dk_raw;
  }
  const QKV wqkv = split_qkv(w_.qkv_weight, n.q_heads * d, n.kv_heads * d);
  const QKV gw = split_qkv(g_.qkv_weight, n.q_heads * d, n.kv_heads * d);
  const QKV gb = split_qkv(g_.qkv_bias, n.q_heads * d, n.kv_heads * d);
  Tensor dh = Tensor::empty(h.shape(), h.dtype(), h.device());
  linear_backward(dh, gw.q, gb.q, dq.view({t, n.q_heads * d}), h, wqkv.q);
  linear_backward(dh, gw.k, gb.k, dk.view({t, n.kv_heads * d}), h, wqkv.k, true);
  linear_backward(dh, gw.v, gb.v, dv.view({t, n.kv_heads * d}), h, wqkv.v, true);
  return dh;
}

Tensor TransformerLayer::forward(const Tensor& x, Tokens tokens, const DropoutContext& drop,
                                 Recompute policy, LayerActivations* saved) const {
  const TransformerConfig& c = config_;
  const LayerShape& n = shape_;
  BRAID_CHECK(x.dim() == 2 && x.size(1) == c.hidden_size, "TransformerLayer: input must be [T, ",
              c.hidden_size, "], got ", x.shape());
  const int64_t b = tokens.batch, s = tokens.seq, t = tokens.count(), d = n.head_dim;
  const DType dt = x.dtype();
  const Device dev = x.device();

  NormStats s1;
  Tensor h1 = norm_forward(c, s1, x, w_.input_norm_weight, w_.input_norm_bias);
  Projection qkv = project(attention_input(h1), tokens, 0);
  const Tensor &q = qkv.q, &k = qkv.k, &v = qkv.v;
  Tensor attn = Tensor::empty({b, s, n.q_heads, d}, dt, dev);
  Tensor lse = Tensor::empty({b, n.q_heads, s}, DType::f32, dev);
  attention_forward(attn, lse, q, k, v, tokens, drop.attention_probs);

  Tensor a = Tensor::empty({t, c.hidden_size}, dt, dev);
  linear_forward(a, o_input(attn), w_.o_weight, row_bias(w_.o_bias));
  a = exit_tp_forward(tp_, a);
  a = drop.apply(a, drop.attention_offset);
  Tensor mid = a;  // the residual add writes over the branch output
  ops::add(mid, x, a);

  NormStats s2;
  Tensor h2 = norm_forward(c, s2, mid, w_.post_norm_weight, w_.post_norm_bias);
  LayerActivations mlp;
  Tensor m = mlp_block_forward(h2, tokens.batch, saved != nullptr ? &mlp : nullptr);
  m = drop.apply(m, drop.mlp_offset);
  Tensor out = m;
  ops::add(out, mid, m);

  if (saved != nullptr) {
    *saved = LayerActivations{};
    saved->input = x;
    if (policy != Recompute::full) {
      // Selective with per-head q/k norms keeps the projections; the backward norms and
      // rotates them again. Selective with recompute_mla_up_proj keeps the latents and k_pe.
      const bool up = recomputes_up_projections(policy);
      if ((policy == Recompute::none || !per_head_qk_norms(c)) && !up) {
        saved->q = q;
        saved->k = k;
      }
      if (!up) saved->v = v;
      if (up) saved->k_pe = qkv.k_pe;
      saved->q_raw = qkv.q_raw;
      saved->k_raw = qkv.k_raw;
      saved->q_latent_in = qkv.q_latent_in;
      saved->q_latent = qkv.q_latent;
      saved->kv_latent_in = qkv.kv_latent_in;
      saved->kv_latent = qkv.kv_latent;
      saved->q_latent_stats = qkv.q_latent_stats;
      saved->kv_latent_stats = qkv.kv_latent_stats;
      saved->attn_out = attn;
      saved->lse = lse;
      saved->mid = mid;
      saved->fc1_out = mlp.fc1_out;
      saved->router_logits = mlp.router_logits;
      saved->routing = std::move(mlp.routing);
      saved->dispatch = std::move(mlp.dispatch);
      saved->expert_out = mlp.expert_out;
      saved->shared_fc1_out = mlp.shared_fc1_out;
      saved->shared_out = mlp.shared_out;
      saved->shared_gate_logit = mlp.shared_gate_logit;
    } else {
      saved->routing.aux_loss = mlp.routing.aux_loss;
      saved->routing.z_loss = mlp.routing.z_loss;
    }
    if (policy == Recompute::none) {
      saved->q_norm_stats = qkv.q_stats;
      saved->k_norm_stats = qkv.k_stats;
      saved->input_norm_stats = s1;
      saved->input_norm_out = h1;
      saved->post_norm_stats = s2;
      saved->post_norm_out = h2;
      saved->act_out = mlp.act_out;
      saved->expert_in = mlp.expert_in;
      saved->shared_act_out = mlp.shared_act_out;
    }
  }
  return out;
}

Tensor TransformerLayer::forward_cached(const Tensor& x, Tokens tokens, KVCache& cache,
                                        int cache_layer) const {
  const TransformerConfig& c = config_;
  const LayerShape& n = shape_;
  BRAID_CHECK(x.dim() == 2 && x.size(0) == tokens.count() && x.size(1) == c.hidden_size,
              "TransformerLayer::forward_cached: input must be [", tokens.count(), ", ",
              c.hidden_size, "], got ", x.shape());
  BRAID_CHECK(!tp_.sharded_tokens() && !cp_.active(),
              "TransformerLayer::forward_cached: no sequence or context parallelism");
  BRAID_CONFIG_CHECK(!ep_.active(),
                     "KV-cache decoding runs without expert parallelism (each rank would wait "
                     "for its EP peers' tokens): load the checkpoint with "
                     "--expert-model-parallel-size 1");
  const int64_t b = tokens.batch, s = tokens.seq, t = tokens.count(), d = n.head_dim;
  const int64_t offset = cache.length();
  const DType dt = x.dtype();
  const Device dev = x.device();

  NormStats s1;
  const Tensor h1 =
      enter_tp_forward(tp_, norm_forward(c, s1, x, w_.input_norm_weight, w_.input_norm_bias));
  Projection qkv = project(h1, tokens, offset);
  const Tensor q = qkv.q;
  cache.write(cache_layer, qkv.k, qkv.v);
  qkv = Projection{};
  Tensor attn = Tensor::empty({b, s, n.q_heads, d}, dt, dev);
  ops::attention_cached_forward(attn, q, cache.keys(cache_layer), cache.values(cache_layer),
                                offset + s, window_, sinks());

  Tensor mid = Tensor::empty({t, c.hidden_size}, dt, dev);
  linear_forward(mid, o_input(attn), w_.o_weight, row_bias(w_.o_bias));
  mid = exit_tp_forward(tp_, mid);
  ops::add(mid, x, mid);

  NormStats s2;
  const Tensor h2 =
      enter_tp_forward(tp_, norm_forward(c, s2, mid, w_.post_norm_weight, w_.post_norm_bias));
  Tensor out = exit_tp_forward(tp_, mlp_forward(h2, tokens.batch, nullptr, /*decoding=*/true));
  ops::add(out, mid, out);
  return out;
}

Tensor TransformerLayer::backward(const Tensor& dout, Tokens tokens, const DropoutContext& drop,
                                  Recompute policy, LayerActivations& saved, float loss_scale,
                                  MoeStats* moe_stats) const {
  const TransformerConfig& c = config_;
  BRAID_CHECK(saved.input.defined(), "TransformerLayer::backward: no saved activations");
  if (policy == Recompute::full) {
    const Tensor input = saved.input;  // forward() resets `saved` before refilling it
    forward(input, tokens, drop, Recompute::none, &saved);
  } else if (policy == Recompute::selective) {
    saved.input_norm_out = norm_forward(c, saved.input_norm_stats, saved.input,
                                        w_.input_norm_weight, w_.input_norm_bias);
    saved.post_norm_out =
        norm_forward(c, saved.post_norm_stats, saved.mid, w_.post_norm_weight, w_.post_norm_bias);
    saved.act_out = mlp_activation(saved.fc1_out);
    if (recomputes_up_projections(policy)) {  // every token's q, k, v from the kept latents
      Projection p;
      p.kv_latent = saved.kv_latent;
      p.k_pe = saved.k_pe;
      latent_up(p, c.q_lora_rank > 0 ? saved.q_latent : enter_tp_forward(tp_, saved.input_norm_out),
                tokens, 0);
      saved.q = p.q;
      saved.k = p.k;
      saved.v = p.v;
    }
    if (per_head_qk_norms(c)) {
      Projection p;
      p.q_raw = saved.q_raw;
      p.k_raw = saved.k_raw;
      finish_qk(p, tokens, 0);
      saved.q = p.q;
      saved.k = p.k;
      saved.q_norm_stats = p.q_stats;
      saved.k_norm_stats = p.k_stats;
    }
  }
  LayerActivations& a = saved;
  const int64_t t = tokens.count();
  if (moe_ && moe_stats != nullptr) {
    moe_stats->losses.load_balancing += a.routing.aux_loss;
    moe_stats->losses.z += a.routing.z_loss;
    std::vector<int64_t>& counts = moe_stats->tokens_per_expert;
    for (size_t e = 0; e < counts.size(); ++e)
      counts[e] += a.routing.offsets[e + 1] - a.routing.offsets[e];
  }

  // MLP block.
  Tensor dh2 = mlp_block_backward(drop.apply(dout, drop.mlp_offset), a, loss_scale);
  release(a.post_norm_out);
  Tensor dmid = empty_like(a.mid);
  norm_backward(c, dmid, g_.post_norm_weight, g_.post_norm_bias, dh2, a.mid, w_.post_norm_weight,
                a.post_norm_stats);
  ops::add(dmid, dmid, dout);
  release(dh2, a.mid, a.post_norm_stats.mean, a.post_norm_stats.rstd);

  // Attention block.
  Tensor da = exit_tp_backward(tp_, drop.apply(dmid, drop.attention_offset));
  Tensor d_o_in = Tensor::empty({t, w_.o_weight.size(1)}, da.dtype(), da.device());
  linear_backward(d_o_in, g_.o_weight, g_.o_bias, da, o_input(a.attn_out), w_.o_weight);
  release(da);
  Tensor d_attn = o_input_grad(d_o_in, tokens);
  release(d_o_in);
  Tensor dq = empty_like(a.q), dk = empty_like(a.k), dv = empty_like(a.v);
  attention_backward(dq, dk, dv, d_attn, a.q, a.k, a.v, a.attn_out, a.lse, tokens,
                     drop.attention_probs);
  release(d_attn, a.q, a.k, a.v);
  release(a.attn_out, a.lse);
  const Tensor h1 = attention_input(a.input_norm_out);
  Tensor dh1 = c.multi_latent_attention ? latent_backward(dq, dk, dv, h1, tokens, a)
                                        : qkv_backward(dq, dk, dv, h1, tokens, a);
  release(dq, dk, dv, a.input_norm_out);
  if (!c.multi_latent_attention) dh1 = enter_tp_backward(tp_, dh1);
  Tensor dx = empty_like(a.input);
  norm_backward(c, dx, g_.input_norm_weight, g_.input_norm_bias, dh1, a.input, w_.input_norm_weight,
                a.input_norm_stats);
  ops::add(dx, dx, dmid);
  saved = LayerActivations{};
  return dx;
}

}  // namespace braid::model
