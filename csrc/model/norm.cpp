#include "braid/model/norm.h"

#include "braid/kernels/ops.h"
#include "braid/model/mixed_precision.h"

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
  // Computed in f32 so that the parameter gradients are added straight into the f32 buffer.
  Tensor dx32 = dx.dtype() == DType::f32 ? dx : Tensor::empty(dx.shape(), DType::f32, dx.device());
  const Tensor x32 = as_f32(x), w32 = as_f32(weight), dout32 = as_f32(dout);
  if (kind == Normalization::layernorm) {
    ops::layernorm_backward(dx32, dweight, dbias, dout32, x32, w32, stats.mean, stats.rstd);
  } else {
    ops::rmsnorm_backward(dx32, dweight, dout32, x32, w32, stats.rstd);
  }
  store_as(dx, dx32);
}

}  // namespace braid::model
