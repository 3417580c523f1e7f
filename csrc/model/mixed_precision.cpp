#include "braid/model/mixed_precision.h"

#include "braid/kernels/ops.h"

namespace braid::model {

Tensor as_f32(const Tensor& x) {
  if (!x.defined() || x.dtype() == DType::f32) return x;
  Tensor out = Tensor::empty(x.shape(), DType::f32, x.device());
  ops::cast(out, x);
  return out;
}

void store_as(Tensor dst, const Tensor& src) {
  if (dst.dtype() == src.dtype()) {
    if (dst.storage() != src.storage() || dst.offset_bytes() != src.offset_bytes())
      dst.copy_from(src);
    return;
  }
  ops::cast(dst, src);
}

}  // namespace braid::model
