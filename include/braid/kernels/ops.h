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

#include <cstdint>
#include <span>

#include "braid/core/stream.h"
#include "braid/core/tensor.h"

namespace braid::ops {

// ---------------------------------------------------------------- GEMM
// out[M, N] = alpha * op(a) @ op(b) + bias[N]  (+ out, when accumulate)
// op(a) = a^T if trans_a (a is [K, M]) else a ([M, K]); likewise b ([K, N] or, if trans_b,
// [N, K]). Leading dims of a (not transposed) and out are flattened into M. `bias` may be
// undefined. On CUDA a, b may be bf16 with out bf16 or f32 (f32 accumulation throughout).
// A linear layer with HF weight layout W [out, in]: y = x W^T + b is
// matmul(y, x, W, b, false, true); dx = dy W is matmul(dx, dy, W, {}, false, false);
// dW += dy^T x is matmul(dW, dy, x, {}, true, false, 1.0f, true).
void matmul(Tensor out, const Tensor& a, const Tensor& b, const Tensor& bias, bool trans_a,
            bool trans_b, float alpha = 1.0f, bool accumulate = false, Stream stream = {});

// dbias[N] += sum over rows of dout[..., N]
void bias_backward(Tensor dbias, const Tensor& dout, Stream stream = {});

// ---------------------------------------------------------------- elementwise
// out = a + b (same shape and dtype; out may alias a or b).
void add(Tensor out, const Tensor& a, const Tensor& b, Stream stream = {});
// out = alpha * x (out may alias x).
void scale(Tensor out, const Tensor& x, float alpha, Stream stream = {});
// out = x converted to out's dtype (f32, bf16, f16 in any direction), round to nearest even.
void cast(Tensor out, const Tensor& x, Stream stream = {});

// GPT-2's gelu (tanh approximation, HF "gelu_new").
void gelu_forward(Tensor out, const Tensor& x, Stream stream = {});
void gelu_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream = {});

// x [..., 2F] holds [gate | up] in each row; out [..., F] = silu(gate) * up.
void swiglu_forward(Tensor out, const Tensor& x, Stream stream = {});
void swiglu_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream = {});

// Inverted dropout: out = x * keep / (1 - p), keep drawn from Philox(seed, stream = offset,
// index = element). The mask is never stored: backward draws it again from (seed, offset).
void dropout_forward(Tensor out, const Tensor& x, float p, uint64_t seed, uint64_t offset,
                     Stream stream = {});
void dropout_backward(Tensor dx, const Tensor& dout, float p, uint64_t seed, uint64_t offset,
                      Stream stream = {});

// ---------------------------------------------------------------- normalisation
// x [..., C]; weight, bias [C]; mean, rstd [rows] f32 (saved for backward).
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
// Rotary embedding as in HF Llama (rotate_half: element i pairs with i + D/2).
// x, out [B, S, H, D]; position of row s is position_offset + s; frequencies
// theta^(-2i/D). out may alias x. Backward rotates by the opposite angle.
void rope_forward(Tensor out, const Tensor& x, float theta, int64_t position_offset = 0,
                  Stream stream = {});
void rope_backward(Tensor dx, const Tensor& dout, float theta, int64_t position_offset = 0,
                   Stream stream = {});

// out[..., C] = weight[ids[...] - vocab_offset]; weight [V_local, C]; ids i32. Ids outside
// [vocab_offset, vocab_offset + V_local) give zero rows (vocab-parallel embedding: another
// rank owns them). Backward adds dout rows into dweight.
void embedding_forward(Tensor out, const Tensor& ids, const Tensor& weight,
                       int64_t vocab_offset = 0, Stream stream = {});
void embedding_backward(Tensor dweight, const Tensor& dout, const Tensor& ids,
                        int64_t vocab_offset = 0, Stream stream = {});

// ---------------------------------------------------------------- attention
// Causal scaled-dot-product attention with grouped-query heads.
// q [B, S, Hq, D], k, v [B, S, Hkv, D] with Hq % Hkv == 0 (query head h reads kv head
// h / (Hq / Hkv)); out [B, S, Hq, D]; lse [B, Hq, S] f32, the log-sum-exp of each softmax
// row (saved for backward, as flash attention does). scale = 1/sqrt(D).
void attention_forward(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       Stream stream = {});
void attention_backward(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        Stream stream = {});

// ---------------------------------------------------------------- cross-entropy
// logits [T, V_local] (this rank's vocabulary slice starts at vocab_offset); targets [T] i32,
// negative = ignored. One online-softmax pass gives, per row, the partials a
// vocab-parallel loss combines across ranks: row max, sum of exp(logit - max), and the
// target's logit (0 where the target is not in this slice). All outputs [T] f32.
void cross_entropy_partials(Tensor max, Tensor sumexp, Tensor target_logit, const Tensor& logits,
                            const Tensor& targets, int64_t vocab_offset = 0, Stream stream = {});
// loss[t] = log(sumexp[t]) + max[t] - target_logit[t], and 0 where targets[t] < 0.
void cross_entropy_loss(Tensor loss, const Tensor& max, const Tensor& sumexp,
                        const Tensor& target_logit, const Tensor& targets, Stream stream = {});
// dlogits[t, j] = dloss[t] * (exp(logits[t, j] - max[t]) / sumexp[t] - [j + vocab_offset ==
// targets[t]]), 0 for ignored rows. max and sumexp are the (globally combined) partials.
// dlogits may alias logits.
void cross_entropy_backward(Tensor dlogits, const Tensor& logits, const Tensor& targets,
                            const Tensor& max, const Tensor& sumexp, const Tensor& dloss,
                            int64_t vocab_offset = 0, Stream stream = {});

// ---------------------------------------------------------------- optimizer
// One tensor group of a multi-tensor AdamW step: f32 master weights, f32 gradient and
// moments of equal numel, the decoupled weight decay for this group, and optionally the
// model's copy of the weights (bf16/f16/f32), written from the updated master weights.
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
  int64_t step = 1;          // 1-based, for bias correction
  float grad_scale = 1.0f;   // gradients are multiplied by this first (clipping, loss scale)
};

// torch.optim.AdamW semantics: p -= lr * wd * p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).  One launch for all groups on CUDA.
void adamw_step(std::span<const AdamWGroup> groups, const AdamWHyper& hyper, Stream stream = {});

// out [1] f32 = sum of squares of every element of every tensor (f32/bf16/f16 inputs,
// f32 accumulation; double on the CPU). Take sqrt after any cross-rank reduction.
void sum_of_squares(Tensor out, std::span<const Tensor> tensors, Stream stream = {});

}  // namespace braid::ops
