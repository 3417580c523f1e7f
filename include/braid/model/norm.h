#pragma once
// The normalisation of a transformer block: LayerNorm (weight and bias) or RMSNorm (weight).

#include "braid/core/tensor.h"
#include "braid/model/config.h"

namespace braid::model {

// What the backward needs besides the input: per-row statistics, [rows] f32.
struct NormStats {
  Tensor mean;  // layernorm only
  Tensor rstd;
};

// The model's norm (config.normalization, norm_eps, zero_centered_gamma: scaling by 1 + weight).
// out = norm(x) in x's dtype; fills `stats`. `bias` is ignored (may be undefined) for rmsnorm.
Tensor norm_forward(const TransformerConfig& config, NormStats& stats, const Tensor& x,
                    const Tensor& weight, const Tensor& bias);

// dx (x's dtype) is overwritten; dweight and dbias (f32; dbias layernorm only) are added to.
void norm_backward(const TransformerConfig& config, Tensor dx, Tensor dweight, Tensor dbias,
                   const Tensor& dout, const Tensor& x, const Tensor& weight,
                   const NormStats& stats);

}  // namespace braid::model
