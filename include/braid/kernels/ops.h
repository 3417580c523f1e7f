#pragma once
// The op table: every op braid's models and optimizer use, declared once.
//
// Each op checks its arguments (shapes, dtypes, devices; an error names the op and the
// shapes), then dispatches on the tensors' device to csrc/kernels/cpu/ (the reference:
// plain loops, OpenMP, OpenBLAS) or csrc/kernels/cuda/ (cuBLASLt, cuDNN, fused kernels).
// Same signature, same semantics, same tests on every device.
//
// Conventions
// - Outputs come first and are allocated by the caller; ops never allocate their outputs
//   (workspace they need internally comes from the device's allocator).
// - Every tensor of one call lives on one device. Work is queued on `stream` (CUDA) or
//   done before returning (CPU).
// - "Activation" tensors may be f32 on every device, and bf16 on CUDA. Statistics (mean,
//   rstd, log-sum-exp, softmax partials, losses) are always f32. Optimizer state is f32.
// - Parameter gradients (dweight, dbias, dW of a matmul with accumulate=true) are ADDED
//   into their buffers, so microbatches accumulate; input gradients (dx) are overwritten.
// - Leading dims are flattened where an op works on rows: x [..., C] is rows x C.
// - dtypes: on the CPU every float tensor is f32 (only cast, sum_of_squares and AdamW's
//   model_param also take bf16/f16); elsewhere an op says "<op>: bf16 is not supported on
//   cpu". On CUDA activations are f32 or bf16, and parameters read by an op (norm weights,
//   embedding table, matmul bias) have the activations' dtype. Ids and targets are i32.
// - Zero-sized tensors are valid: an op whose outputs are all empty does nothing; an
//   accumulating op with nothing to add leaves its buffers unchanged.
// - Bad arguments throw braid::Error naming the op, the argument and its dtype and shape.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "braid/core/stream.h"
#include "braid/core/tensor.h"

namespace braid::ops {

// ---------------------------------------------------------------- GEMM
// out[M, N] = alpha * op(a) @ op(b) + bias[N]  (+ out, when accumulate)
// op(a) = a^T if trans_a (a is [K, M]) else a ([M, K]); likewise b ([K, N] or, if trans_b,
// [N, K]). Every operand is seen as a matrix [numel / last dim, last dim], so leading dims
// flatten into rows (M of a and out; K of a transposed a, e.g. dy [B, S, N] in dW += dy^T x).
// `bias` [N] may be undefined. On CUDA a, b are both f32 or both bf16, out is their dtype or
// f32, bias has b's dtype (f32 accumulation throughout). K = 0 gives out = bias (or 0), plus
// out when accumulating.
// A linear layer with HF weight layout W [out, in]: y = x W^T + b is
// matmul(y, x, W, b, false, true); dx = dy W is matmul(dx, dy, W, {}, false, false);
// dW += dy^T x is matmul(dW, dy, x, {}, true, false, 1.0f, true).
void matmul(Tensor out, const Tensor& a, const Tensor& b, const Tensor& bias, bool trans_a,
            bool trans_b, float alpha = 1.0f, bool accumulate = false, Stream stream = {});

// dbias[N] (f32) += sum over rows of dout[..., N]
void bias_backward(Tensor dbias, const Tensor& dout, Stream stream = {});

// ---------------------------------------------------------------- elementwise
// out = a + b (same shape and dtype; out may alias a or b).
void add(Tensor out, const Tensor& a, const Tensor& b, Stream stream = {});
// out = alpha * x + beta (out may alias x).
void scale(Tensor out, const Tensor& x, float alpha, float beta = 0.0f, Stream stream = {});
// out = x converted to out's dtype (f32, bf16, f16 in any direction, same shape), round to
// nearest even. Works on every device, the CPU included.
void cast(Tensor out, const Tensor& x, Stream stream = {});

// GPT-2's gelu (tanh approximation, HF "gelu_new").
void gelu_forward(Tensor out, const Tensor& x, Stream stream = {});
void gelu_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream = {});

