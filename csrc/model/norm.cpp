#include "braid/model/norm.h"

#include "braid/kernels/ops.h"

namespace braid::model {

Tensor norm_forward(Normalization kind, float eps, NormStats& stats, const Tensor& x,
                    const Tensor& weight, const Tensor& bias) {
  const int64_t rows = x.numel() / x.size(-1);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  stats.rstd = Tensor::empty({rows}, DType::f32, x.device());
  if (kind == Normalization::layernorm) {
    stats.mean = Tensor::empty({rows}, DType::f32, x.device());
    ops::layernorm_forward(out, stats.mean, stats.rstd, x, weight, bias, eps);
  } else {
    stats.mean = Tensor();
    ops::rmsnorm_forward(out, stats.rstd, x, weight, eps);
  }
  return out;
}

void norm_backward(Normalization kind, Tensor dx, Tensor dweight, Tensor dbias, const Tensor& dout,
                   const Tensor& x, const Tensor& weight, const NormStats& stats) {
  if (kind == Normalization::layernorm) {
    ops::layernorm_backward(dx, dweight, dbias, dout, x, weight, stats.mean, stats.rstd);
  } else {
    ops::rmsnorm_backward(dx, dweight, dout, x, weight, stats.rstd);
  }
}

}  // namespace braid::model
