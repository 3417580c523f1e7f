#include "braid/model/linear.h"

#include "braid/kernels/ops.h"

namespace braid::model {
namespace {
Tensor rows(const Tensor& t) { return t.view({-1, t.size(-1)}); }
}  // namespace

void linear_forward(Tensor y, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  ops::matmul(rows(y), rows(x), weight, bias, false, true);
}

void linear_backward(Tensor dx, Tensor dweight, Tensor dbias, const Tensor& dy, const Tensor& x,
                     const Tensor& weight, bool accumulate_dx) {
  const Tensor dy2 = rows(dy);
  if (dx.defined()) ops::matmul(rows(dx), dy2, weight, {}, false, false, 1.0f, accumulate_dx);
  ops::matmul(dweight, dy2, rows(x), {}, true, false, 1.0f, true);
  if (dbias.defined()) ops::bias_backward(dbias, dy2);
}

}  // namespace braid::model