// The exact gelu, x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)) (torch's F.gelu, megatron-core's
// unfused GELU, HF "gelu"); dx = dout (Phi(x) + x phi(x)).
void gelu_exact_forward(Tensor out, const Tensor& x, Stream stream = {});
void gelu_exact_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream = {});

// out = relu(x)^2 (Megatron's --squared-relu, HF's "relu2"); dx = dout * 2 relu(x).
void squared_relu_forward(Tensor out, const Tensor& x, Stream stream = {});
void squared_relu_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream = {});

// out = 1 / (1 + exp(-x)) (the shared expert's gate); dx = dout * s (1 - s) of s = sigmoid(x).
void sigmoid_forward(Tensor out, const Tensor& x, Stream stream = {});
void sigmoid_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream = {});

// Gated linear units (Megatron's gated_linear_unit). x [..., 2F] holds [gate | up] in each row;
// out [..., F] = act(g) * (u + linear_offset), act(g) = silu(g) = g sigmoid(g) (SwiGLU: Llama,
// --swiglu) or, with quick_gelu, g sigmoid(1.702 g) (Megatron's --quick-geglu, GPT-OSS's).
// With clamp > 0 (Megatron's --activation-func-clamp-value, GPT-OSS's swiglu_limit)
// g = min(gate, clamp) and u = min(max(up, -clamp), clamp), else g = gate and u = up;
// linear_offset is Megatron's --glu-linear-offset (GPT-OSS: 1). The backward passes no gradient
// through a clamped element (torch's clamp: an element equal to a bound passes it).
struct GluSpec {
  bool quick_gelu = false;
  float clamp = 0.0f;  // 0: none
  float linear_offset = 0.0f;
};
void glu_forward(Tensor out, const Tensor& x, const GluSpec& glu = {}, Stream stream = {});
void glu_backward(Tensor dx, const Tensor& dout, const Tensor& x, const GluSpec& glu = {},
                  Stream stream = {});

// Inverted dropout: out = x * keep / (1 - p), p in [0, 1]. The mask is never stored: backward
// draws it again from (seed, offset). Exact rule, identical on every device: element i (flat
// index) reads word w = i % 4 of philox::random_words(seed, offset, i / 4) and is kept iff
// philox::uniform_from_word(w) > p; kept elements are multiplied by the f32 value
// 1.0f / (1.0f - p), dropped ones are 0 (p = 1 drops everything: out = 0).
// first_element numbers the elements from there: x is a part of a larger tensor that starts at
// that flat index, and gets exactly the larger tensor's mask there (sequence-parallel shards
// and context-parallel chunks draw the single-rank model's mask of the run's tokens).
void dropout_forward(Tensor out, const Tensor& x, float p, uint64_t seed, uint64_t offset,
                     int64_t first_element = 0, Stream stream = {});
void dropout_backward(Tensor dx, const Tensor& dout, float p, uint64_t seed, uint64_t offset,
                      int64_t first_element = 0, Stream stream = {});

// ---------------------------------------------------------------- normalisation
// x [..., C]; weight, bias [C] (x's dtype); mean, rstd [rows] f32 (saved for backward);
// dweight, dbias [C] f32, accumulated. layernorm uses the biased variance:
// out = (x - mean) * rstd * weight + bias, rstd = 1 / sqrt(mean((x - mean)^2) + eps).
// rmsnorm (HF Llama): out = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps).
void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, const Tensor& x, const Tensor& weight,
                       const Tensor& bias, float eps, Stream stream = {});
void layernorm_backward(Tensor dx, Tensor dweight, Tensor dbias, const Tensor& dout,
                        const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, Stream stream = {});

void rmsnorm_forward(Tensor out, Tensor rstd, const Tensor& x, const Tensor& weight, float eps,
                     Stream stream = {});
void rmsnorm_backward(Tensor dx, Tensor dweight, const Tensor& dout, const Tensor& x,
                      const Tensor& weight, const Tensor& rstd, Stream stream = {});

