#include "braid/model/norm.h"

#include "braid/kernels/ops.h"

namespace braid::model {
namespace {

// The scale the kernels apply: the weight, or 1 + weight (in the weight's dtype, as Megatron
// adds it) when the model keeps it zero-centered. Its gradient is the weight's.
Tensor gamma(const TransformerConfig& config, const Tensor& weight) {
  if (!config.zero_centered_gamma) return weight;
  Tensor g = Tensor::empty(weight.shape(), weight.dtype(), weight.device());
  ops::scale(g, weight, 1.0f, 1.0f);
  return g;
}

}  // namespace

Tensor norm_forward(const TransformerConfig& config, NormStats& stats, const Tensor& x,
                    const Tensor& weight, const Tensor& bias) {
  const int64_t rows = x.numel() / x.size(-1);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  stats.rstd = Tensor::empty({rows}, DType::f32, x.device());
  if (config.normalization == Normalization::layernorm) {
    stats.mean = Tensor::empty({rows}, DType::f32, x.device());
    ops::layernorm_forward(out, stats.mean, stats.rstd, x, gamma(config, weight), bias,
                           config.norm_eps);
  } else {
    stats.mean = Tensor();
    ops::rmsnorm_forward(out, stats.rstd, x, gamma(config, weight), config.norm_eps);
  }
  return out;
}

void norm_backward(const TransformerConfig& config, Tensor dx, Tensor dweight, Tensor dbias,
                   const Tensor& dout, const Tensor& x, const Tensor& weight,
                   const NormStats& stats) {
  if (config.normalization == Normalization::layernorm) {
    ops::layernorm_backward(dx, dweight, dbias, dout, x, gamma(config, weight), stats.mean,
                            stats.rstd);
  } else {
    ops::rmsnorm_backward(dx, dweight, dout, x, gamma(config, weight), stats.rstd);
  }
}

}  // namespace braid::model
