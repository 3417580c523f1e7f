// DLPack in and out: braid tensors are handed to numpy and torch (and taken from them)
// without a copy. Contiguous tensors only, as braid's Tensor is always contiguous.

#include <dlpack/dlpack.h>

#include <vector>

#include "bindings.h"

namespace braid::python {
namespace {

struct ExportContext {
  Tensor tensor;  // keeps the storage alive while the consumer holds the data
  std::vector<int64_t> shape;
  DLManagedTensor managed;
};

DLDataType to_dl_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return {kDLFloat, 32, 1};
    case DType::bf16:
      return {kDLBfloat, 16, 1};
    case DType::f16:
      return {kDLFloat, 16, 1};
    case DType::i32:
      return {kDLInt, 32, 1};
    case DType::i64:
      return {kDLInt, 64, 1};
    case DType::u8:
      return {kDLUInt, 8, 1};
  }
  BRAID_FAIL("to_dlpack: unknown dtype");
}

DType from_dl_dtype(DLDataType t) {
  BRAID_CONFIG_CHECK(t.lanes == 1, "from_dlpack: vector dtypes (lanes=", int(t.lanes),
                     ") are not supported");
  if (t.code == kDLFloat && t.bits == 32) return DType::f32;
  if (t.code == kDLFloat && t.bits == 16) return DType::f16;
  if (t.code == kDLBfloat && t.bits == 16) return DType::bf16;
  if (t.code == kDLInt && t.bits == 32) return DType::i32;
  if (t.code == kDLInt && t.bits == 64) return DType::i64;
  if (t.code == kDLUInt && t.bits == 8) return DType::u8;
  BRAID_CONFIG_CHECK(false, "from_dlpack: unsupported dtype (code ", int(t.code), ", bits ",
                     int(t.bits), "); braid takes f32, bf16, f16, i32, i64, u8");
  return DType::f32;
}

void capsule_destructor(PyObject* capsule) {
  // Only a capsule nobody consumed still carries the name "dltensor".
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

}  // namespace

py::capsule to_dlpack(const Tensor& tensor) {
  BRAID_CHECK(tensor.defined(), "to_dlpack: undefined tensor");
  auto* ctx = new ExportContext{tensor, {tensor.shape().begin(), tensor.shape().end()}, {}};
  DLTensor& dl = ctx->managed.dl_tensor;
  dl.data = tensor.nbytes() ? tensor.data() : nullptr;
  dl.device =
      tensor.device().is_cpu() ? DLDevice{kDLCPU, 0} : DLDevice{kDLCUDA, tensor.device().index};
  dl.ndim = tensor.dim();
  dl.dtype = to_dl_dtype(tensor.dtype());
  dl.shape = ctx->shape.data();
  dl.strides = nullptr;  // compact row-major
  dl.byte_offset = 0;
  ctx->managed.manager_ctx = ctx;
  ctx->managed.deleter = [](DLManagedTensor* self) {
    delete static_cast<ExportContext*>(self->manager_ctx);
  };
  PyObject* capsule = PyCapsule_New(&ctx->managed, "dltensor", capsule_destructor);
  if (capsule == nullptr) {
    delete ctx;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(capsule);
}

Tensor from_dlpack(py::handle object) {
  BRAID_CONFIG_CHECK(py::hasattr(object, "__dlpack__"),
                     "expected a tensor or array supporting DLPack, got ",
                     std::string(py::str(py::type::of(object).attr("__name__"))));
  py::object capsule = object.attr("__dlpack__")();
  PyObject* raw = capsule.ptr();
  BRAID_CONFIG_CHECK(PyCapsule_IsValid(raw, "dltensor"),
                     "from_dlpack: the producer returned no unconsumed 'dltensor' capsule");
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(raw, "dltensor"));
  const DLTensor& dl = managed->dl_tensor;
  Device device;
  if (dl.device.device_type == kDLCPU) {
    device = Device::cpu();
  } else if (dl.device.device_type == kDLCUDA) {
    device = Device::cuda(dl.device.device_id);
  } else {
    BRAID_CONFIG_CHECK(false, "from_dlpack: device type ", int(dl.device.device_type),
                       " is not supported (cpu or cuda)");
  }
  BRAID_CONFIG_CHECK(dl.ndim >= 0 && dl.ndim <= kMaxDims, "from_dlpack: ", dl.ndim,
                     " dims; braid tensors have at most ", kMaxDims);
  std::vector<int64_t> dims(dl.shape, dl.shape + dl.ndim);
  if (dl.strides != nullptr) {  // must be compact row-major (size-1 dims may have any stride)
    int64_t expected = 1;
    for (int i = dl.ndim - 1; i >= 0; --i) {
      BRAID_CONFIG_CHECK(dims[size_t(i)] == 1 || dl.strides[i] == expected,
                         "from_dlpack: the tensor is not contiguous (call .contiguous() or "
                         "np.ascontiguousarray first)");
      expected *= dims[size_t(i)];
    }
  }
  DType dtype = from_dl_dtype(dl.dtype);
  void* data = static_cast<char*>(dl.data) + dl.byte_offset;
  const Shape shape{std::span<const int64_t>(dims)};  // may throw: before we own the capsule
  // From here the capsule is ours: rename it so its destructor leaves the tensor alone.
  PyCapsule_SetName(raw, "used_dltensor");
  return Tensor::from_blob(data, shape, dtype, device, [managed] {
    // The producer's deleter may touch Python objects (numpy, torch).
    if (managed->deleter == nullptr || !Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    managed->deleter(managed);
  });
}

Tensor as_tensor(py::handle object) {
  if (py::isinstance<Tensor>(object)) return object.cast<Tensor>();
  return from_dlpack(object);
}

// Token ids and targets: int32 on the way in; int64 arrays (numpy's default) are narrowed
// here, with a range check, so that callers can pass what their data loader gives them.
Tensor token_tensor(py::handle object, const char* what) {
  Tensor t = as_tensor(object);
  if (t.dtype() == DType::i32) return t;
  BRAID_CONFIG_CHECK(t.dtype() == DType::i64, what, " must be int32 or int64, got ",
                     dtype_name(t.dtype()));
  Tensor host = t.device().is_cpu() ? t : t.to(Device::cpu());
  Tensor out = Tensor::empty(t.shape(), DType::i32);
  const int64_t* src = host.data_ptr<int64_t>();
  int32_t* dst = out.data_ptr<int32_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    BRAID_CONFIG_CHECK(src[i] >= INT32_MIN && src[i] <= INT32_MAX, what, "[", i, "] = ", src[i],
                       " does not fit in int32");
    dst[i] = int32_t(src[i]);
  }
  return out;
}

}  // namespace braid::python