// ---------------------------------------------------------------- positions and embeddings
// RoPE's frequencies, in f32 as HF computes them: inv_freq[i] = 1 / theta^(2i/R), i < R/2, for
// the R channels of a head that turn (rotary_dim, or the head's channels from first_channel on).
// With llama3_factor > 0, Llama 3.1's scaling (HF rope_type "llama3", Megatron's
// --use-rope-scaling): with wavelength w = 2 pi / inv_freq[i] and L = original_max_positions,
// w > L / low_freq_factor divides the frequency by the factor, w < L / high_freq_factor keeps
// it, and between the two s = (L / w - low) / (high - low) blends them:
// (1 - s) inv_freq / factor + s inv_freq.
// With yarn_factor = s > 0, YaRN (Peng et al. 2023; HF rope_type "yarn", Megatron's --rope-type
// yarn), as HF's _compute_yarn_parameters computes it (f32, its correction range in double): with
// L = original_max_positions and d(r) = R ln(L / (2 pi r)) / (2 ln theta), the pairs i up to
// low = max(floor(d(beta_fast)), 0) keep their frequency, those from high =
// min(ceil(d(beta_slow)), R - 1) on divide it by s, and between the two
// ramp = (i - low) / (high - low) blends them: inv_freq / s * ramp + inv_freq * (1 - ramp).
// yarn_truncate false (HF's rope_parameters truncate: false, GPT-OSS's; megatron-core's
// correction_range_round_to_int False) keeps low = max(d(beta_fast), 0) and high =
// min(d(beta_slow), R - 1) unrounded (high + 0.001 when they are equal, HF's).
// With linear_factor = s > 0, linear position interpolation (Chen et al. 2023; HF rope_type
// "linear", Megatron's --rotary-seq-len-interpolation-factor): every inv_freq / s, as HF
// computes it (position p turns as p / s would).
// At most one of the three scalings.
struct RotaryFrequencies {
  float theta = 10000.0f;
  float llama3_factor = 0.0f;  // 0: no scaling
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  float original_max_positions = 8192.0f;
  // The channels of each head that turn, R (even), from first_channel on; the others pass
  // through (GPT-NeoX / StableLM's partial rotary, Megatron's --rotary-percent). 0: all of
  // them from first_channel on.
  int64_t rotary_dim = 0;
  // The first channel that turns: channels [first_channel, first_channel + R) of each head
  // turn (multi-latent attention's heads are [no-rope channels | rope channels]).
  int64_t first_channel = 0;
  // How the R channels pair. false: HF Llama's rotate_half (channel i with i + R/2). true:
  // GPT-J's interleaved pairs (channel 2i with 2i + 1), as DeepSeek-V2/V3 and megatron-core's
  // multi-latent attention compute them.
  bool interleaved = false;
  float linear_factor = 0.0f;  // 0: no interpolation
  float yarn_factor = 0.0f;    // 0: no YaRN
  float yarn_beta_fast = 32.0f;
  float yarn_beta_slow = 1.0f;
  bool yarn_truncate = true;
  // cos and sin are multiplied by it (YaRN's attention factor, HF's attention_scaling,
  // megatron-core's mscale): q . k scales by its square. 1 leaves RoPE a rotation.
  float attention_factor = 1.0f;

  void validate() const;  // Error naming the field
  // R for a head of `head_dim` channels: rotary_dim, or head_dim - first_channel.
  int64_t rotated_channels(int64_t head_dim) const;
  // The R / 2 frequencies of a head of `head_dim` channels.
  std::vector<float> inv_freq(int64_t head_dim) const;
};

