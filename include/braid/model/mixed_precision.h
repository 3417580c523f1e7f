#pragma once
// How parameter gradients stay f32 when activations are bf16 (CUDA).
//
// Parameters and activations have the model's params_dtype; gradients are always f32.
// - Weight gradients of linear layers come from ops::matmul with accumulate=true, which
//   takes bf16 inputs and accumulates into the f32 gradient directly.
// - Every other parameter gradient (biases, norm weights and biases, embeddings) is
//   computed by its op entirely in f32: the op's activation inputs are cast to f32 first
//   (as_f32) and it adds straight into the f32 gradient buffer. Where an op also returns an
//   input gradient (norms), that is produced in f32 and cast back to the activation dtype.
// With f32 activations (the CPU) every as_f32 is the tensor itself: no copy, no cost.

#include "braid/core/tensor.h"

namespace braid::model {

// `x` itself when it is f32, otherwise an f32 copy (ops::cast) on the same device.
Tensor as_f32(const Tensor& x);

// Writes `src` (f32) into `dst` of any float dtype: a copy when the dtypes match, else a cast.
void store_as(Tensor dst, const Tensor& src);

}  // namespace braid::model
