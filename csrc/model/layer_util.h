#pragma once
// Small helpers shared by TransformerLayer's source files.

#include "braid/core/tensor.h"

namespace braid::model {

inline Tensor empty_like(const Tensor& t) {
  return Tensor::empty(t.shape(), t.dtype(), t.device());
}

// Drops these references now, so that memory is returned as early as possible.
template <typename... Tensors>
void release(Tensors&... tensors) {
  ((tensors = Tensor()), ...);
}

}  // namespace braid::model