// Rotary embedding on channels [F, F + R) of each head, F = RotaryFrequencies::first_channel,
// R = rotated_channels(D) (all D by default).
// x, out [B, S, H, D], R even; the position of row (b, s) is position_offset + s, or with
// `positions` (i32 [B, S] on x's device: each token's own, e.g. restarted at each document by
// Megatron's --reset-position-ids) position_offset + positions[b][s], >= 0; angle =
// float(position) * inv_freq[i] in f32 (RotaryFrequencies). Each pair (a, b) of channels turns:
// out[a] = x[a] cos - x[b] sin, out[b] = x[b] cos + x[a] sin (i < R/2; cos and sin in f32 times
// attention_factor), with
//   a = F + i, b = F + i + R/2 (HF Llama's rotate_half; interleaved false), or
//   a = F + 2i, b = F + 2i + 1 (interleaved true; HF's apply_rotary_pos_emb_interleave
//   de-interleaves q and k to [evens | odds] first, the same channel permutation on both, so
//   q . k is the same);
// out[j] = x[j] for the channels outside [F, F + R). out may alias x (and dx dout). Backward
// rotates by the opposite angle (times attention_factor: the transpose).
void rope_forward(Tensor out, const Tensor& x, const RotaryFrequencies& rotary,
                  int64_t position_offset = 0, const Tensor& positions = {}, Stream stream = {});
void rope_backward(Tensor dx, const Tensor& dout, const RotaryFrequencies& rotary,
                   int64_t position_offset = 0, const Tensor& positions = {}, Stream stream = {});

// out[..., C] = weight[ids[...] - vocab_offset]; weight [V_local, C]; ids i32. Ids outside
// [vocab_offset, vocab_offset + V_local) give zero rows (vocab-parallel embedding: another
// rank owns them). out has weight's dtype. Backward adds dout rows into dweight (f32).
void embedding_forward(Tensor out, const Tensor& ids, const Tensor& weight,
                       int64_t vocab_offset = 0, Stream stream = {});
void embedding_backward(Tensor dweight, const Tensor& dout, const Tensor& ids,
                        int64_t vocab_offset = 0, Stream stream = {});

// ---------------------------------------------------------------- column copies
// Blocks of columns moved between row-major tensors, for multi-latent attention (DeepSeek-V2/V3):
// its query and key heads are [no-rope channels | rope channels], and the key's rope channels
// are one [R, W] tensor shared by every head. Source and destination have one activation dtype
// and must not overlap; columns outside the written ones are left as they were.

// dst[:, dst_column + j] = src[:, src_column + j], j < width; dst [R, Cd], src [R, Cs].
void copy_columns(Tensor dst, int64_t dst_column, const Tensor& src, int64_t src_column,
                  int64_t width, Stream stream = {});
// out[r, h, column + j] = x[r, j] for every head h and j < W; out [R, H, D], x [R, W].
void broadcast_heads(Tensor out, int64_t column, const Tensor& x, Stream stream = {});
// broadcast_heads' backward: dx[r, j] = sum over h of dout[r, h, column + j], summed in f32 in
// head order and rounded once to dx's dtype (0 when H = 0); dout [R, H, D], dx [R, W].
void sum_heads(Tensor dx, const Tensor& dout, int64_t column, Stream stream = {});

