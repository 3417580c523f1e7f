#pragma once
// Internal to the extension: the pieces of braid._C, one function per layer's bindings,
// and the DLPack conversions they share. The bindings hold no logic of their own.

#include <pybind11/pybind11.h>

#include "braid/core/tensor.h"

namespace braid::python {

namespace py = pybind11;

void bind_core(py::module_& m);
void bind_model(py::module_& m);
void bind_parallel(py::module_& m);
void bind_engine(py::module_& m);
void bind_checkpoint(py::module_& m);
void bind_data(py::module_& m);
void bind_gpt_data(py::module_& m);
void bind_schedule(py::module_& m);

// A braid Tensor as a DLPack capsule ("dltensor"); the capsule keeps the storage alive.
py::capsule to_dlpack(const Tensor& tensor);
// Any object with __dlpack__ (numpy arrays, torch tensors, braid Tensors), zero-copy.
Tensor from_dlpack(py::handle object);
// A braid Tensor from an argument that is a braid Tensor or any DLPack producer.
Tensor as_tensor(py::handle object);
// Token ids or targets as int32: a contiguous int32 input is used in place, on its device; int64
// (numpy's and torch's default) or a strided view on the host becomes one range-checked int32
// copy. CUDA producers are asked for the tensor on braid's stream (the legacy default one).
Tensor token_tensor(py::handle object, const char* what);

}  // namespace braid::python
