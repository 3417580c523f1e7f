#pragma once
// Internal: the op table on the CPU reference (plain loops, OpenMP, OpenBLAS). Same signatures and
// semantics as include/braid/kernels/ops.h; arguments were already checked by csrc/kernels/ops.cpp.

#include "braid/kernels/ops.h"

namespace braid::ops::cpu {
void matmul(Tensor out, const Tensor& a, const Tensor& b, const Tensor& bias, bool trans_a,
            bool trans_b, float alpha, bool accumulate, Stream stream);
void bias_backward(Tensor dbias, const Tensor& dout, Stream stream);
void add(Tensor out, const Tensor& a, const Tensor& b, Stream stream);
void scale(Tensor out, const Tensor& x, float alpha, float beta, Stream stream);
void cast(Tensor out, const Tensor& x, Stream stream);
void gelu_forward(Tensor out, const Tensor& x, Stream stream);
void gelu_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream);
void gelu_exact_forward(Tensor out, const Tensor& x, Stream stream);
void gelu_exact_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream);
void squared_relu_forward(Tensor out, const Tensor& x, Stream stream);
void squared_relu_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream);
void sigmoid_forward(Tensor out, const Tensor& x, Stream stream);
void sigmoid_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream);
void glu_forward(Tensor out, const Tensor& x, const GluSpec& glu, Stream stream);
void glu_backward(Tensor dx, const Tensor& dout, const Tensor& x, const GluSpec& glu,
                  Stream stream);
void dropout_forward(Tensor out, const Tensor& x, float p, uint64_t seed, uint64_t offset,
                     int64_t first_element, Stream stream);
void dropout_backward(Tensor dx, const Tensor& dout, float p, uint64_t seed, uint64_t offset,
                      int64_t first_element, Stream stream);
void cross_entropy_rescale(Tensor sumexp, const Tensor& max, const Tensor& global_max,
                           Stream stream);
void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, const Tensor& x, const Tensor& weight,
                       const Tensor& bias, float eps, Stream stream);
void layernorm_backward(Tensor dx, Tensor dweight, Tensor dbias, const Tensor& dout,
                        const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, Stream stream);
void rmsnorm_forward(Tensor out, Tensor rstd, const Tensor& x, const Tensor& weight, float eps,
                     Stream stream);
void rmsnorm_backward(Tensor dx, Tensor dweight, const Tensor& dout, const Tensor& x,
                      const Tensor& weight, const Tensor& rstd, Stream stream);
void rope_forward(Tensor out, const Tensor& x, std::span<const float> inv_freq,
                  int64_t first_channel, bool interleaved, int64_t position_offset,
                  const Tensor& positions, float attention_factor, Stream stream);
void rope_backward(Tensor dx, const Tensor& dout, std::span<const float> inv_freq,
                   int64_t first_channel, bool interleaved, int64_t position_offset,
                   const Tensor& positions, float attention_factor, Stream stream);
void copy_columns(Tensor dst, int64_t dst_column, const Tensor& src, int64_t src_column,
                  int64_t width, Stream stream);
void broadcast_heads(Tensor out, int64_t column, const Tensor& x, Stream stream);
void sum_heads(Tensor dx, const Tensor& dout, int64_t column, Stream stream);
void embedding_forward(Tensor out, const Tensor& ids, const Tensor& weight, int64_t vocab_offset,
                       Stream stream);
void embedding_backward(Tensor dweight, const Tensor& dout, const Tensor& ids, int64_t vocab_offset,
                        Stream stream);
void attention_forward(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       int64_t window, const Tensor& key_start, const AttentionDropout& dropout,
                       Stream stream);
void attention_backward(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        int64_t window, const Tensor& key_start, const AttentionDropout& dropout,
                        Stream stream);
void attention_cached_forward(Tensor out, const Tensor& q, const Tensor& k_cache,
                              const Tensor& v_cache, int64_t length, int64_t window,
                              const Tensor& sinks, Stream stream);
void attention_sink_forward(Tensor out, Tensor lse, const Tensor& sinks, Stream stream);
void attention_sink_backward(Tensor dsinks, const Tensor& dout, const Tensor& out,
                             const Tensor& lse, const Tensor& sinks, Stream stream);
void moe_router_forward(Tensor probs, Tensor experts, Tensor score_sums, Tensor lse,
                        const Tensor& logits, const Tensor& expert_bias, const MoeRouterSpec& spec,
                        Stream stream);
void moe_router_backward(Tensor dlogits, const Tensor& dprobs, const Tensor& logits,
                         const Tensor& experts, const MoeRouterSpec& spec, const Tensor& aux_grad,
                         float z_grad, Stream stream);
void gather_rows(Tensor out, const Tensor& x, const Tensor& index, const Tensor& scale,
                 Stream stream);
void combine_rows(Tensor out, const Tensor& y, const Tensor& rows, const Tensor& weight,
                  Stream stream);
void combine_rows_weight_grad(Tensor dweight, const Tensor& dout, const Tensor& y,
                              const Tensor& rows, Stream stream);
void cross_entropy_partials(Tensor max, Tensor sumexp, Tensor target_logit, const Tensor& logits,
                            const Tensor& targets, int64_t vocab_offset, Stream stream);
void cross_entropy_loss(Tensor loss, const Tensor& max, const Tensor& sumexp,
                        const Tensor& target_logit, const Tensor& targets, Stream stream);
void cross_entropy_backward(Tensor dlogits, const Tensor& logits, const Tensor& targets,
                            const Tensor& max, const Tensor& sumexp, const Tensor& dloss,
                            int64_t vocab_offset, Stream stream);
void adamw_step(std::span<const AdamWGroup> groups, const AdamWHyper& hyper, Stream stream);
void sum_of_squares(Tensor out, std::span<const Tensor> tensors, Stream stream);
void count_zeros(Tensor out, std::span<const Tensor> tensors, Stream stream);

}  // namespace braid::ops::cpu