// ---------------------------------------------------------------- attention
// Causal scaled-dot-product attention with grouped-query heads.
// q [B, Sq, Hq, D], k, v [B, Sk, Hkv, D] with Sq <= Sk and Hq % Hkv == 0 (query head h reads
// kv head h / (Hq / Hkv)); out [B, Sq, Hq, D]; lse [B, Hq, Sq] f32, the log-sum-exp of each
// softmax row (saved for backward, as flash attention does). scale = 1/sqrt(D). The queries
// are the last Sq positions of the Sk keys' (aligned to the end, as flash-attention aligns
// them): query row i sits at position p = Sk - Sq + i and attends to key positions 0 .. p
// (Sq = Sk: the usual causal mask; context parallelism's chunks of a longer sequence:
// Sq < Sk). `window` >= 0 is sliding-window attention: keys p - window .. p only (itself and
// the window keys before it: flash-attention's and Megatron's window_size (window, 0));
// -1: no window. `key_start` (document masking: Megatron's --reset-attention-mask), when
// defined, is i32 [B, L] with L >= Sk on q's device: the query at position p sees no key before
// key_start[b][p] (its document's first position); it must be non-decreasing along each row with
// key_start[b][p] <= p. Backward overwrites dq [B, Sq, Hq, D] and dk, dv [B, Sk, Hkv, D] (q's
// dtype); `out` and `lse` are the forward's, `window`, `key_start` and `dropout` the forward's.
//
// Attention dropout (Megatron's --attention-dropout; `dropout.p` > 0): each softmax probability
// is dropped with probability p and the kept ones are multiplied by the f32 value
// 1.0f / (1.0f - p) before they weigh their values; lse stays the undropped softmax's. The mask
// is never stored: backward draws it again. The probability of query head h of sequence b at
// query position qp for the key at position kp is kept iff
//   philox::uniform_from_word(word kp % 4 of philox::random_words(dropout.seed,
//       philox::substream(dropout.stream, dropout.first_sequence + b, dropout.first_head + h),
//       (uint64_t(qp) << 32) | uint64_t(kp / 4))) > p
// with kp = dropout.first_position + the key's row in k and qp = kp of query row i's own key
// (dropout.first_position + Sk - Sq + i). The mask is a function of the global sequence, head
// and positions alone, so a call over a shard of the heads (tensor parallelism: first_head) or
// over a chunk of queries with the keys they see (context parallelism: first_sequence,
// first_position) draws exactly the mask of the unsplit call there.
struct AttentionDropout {
  float p = 0.0f;  // 0: no dropout (evaluation, or --attention-dropout 0); p < 1
  uint64_t seed = 0, stream = 0;
  int64_t first_sequence = 0, first_head = 0, first_position = 0;
};
void attention_forward(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       int64_t window = -1, const Tensor& key_start = {},
                       const AttentionDropout& dropout = {}, Stream stream = {});
void attention_backward(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        int64_t window = -1, const Tensor& key_start = {},
                        const AttentionDropout& dropout = {}, Stream stream = {});

// Inference over a KV cache (no backward): q [B, Sq, Hq, D] holds the queries of positions
// length - Sq .. length - 1; k_cache, v_cache [B, C, Hkv, D] the keys and values of positions
// 0 .. C - 1, of which [0, length) are valid (1 <= Sq <= length <= C). Query row i, at position
// p = length - Sq + i, attends to key positions 0 .. p (causal, aligned to the end as
// flash-attention aligns Sq < Sk), or p - window .. p with a window >= 0; GQA and scale as
// attention_forward. out [B, Sq, Hq, D] (q's dtype).
// `sinks` as attention_sink_forward's, when defined.
void attention_cached_forward(Tensor out, const Tensor& q, const Tensor& k_cache,
                              const Tensor& v_cache, int64_t length, int64_t window = -1,
                              const Tensor& sinks = {}, Stream stream = {});

// Attention sinks (GPT-OSS's; Megatron's --softmax-type learnable, and off-by-one's sinks of 0):
// each head's softmax has one more logit, sinks[h], whose probability weighs no value.
// attention_sink_forward turns attention_forward's out and lse [B, Hq, Sq] into the sink
// softmax's, in place: lse' = log(exp(lse) + exp(sinks[h])), out *= exp(lse - lse'). sinks [Hq]
// has out's dtype (on the CPU f32). attention_backward given that out and lse then gives the
// sink softmax's dq, dk, dv (it recomputes the probabilities from lse'), and
// attention_sink_backward the sinks' own gradient: dsinks [Hq] f32 +=
// -sum over b, i of exp(sinks[h] - lse'[b, h, i]) * dot(dout[b, i, h], out[b, i, h]) (with out
// and lse the forward's results, accumulated in f32).
void attention_sink_forward(Tensor out, Tensor lse, const Tensor& sinks, Stream stream = {});
void attention_sink_backward(Tensor dsinks, const Tensor& dout, const Tensor& out,
                             const Tensor& lse, const Tensor& sinks, Stream stream = {});

