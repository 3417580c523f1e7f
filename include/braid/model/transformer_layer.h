#pragma once
// One pre-norm transformer block with explicit forward and backward (Megatron's tensor
// parallelism: attention split by heads, MLP along its hidden dimension; tensor_parallel.h):
//   h1 = norm1(x); q, k, v = h1 Wq^T, h1 Wk^T, h1 Wv^T (qk_layernorm: q, k = norm per head)
//   (+ rope on q, k); or multi-latent attention's q, k, v (latent_attention.cpp)
//   attn = causal_attention(q, k, v) (in a sliding window on windowed layers; with attention
//   sinks, SoftmaxType, one more logit per head in each softmax row)
//   mid = x + dropout(attn Wo^T + bo)
//   h2 = norm2(mid); fc1 = h2 W1^T + b1; act = gelu(fc1) | glu(fc1) (swiglu, quick_geglu)
//   out = mid + dropout(act W2^T + b2)
// W1 is up_proj (gelu) or the fused [gate_proj; up_proj] weight (gated), so one GEMM gives
// [gate | up] per row. q, k and v are three GEMMs on row slices of the fused [q; k; v] weight
// because attention takes them as separate contiguous tensors and the op table has no
// split-columns op.

#include <cstdint>
#include <vector>

#include "braid/core/tensor.h"
#include "braid/kernels/ops.h"
#include "braid/model/config.h"
#include "braid/model/context_parallel.h"
#include "braid/model/expert_parallel.h"
#include "braid/model/kv_cache.h"
#include "braid/model/moe.h"
#include "braid/model/norm.h"
#include "braid/model/tensor_parallel.h"

