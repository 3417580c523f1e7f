#pragma once
// A linear layer with HF weight layout: y = x W^T + b, W [out, in]. The building block of
// the column- and row-parallel layers; here without communication.

#include "braid/core/tensor.h"

namespace braid::model {

// y [..., out] = x [..., in] W^T + bias (bias may be undefined).
void linear_forward(Tensor y, const Tensor& x, const Tensor& weight, const Tensor& bias);

// dx [..., in] = dy W, overwritten (or added when accumulate_dx; skipped when dx is
// undefined). dweight [out, in] += dy^T x and dbias [out] += column sums of dy, both f32
// whatever the activation dtype; dbias may be undefined.
void linear_backward(Tensor dx, Tensor dweight, Tensor dbias, const Tensor& dy, const Tensor& x,
                     const Tensor& weight, bool accumulate_dx = false);

}  // namespace braid::model