// ---------------------------------------------------------------- mixture of experts
// How a router turns its logits into each token's k experts and their weights (Megatron's
// TopKRouter, DeepSeek-V3's gate).
//   softmax (sigmoid false):
//     softmax_first false (Megatron's default, Mixtral, Qwen3-MoE: HF's norm_topk_prob): the k
//       largest logits are chosen, probs = softmax over those k logits;
//     softmax_first true (--moe-router-pre-softmax, OLMoE, Qwen2-MoE): the k largest entries of
//       s = softmax(logits) over all E are chosen, probs = those entries.
//   sigmoid (--moe-router-score-function sigmoid): s = sigmoid(logits); the k largest of
//     s + expert_bias (when given) are chosen; probs = s at the chosen, divided by their sum
//     + 1e-20 when k > 1.
//   Group-limited (num_groups > 0): the E experts form num_groups groups of E / num_groups
//     consecutive ones; a group's score is the sum of its k / group_topk largest choice scores
//     (what the top k is taken of: the logits, s, or s + expert_bias); the choice is made among
//     the experts of the group_topk best groups (ties: the lower group) only.
//   probs are then multiplied by scaling_factor (--moe-router-topk-scaling-factor).
struct MoeRouterSpec {
  bool sigmoid = false;
  bool softmax_first = false;  // softmax only
  int64_t num_groups = 0;      // 0: no groups
  int64_t group_topk = 0;
  float scaling_factor = 1.0f;
};

// Top-k routing of T tokens over E experts (E <= 1024) by `spec`. logits [T, E] f32, the
// router's output; probs [T, k] f32 and experts [T, k] i32, each token's k experts in descending
// order of their choice score (ties: the lower expert first; a NaN logit ranks as -inf), k <= E.
// expert_bias [E] f32, optional, sigmoid only.
// score_sums [G, E] f32, optional: per group of T / G consecutive tokens (G divides T; G = 1:
// every token; the microbatch's sequences for the per-sequence loss), the sum over its tokens of
// the load-balancing scores: softmax(logits) over all E (softmax), or s / (sum over E of s +
// 1e-20) (sigmoid).
// lse [T] f32, optional: logsumexp of each row of logits (the z-loss's).
void moe_router_forward(Tensor probs, Tensor experts, Tensor score_sums, Tensor lse,
                        const Tensor& logits, const Tensor& expert_bias, const MoeRouterSpec& spec,
                        Stream stream = {});
// dlogits [T, E] f32 (overwritten) = the gradient through moe_router_forward of a loss with
// gradient dprobs [T, k] f32 (the selection is constant), plus, when aux_grad [G, E] f32 is
// defined, that of sum over t, e of aux_grad[group of t, e] * score(logits[t])[e] (the
// load-balancing loss's, with the scores of score_sums), plus z_grad * lse[t] * softmax(
// logits[t]) (the gradient of z_grad / 2 * lse[t]^2: the z-loss's, when z_grad != 0).
void moe_router_backward(Tensor dlogits, const Tensor& dprobs, const Tensor& logits,
                         const Tensor& experts, const MoeRouterSpec& spec, const Tensor& aux_grad,
                         float z_grad, Stream stream = {});
// Token dispatch: out [N, C] row i = x[index[i]] (times scale[i] when scale [N] f32 is defined);
// x [T, C] (activation dtype, out's), index [N] i32 in [0, T). An index outside its range (here
// and in combine_rows) is an error on the CPU; CUDA does not check and reads a zero row.
void gather_rows(Tensor out, const Tensor& x, const Tensor& index, const Tensor& scale,
                 Stream stream = {});
// Token combine: out [T, C] row t = sum over j < k of weight[t, j] * y[rows[t, j]] (weight 1
// when weight [T, k] f32 is undefined), summed in j order; y [N, C], rows [T, k] i32 in [0, N).
// Overwrites out.
void combine_rows(Tensor out, const Tensor& y, const Tensor& rows, const Tensor& weight,
                  Stream stream = {});
// The weight gradient of combine_rows: dweight [T, k] f32 (overwritten) = dot(dout[t],
// y[rows[t, j]]), accumulated in f32.
void combine_rows_weight_grad(Tensor dweight, const Tensor& dout, const Tensor& y,
                              const Tensor& rows, Stream stream = {});

