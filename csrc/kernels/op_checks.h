#pragma once
// Internal: the argument checks every op's front door (ops.cpp, attention_ops.cpp, moe_ops.cpp)
// runs before it dispatches on the tensors' device; each error names the op, the argument, its
// dtype and shape.

#include <initializer_list>
#include <string>

#include "braid/kernels/ops.h"
#include "kernels/cpu/cpu_ops.h"
#ifdef BRAID_WITH_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

#ifdef BRAID_WITH_CUDA
#define BRAID_DISPATCH(device, fn, ...) \
  ((device).is_cuda() ? cuda::fn(__VA_ARGS__) : cpu::fn(__VA_ARGS__))
#else
#define BRAID_DISPATCH(device, fn, ...) ((void)(device), cpu::fn(__VA_ARGS__))
#endif

namespace braid::ops::checks {

// "bf16 [4, 8]"
inline std::string describe(const Tensor& t) {
  return std::string(dtype_name(t.dtype())) + " " + t.shape().str();
}

// A named argument of an op; `optional` ones may be undefined and are then skipped.
struct Arg {
  const char* name;
  const Tensor& tensor;
  bool optional = false;
};

// Every (defined) argument is on one device, which this build can run; returns it.
inline Device device_of(const char* op, std::initializer_list<Arg> args) {
  const Arg* first = nullptr;
  for (const Arg& a : args) {
    if (!a.tensor.defined()) {
      BRAID_CHECK(a.optional, op, ": ", a.name, " is undefined");
      continue;
    }
    if (first == nullptr) {
      first = &a;
      continue;
    }
    BRAID_CHECK(a.tensor.device() == first->tensor.device(), op, ": ", a.name, " is on ",
                a.tensor.device().str(), " but ", first->name, " is on ",
                first->tensor.device().str(), " (all tensors of one call share a device)");
  }
  BRAID_CHECK(first != nullptr, op, ": no tensor arguments");
  Device device = first->tensor.device();
#ifndef BRAID_WITH_CUDA
  BRAID_CHECK(!device.is_cuda(), op, ": tensors are on ", device.str(),
              " but braid was built without CUDA");
#endif
  return device;
}

// Activations: f32 on every device, bf16 too on CUDA.
inline void check_activation(const char* op, Device device, const char* name, const Tensor& t) {
  if (device.is_cpu()) {
    BRAID_CHECK(t.dtype() == DType::f32, op, ": ", dtype_name(t.dtype()),
                " is not supported on cpu (", name, " is ", describe(t),
                "; the cpu reference computes in f32)");
  } else {
    BRAID_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, op, ": ",
                dtype_name(t.dtype()), " is not supported on cuda (", name, " is ", describe(t),
                "; activations are f32 or bf16)");
  }
}

inline void check_dtype(const char* op, const char* name, const Tensor& t, DType expected) {
  BRAID_CHECK(t.dtype() == expected, op, ": ", name, " must be ", dtype_name(expected), ", got ",
              describe(t));
}

inline void check_same_dtype(const char* op, const char* name, const Tensor& t,
                             const char* ref_name, const Tensor& ref) {
  BRAID_CHECK(t.dtype() == ref.dtype(), op, ": ", name, " is ", describe(t), " but ", ref_name,
              " is ", describe(ref), " (dtypes must match)");
}

inline void check_same_shape(const char* op, const char* name, const Tensor& t,
                             const char* ref_name, const Tensor& ref) {
  BRAID_CHECK(t.shape() == ref.shape(), op, ": ", name, " is ", describe(t), " but ", ref_name,
              " is ", describe(ref), " (shapes must match)");
}

// Same dtype and shape as a reference argument (outputs and gradients of elementwise ops).
inline void check_like(const char* op, const char* name, const Tensor& t, const char* ref_name,
                       const Tensor& ref) {
  check_same_dtype(op, name, t, ref_name, ref);
  check_same_shape(op, name, t, ref_name, ref);
}

inline void check_shape(const char* op, const char* name, const Tensor& t, const Shape& expected) {
  BRAID_CHECK(t.shape() == expected, op, ": ", name, " must be ", expected, ", got ", describe(t));
}

// Rows of a tensor seen as [rows, last dim]; a 0-d tensor is one row of one element.
inline int64_t last_dim(const Tensor& t) { return t.dim() == 0 ? 1 : t.size(-1); }
inline int64_t rows_of(const Tensor& t) {
  int64_t rows = 1;
  for (int d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return rows;
}

// Statistics per row ([rows] f32, any shape with that many elements).
inline void check_row_stat(const char* op, const char* name, const Tensor& stat, int64_t rows,
                           const Tensor& x) {
  check_dtype(op, name, stat, DType::f32);
  BRAID_CHECK(stat.numel() == rows, op, ": ", name, " has ", stat.numel(), " elements but x ",
              describe(x), " has ", rows, " rows");
}

// An optional i32 [B, S] per-token tensor (rope's positions, attention's key_start: S >= `seq`
// when `at_least`) on `device`.
inline void check_token_table(const char* op, const char* name, const Tensor& t, Device device,
                              int64_t batch, int64_t seq, bool at_least) {
  if (!t.defined()) return;
  check_dtype(op, name, t, DType::i32);
  BRAID_CHECK(t.device() == device, op, ": ", name, " is on ", t.device().str(), ", the op on ",
              device.str());
  BRAID_CHECK(
      t.dim() == 2 && t.size(0) == batch && (at_least ? t.size(1) >= seq : t.size(1) == seq), op,
      ": ", name, " ", describe(t), " must be [", batch, ", ", at_least ? ">= " : "", seq, "]");
}

}  // namespace braid::ops::checks