namespace braid::model {

// One MLP's weights, or their gradients: fc1 is up_proj (gelu, squared relu) or the fused
// [gate_proj; up_proj] (gated), [F | 2F, H]; fc2 is down_proj [H, F]; biases [F | 2F], [H].
struct MlpTensors {
  Tensor fc1_weight, fc1_bias;
  Tensor fc2_weight, fc2_bias;
};

// The weights of one block, or their f32 gradients: views into the flat buffers.
// With tensor parallelism Hq, Hkv and F are this rank's shares (LayerShape).
struct LayerTensors {
  Tensor input_norm_weight, input_norm_bias;  // bias: layernorm only
  Tensor qkv_weight;                          // [(Hq + 2 Hkv) D, H] = [q_proj; k_proj; v_proj]
  Tensor qkv_bias;                            // [(Hq + 2 Hkv) D], or undefined
  Tensor q_norm_weight, q_norm_bias;          // [D] each (qk_layernorm), or undefined
  Tensor k_norm_weight, k_norm_bias;
  Tensor o_weight, o_bias;  // [H, Hq D], [H] (MLA: [H, Hq Dv], no bias)
  Tensor sinks;             // [Hq], with SoftmaxType::learnable
  // Multi-latent attention, in place of the qkv and q/k norm tensors (config.h; Lq, Lkv the
  // latent ranks, Dn + Dr = D the query/key head, Dv the value head): q_a_proj [Lq, H] and
  // q_a_layernorm [Lq] (replicated), q_b_proj [Hq D, Lq] in q_weight, or q_proj [Hq D, H] there
  // without a query latent; kv_a_proj_with_mqa [Lkv + Dr, H] and kv_a_layernorm [Lkv]
  // (replicated), kv_b_proj [Hq (Dn + Dv), Lkv]. The norms when qk_layernorm.
  Tensor q_a_weight, q_a_norm_weight, q_a_norm_bias, q_weight;
  Tensor kv_a_weight, kv_a_norm_weight, kv_a_norm_bias, kv_b_weight;
  Tensor post_norm_weight, post_norm_bias;
  MlpTensors mlp;  // the dense MLP
  // Mixture of experts, in place of mlp: the router [E, H] (replicated over TP), the MLP of each
  // expert this rank holds (all of them without expert parallelism), and (when the config has them)
  // the shared expert's and its gate [1, H] (replicated).
  Tensor router_weight;
  Tensor router_bias;  // [E], with add_bias_linear
  Tensor expert_bias;  // [E] f32, with moe_router_enable_expert_bias (not a parameter: no grad)
  std::vector<MlpTensors> experts;
  MlpTensors shared_expert;
  Tensor shared_expert_gate;
};

// This rank's share of a block: query heads, kv heads, head dim, MLP hidden size.
struct LayerShape {
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0, ffn = 0;
  static LayerShape of(const TransformerConfig& config, int tp_size);
};

// What a mixture-of-experts layer reports from its backwards (TransformerLayer::backward).
struct MoeStats {
  MoeLosses losses;
  std::vector<int64_t> tokens_per_expert;  // [E] when counted (expert bias), else empty
};

// The tokens of one microbatch: [batch, seq]; a region of the residual stream holds all
// batch·seq of them, or (sequence parallelism) this rank's 1/tp. With context parallelism
// they are this rank's chunks: [2B, S / (2 cp)] (context_parallel.h).
// With document masking (GPTModel::set_document_masking) on the model's device, else undefined:
//   key_start  i32 [B, S] of the whole sequences (under context parallelism B = batch / 2 and
//              S = 2·cp·seq): each position's document's first position, where its attention
//              starts (ops::attention_forward's key_start; --reset-attention-mask);
//   positions  i32 [batch, seq]: each of these tokens' position within its document (rope's
//              positions; --reset-position-ids).
struct Tokens {
  int64_t batch = 0, seq = 0;
  Tensor key_start, positions;
  int64_t count() const { return batch * seq; }
};

// What a block keeps for its backward, per microbatch (all [B, S, ...] in the activation
// dtype unless noted):
//   Recompute::none       every field.
//   Recompute::selective  input, q, k, v (after rope), attn_out, lse, mid and fc1_out (the
//                         pre-activation): the outputs of the GEMMs and of attention (with
//                         qk_layernorm q_raw and k_raw in place of q and k). The
//                         backward recomputes the norms (outputs and statistics; q and k
//                         from q_raw and k_raw, with their rotation) and the
//                         activation output from them: cheap elementwise and row-wise
//                         work that saves 2H + F values per token.
//   Recompute::full       input only; the backward reruns the block's forward first.
// The recomputed values are bit-identical to the first ones, so the gradients of all three
// policies are too (dropout masks are drawn again from the same Philox stream).
// With sequence parallelism input, input_norm_out, mid and post_norm_out (and the norm
// statistics) are this rank's token shard; backward gathers the norm outputs again.
struct LayerActivations {
  Tensor input;  // the residual stream entering the block (kept by every policy)
  NormStats input_norm_stats;
  Tensor input_norm_out;
  Tensor q, k, v;       // [B, S, Hq | Hkv, D], after rope
  Tensor q_raw, k_raw;  // qk_layernorm: the projections before their norms
  NormStats q_norm_stats, k_norm_stats;
  // Multi-latent attention (kept by none and selective): the down projections' outputs [T, Lq],
  // [T, Lkv] (every token under TP, this rank's under SP) with the norms' statistics, and the
  // latents the norms make of them (every token; without qk_layernorm and SP the same tensors). v
  // (and attn_out) are D wide, the value heads padded with zeros.
  Tensor q_latent_in, q_latent, kv_latent_in, kv_latent;
  NormStats q_latent_stats, kv_latent_stats;
  // With recompute_mla_up_proj under selective: every token's rotated RoPE key part [T, Dr], kept
  // in place of q, k and v, which the backward projects again.
  Tensor k_pe;
  Tensor attn_out;  // [B, S, Hq, D]
  Tensor lse;       // [B, Hq, S] f32
  Tensor mid;       // input + attention branch: the residual input of the MLP
  NormStats post_norm_stats;
  Tensor post_norm_out;
  Tensor fc1_out;  // [B, S, F | 2F]
  Tensor act_out;  // [B, S, F]
  // Mixture of experts: the routing (router_logits [T, E] f32, kept by none and selective, as are
  // the dispatch plan and expert_out) and the experts' rows (moe.h): expert_in [M, H] (none only:
  // selective gathers and dispatches it again), fc1_out [M, F | 2F] and act_out [M, F] in place of
  // the dense ones, in the local experts' order (expert_parallel.h; M = N without EP),
  // expert_out [N, H] in routed order.
  // The shared expert's fc1 output and activation [T, ...] (the activation: none only), its
  // output [T, H] and its gate's logit [T, 1] f32 (with a gate; none and selective).
  Tensor router_logits;
  MoeRouting routing;
  ExpertDispatch dispatch;
  Tensor expert_in, expert_out;
  Tensor shared_fc1_out, shared_act_out, shared_out, shared_gate_logit;
};

// Hidden and attention dropout of one block in one forward pass. The masks are never stored:
// backward draws them again from (seed, offset, token_runs) and from `attention_probs`.
struct DropoutContext {
  // Rows [local, local + count) of this rank's activation [T_region, H] are the run's tokens
  // from `first` on: each hidden mask is one Philox stream over the run's tokens, element
  // token · H + channel, so a rank draws the single-rank model's mask at its tokens. One run;
  // under context parallelism one per local chunk of each sequence (cut where a
  // sequence-parallel shard starts or ends). Empty: one run, the rows from token 0.
  struct TokenRun {
    int64_t local = 0, count = 0, first = 0;
  };
  // The runs of a rank's region: `rows` rows of `len` tokens - whole sequences, or under
  // context parallelism (cp_size > 1) CP rank cp_rank's two chunks of each of rows / 2
  // sequences, chunk-major (row j·rows/2 + i is chunk ContextParallel::chunk_of(cp_rank,
  // cp_size, j) of sequence i) - of which it holds `count` tokens from `shard` on (a
  // sequence-parallel shard; else all of them), when the first sequence's first token is the
  // run's token `first_token`.
  static std::vector<TokenRun> token_runs_of(int64_t rows, int64_t len, int cp_rank, int cp_size,
                                             int64_t shard, int64_t count, int64_t first_token);

