#pragma once
// Internal: causal GQA attention through cuDNN's SDPA (flash attention), bf16/f16 only.
// Each returns false, having queued nothing, when cuDNN cannot run the configuration (f32,
// a head dim it does not take, misaligned pointers, a graph it reports unsupported); the
// caller then runs braid's own kernels. lse has the layout and meaning of braid's: the
// natural-log log-sum-exp of each row of scaled scores, [B, Hq, S] f32. window: as
// ops::attention_forward's (-1: none; W >= 0: each query sees itself and the W keys before it).

#include <cuda_runtime.h>

#include "braid/core/tensor.h"

namespace braid::ops::cuda::detail {

bool cudnn_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, int64_t window, cudaStream_t stream);

bool cudnn_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, int64_t window,
                              cudaStream_t stream);

}  // namespace braid::ops::cuda::detail