// ---------------------------------------------------------------- cross-entropy
// logits [T, V_local] (activation dtype; this rank's slice starts at vocab_offset); targets [T]
// i32, negative = ignored. One online-softmax pass gives, per row, the partials a vocab-parallel
// loss combines across ranks: row max, sum of exp(logit - max), and the target's logit (0 where the
// target is not in this slice). All outputs [T] f32.
void cross_entropy_partials(Tensor max, Tensor sumexp, Tensor target_logit, const Tensor& logits,
                            const Tensor& targets, int64_t vocab_offset = 0, Stream stream = {});
// Vocab-parallel combination: after max has been reduced (max) across the ranks into
// global_max, sumexp[t] *= exp(max[t] - global_max[t]) re-bases this rank's sum on the global
// max, so that a sum across the ranks gives the global sum of exponentials. All [T] f32.
void cross_entropy_rescale(Tensor sumexp, const Tensor& max, const Tensor& global_max,
                           Stream stream = {});
// loss[t] = log(sumexp[t]) + max[t] - target_logit[t], and 0 where targets[t] < 0.
void cross_entropy_loss(Tensor loss, const Tensor& max, const Tensor& sumexp,
                        const Tensor& target_logit, const Tensor& targets, Stream stream = {});
// dlogits[t, j] = dloss[t] * (exp(logits[t, j] - max[t]) / sumexp[t] - [j + vocab_offset ==
// targets[t]]), 0 for ignored rows. max and sumexp are the (globally combined) partials;
// dloss [T] f32. dlogits (logits' dtype) may alias logits.
void cross_entropy_backward(Tensor dlogits, const Tensor& logits, const Tensor& targets,
                            const Tensor& max, const Tensor& sumexp, const Tensor& dloss,
                            int64_t vocab_offset = 0, Stream stream = {});

// ---------------------------------------------------------------- optimizer
// One tensor group of a multi-tensor AdamW step: f32 master weights, f32 gradient and
// moments of equal numel, the decoupled weight decay for this group, and optionally the
// model's copy of the weights (bf16/f16/f32, any device incl. the CPU), written from the
// updated master weights with round-to-nearest-even. Groups with no elements are skipped.
struct AdamWGroup {
  Tensor master;
  Tensor grad;
  Tensor exp_avg;
  Tensor exp_avg_sq;
  float weight_decay = 0.0f;
  Tensor model_param;  // may be undefined
};

struct AdamWHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  int64_t step = 1;         // 1-based, for bias correction
  float grad_scale = 1.0f;  // gradients are multiplied by this first (clipping, loss scale)
};

// torch.optim.AdamW semantics: p -= lr * wd * p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).  One launch for all groups on CUDA.
// Rounded as torch does it: g = grad * grad_scale; p *= f32(1 - lr wd); m += (1 - b1)(g - m);
// v = v b2 + (1 - b2) g g; p += (-f32(lr / bc1) * m) / (sqrt(v) / f32(sqrt(bc2)) + eps), with
// bc1 = 1 - b1^t, bc2 = 1 - b2^t and the f32(...) scalars computed in double.
void adamw_step(std::span<const AdamWGroup> groups, const AdamWHyper& hyper, Stream stream = {});

// out [1] f32 = sum of squares of every element of every tensor (f32/bf16/f16 inputs,
// f32 accumulation; double on the CPU). Take sqrt after any cross-rank reduction.
void sum_of_squares(Tensor out, std::span<const Tensor> tensors, Stream stream = {});
// out [1] i64 = how many elements of all the tensors are zero (f32/bf16/f16 inputs; -0 counts;
// Megatron's --log-num-zeros-in-grad).
void count_zeros(Tensor out, std::span<const Tensor> tensors, Stream stream = {});

// ---------------------------------------------------------------- the CPU's BLAS
struct CpuBlas {
  std::string library;  // the OpenBLAS file loaded
  std::string kernels;  // its kernels (openblas_get_corename): SkylakeX, Haswell, Prescott, ...
  std::string chosen_by;
};
// OpenBLAS as the CPU GEMM loaded it (loading it now if no GEMM has run yet), and how its
// kernels were chosen (csrc/kernels/cpu/openblas.h); braid::Error when it cannot be loaded.
CpuBlas cpu_blas();

}  // namespace braid::ops