  float p = 0.0f;  // hidden dropout; 0: off (evaluation, or hidden_dropout = 0)
  uint64_t seed = 0;
  uint64_t attention_offset = 0;  // Philox stream of the attention output's mask
  uint64_t mlp_offset = 0;        // Philox stream of the MLP output's mask
  std::vector<TokenRun> token_runs;
  // Dropout of the softmax probabilities (attention_dropout; p 0: off). first_head is this
  // rank's first query head; context parallelism sets the sequence and position per chunk.
  ops::AttentionDropout attention_probs;

  // x [T_region, ...] with stream `offset`'s mask applied (inverted dropout), into a new
  // tensor; x itself when p = 0. The gradient is the same operation on dout.
  Tensor apply(const Tensor& x, uint64_t offset) const;
};

class TransformerLayer {
 public:
  // Block `layer` (0-based, of the whole model: it decides the attention window) of `config`.
  // `weights` and `grads` hold the experts `ep` gives this rank.
  TransformerLayer(const TransformerConfig& config, int64_t layer, const TensorParallel& tp,
                   const ContextParallel& cp, const ExpertParallel& ep, LayerTensors weights,
                   LayerTensors grads);

  // x [T_region, H] -> out [T_region, H]. Keeps what `policy` says in `saved`; nothing if
  // nullptr. With context parallelism x holds this rank's chunks (tokens: [2B, L]).
  Tensor forward(const Tensor& x, Tokens tokens, const DropoutContext& dropout, Recompute policy,
                 LayerActivations* saved) const;

  // dout [T_region, H] -> dx [T_region, H]; adds the parameter gradients; frees `saved`.
  // `tokens`, `dropout` and `policy` must be those of the forward that filled `saved`.
  // With experts: `loss_scale` is the weight of this microbatch's loss in the step's
  // (GPTModel::backward's grad_scale), by which the router losses' gradients are scaled too; the
  // layer's router losses (without their coefficients; this rank's tokens' share under context
  // parallelism) and, when its tokens_per_expert has E entries, the tokens each expert took,
  // are added to *moe_stats when given.
  Tensor backward(const Tensor& dout, Tokens tokens, const DropoutContext& dropout,
                  Recompute policy, LayerActivations& saved, float loss_scale = 1.0f,
                  MoeStats* moe_stats = nullptr) const;

  // Inference: x [B * n, H] holds the next n positions of B sequences that follow the
  // cache.length() positions already in `cache`. Appends their keys (after rope) and values to
  // cache layer `cache_layer` and attends over the cache; returns out [B * n, H]. No dropout,
  // nothing kept; the caller advances the cache once every layer has run. Not with sequence or
  // context parallelism (x must hold every token).
  Tensor forward_cached(const Tensor& x, Tokens tokens, KVCache& cache, int cache_layer) const;

  const LayerTensors& weights() const { return w_; }
  const LayerTensors& grads() const { return g_; }

 private:
  // q [B, S, q_heads, D], k and v [B, S, kv_heads, D] of the normed input h [T, H] (the whole
  // sequence under TP), q and k normed per head (qk_layernorm: q_raw and k_raw before it) and
  // RoPE applied from position `position_offset` on.
  // With multi-latent attention the latents too (LayerActivations' fields), and v [B, S,
  // q_heads, D] with the value heads padded.
  struct Projection {
    Tensor q, k, v;
    Tensor q_raw, k_raw;
    NormStats q_stats, k_stats;
    Tensor q_latent_in, q_latent, kv_latent_in, kv_latent;
    NormStats q_latent_stats, kv_latent_stats;
    Tensor k_pe;  // multi-latent attention: every token's rotated RoPE key part [T, Dr]
  };
  Projection project(const Tensor& h, Tokens tokens, int64_t position_offset) const;
  // What the projections take of the normed input h1 (this rank's region): every token, gathered
  // under SP - but multi-latent attention takes the region itself and gathers its latents.
  Tensor attention_input(const Tensor& h1) const;
  Projection project_qkv(const Tensor& h, Tokens tokens, int64_t position_offset) const;
  Projection project_latent(const Tensor& h, Tokens tokens, int64_t position_offset) const;
  // Multi-latent attention's up projections and RoPE: p.q, p.k, p.v from q_in (the query
  // latent, or without one every token's h), p.kv_latent and the rotated p.k_pe.
  void latent_up(Projection& p, const Tensor& q_in, Tokens tokens, int64_t position_offset) const;
  // Whether this layer's `policy` keeps the latents but not q, k and v (recompute_mla_up_proj).
  bool recomputes_up_projections(Recompute policy) const;
  // The projections' backward: dq, dk, dv (of the rotated q and k) -> this rank's partial dh
  // [T, H] of their input h (every token under TP); adds the weight gradients. latent_backward's
  // h and dh are attention_input's (under SP this rank's tokens), its dh complete.
  Tensor qkv_backward(Tensor dq, Tensor dk, const Tensor& dv, const Tensor& h, Tokens tokens,
                      LayerActivations& a) const;
  Tensor latent_backward(Tensor dq, const Tensor& dk, const Tensor& dv, const Tensor& h,
                         Tokens tokens, LayerActivations& a) const;
  // Attention's output [B, S, Hq, D] as o_proj's input [T, Hq Dv] (the value heads without
  // their padding under MLA; a view otherwise), and the gradient back.
  Tensor o_input(const Tensor& attn) const;
  Tensor o_input_grad(const Tensor& d_o_in, Tokens tokens) const;
  // q and k of the projection: normed per head from q_raw and k_raw (qk_layernorm), rotated.
  void finish_qk(Projection& p, Tokens tokens, int64_t position_offset) const;
  // RoPE (inverse: its backward) in place on x [B, S, H, D] whose row 0 sits at
  // position_offset; with context parallelism on each of this rank's two chunks at its place;
  // with tokens.positions at each token's own. Under MLA the heads' channels from
  // first_channel on turn (their RoPE part, interleaved).
  void rotate(Tensor x, const Tokens& tokens, int64_t position_offset, bool inverse,
              int64_t first_channel = 0) const;
  // Causal attention (in window_, within tokens.key_start's documents) over this rank's tokens;
  // with context parallelism over the whole sequences' keys and values, gathered from the CP
  // group. `dropout`: the probabilities' (DropoutContext::attention_probs).
  void attention_forward(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tokens& tokens, const ops::AttentionDropout& dropout) const;
  void attention_backward(Tensor dq, Tensor& dk, Tensor& dv, const Tensor& dout, const Tensor& q,
                          const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                          const Tokens& tokens, const ops::AttentionDropout& dropout) const;
  // The attention sinks of this rank's heads [Hq] (the parameter, or off-by-one's zeros), or
  // undefined for the vanilla softmax.
  const Tensor& sinks() const { return w_.sinks.defined() ? w_.sinks : zero_sinks_; }
  Tensor mlp_activation(const Tensor& fc1_out) const;
  void mlp_activation_backward(Tensor d_fc1, const Tensor& d_act, const Tensor& fc1_out) const;
  // One MLP `w` on rows x [n, H]: writes fc1 (allocated by the caller) and y [n, H] (this rank's
  // partial sums under TP); returns the activation.
  Tensor mlp_rows(const MlpTensors& w, Tensor fc1, Tensor y, const Tensor& x) const;
  // Its backward: dy [n, H] -> dx [n, H] (overwritten, or added to with accumulate); adds the
  // weight gradients into g.
  void mlp_rows_backward(const MlpTensors& w, const MlpTensors& g, Tensor dx, const Tensor& dy,
                         const Tensor& x, const Tensor& fc1, const Tensor& act,
                         bool accumulate) const;
  // The mixture of experts' forward and backward (mlp_forward's and mlp_backward's). When the
  // layer routes its own tokens (routes_own_tokens) h_full and dm are this rank's shard, the
  // outputs whole for it, and the shared expert is left to the MLP block.
  Tensor moe_forward(const Tensor& h_full, int64_t rows, LayerActivations* saved,
                     bool decoding) const;
  Tensor moe_backward(const Tensor& dm, const Tensor& h_full, LayerActivations& a,
                      float loss_scale) const;
  // Whole experts under TP (ExpertParallel::whole_experts): each TP rank routes its own
  // sequence-parallel tokens through them.
  bool routes_own_tokens() const { return moe_ && ep_.whole_experts && tp_.active(); }
  // The MLP block between the post-attention norm's output h2 (this rank's region) and the
  // branch output, TP's entry and exit included, and its backward (dm of the branch output ->
  // dh2, both this rank's region). With routes_own_tokens the routed experts stay on the rank's
  // shard and only the shared expert enters TP.
  Tensor mlp_block_forward(const Tensor& h2, int64_t rows, LayerActivations* saved) const;
  Tensor mlp_block_backward(const Tensor& dm, LayerActivations& a, float loss_scale) const;
  // The local experts' input rows [M, H]: h_full's routed rows, dispatched.
  Tensor expert_input(const Tensor& h_full, const MoeRouting& r, const ExpertDispatch& d) const;
  // The shared expert (gated or not) added into m [T, H]; its backward added into dh.
  void shared_expert_forward(Tensor m, const Tensor& h_full, LayerActivations* saved) const;
  void shared_expert_backward(Tensor dh, const Tensor& dm, const Tensor& h_full,
                              LayerActivations& a) const;
  // A replicated linear layer's backward: dx added once over TP (by rank 0) when every rank
  // sees the same tokens x, by every rank for its own tokens with `own_tokens`. dbias may be
  // undefined.
  void replicated_linear_backward(Tensor dx, Tensor dweight, Tensor dbias, const Tensor& dy,
                                  const Tensor& x, const Tensor& weight,
                                  bool own_tokens = false) const;
  // The MLP (dense, or the experts) of the normed input h_full [T, H] (every token under TP, in
  // `rows` runs of tokens: Tokens::batch):
  // returns this rank's partial output [T, H]; keeps fc1_out, act_out (and with experts the
  // routing and expert rows, and the load-balancing loss) in `saved` when given.
  Tensor mlp_forward(const Tensor& h_full, int64_t rows, LayerActivations* saved,
                     bool decoding = false) const;
  // dm [T, H] (every token) -> this rank's partial dh [T, H]; adds the parameter gradients.
  Tensor mlp_backward(const Tensor& dm, const Tensor& h_full, LayerActivations& a,
                      float loss_scale) const;
  Tensor row_bias(const Tensor& bias) const;
  // An expert's row-parallel bias: row_bias's, or whole when the rank routes its own tokens.
  Tensor expert_row_bias(const Tensor& bias) const {
    return routes_own_tokens() ? bias : row_bias(bias);
  }
  TransformerConfig config_;
  TensorParallel tp_;
  ContextParallel cp_;
  ExpertParallel ep_;
  LayerShape shape_;
  int64_t window_;  // ops::attention_forward's: -1 or the keys before each query it sees
  bool moe_;        // experts (and a router) in place of the dense MLP
  LayerTensors w_;
  LayerTensors g_;
  Tensor zero_sinks_;  // SoftmaxType::off_by_one: [Hq] zeros of the weights' dtype
};

}  // namespace braid::model
