// DLPack in and out: braid tensors are handed to numpy and torch (and taken from them)
// without a copy. Contiguous tensors only, as braid's Tensor is always contiguous.

#include <dlpack/dlpack.h>

#include <cstdint>
#include <span>
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

// A producer's tensor as a DLPack capsule, not yet consumed: dropping `capsule` releases it
// (its own destructor calls the deleter), adopt() hands it to a braid Tensor instead.
struct Imported {
  py::object capsule;
  DLManagedTensor* managed = nullptr;
  Device device;
  DType dtype = DType::f32;
  std::vector<int64_t> dims;
  bool compact = true;  // row-major without gaps (size-1 dims may have any stride)

  const DLTensor& dl() const { return managed->dl_tensor; }
  const char* data() const { return static_cast<const char*>(dl().data) + dl().byte_offset; }
};

// braid's CUDA work runs on the legacy default stream; DLPack's stream argument 1 names it,
// so a CUDA producer (torch) orders the work that wrote the tensor before braid reads it.
// CPU producers take no stream (numpy rejects one).
constexpr int kLegacyDefaultStream = 1;

Imported import_dlpack(py::handle object) {
  BRAID_CONFIG_CHECK(py::hasattr(object, "__dlpack__"),
                     "expected a tensor or array supporting DLPack, got ",
                     std::string(py::str(py::type::of(object).attr("__name__"))));
  bool cuda_producer = false;
  if (py::hasattr(object, "__dlpack_device__")) {
    py::tuple where = object.attr("__dlpack_device__")();
    cuda_producer = where[0].cast<int>() == kDLCUDA;
  }
  Imported in;
  try {
    in.capsule = cuda_producer ? object.attr("__dlpack__")(py::arg("stream") = kLegacyDefaultStream)
                               : object.attr("__dlpack__")();
  } catch (py::error_already_set& e) {
    // numpy exports no read-only array (a np.memmap of a token file) over DLPack before 1.0,
    // which braid speaks: braid takes a writable copy instead, never a view of that memory.
    if (cuda_producer || !e.matches(PyExc_BufferError)) throw;
    in.capsule = py::module_::import("numpy").attr("array")(object).attr("__dlpack__")();
  }
  PyObject* raw = in.capsule.ptr();
  BRAID_CONFIG_CHECK(PyCapsule_IsValid(raw, "dltensor"),
                     "from_dlpack: the producer returned no unconsumed 'dltensor' capsule");
  in.managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(raw, "dltensor"));
  const DLTensor& dl = in.managed->dl_tensor;
  if (dl.device.device_type == kDLCPU) {
    in.device = Device::cpu();
  } else if (dl.device.device_type == kDLCUDA) {
    in.device = Device::cuda(dl.device.device_id);
  } else {
    BRAID_CONFIG_CHECK(false, "from_dlpack: device type ", int(dl.device.device_type),
                       " is not supported (cpu or cuda)");
  }
  BRAID_CONFIG_CHECK(dl.ndim >= 0 && dl.ndim <= kMaxDims, "from_dlpack: ", dl.ndim,
                     " dims; braid tensors have at most ", kMaxDims);
  in.dims.assign(dl.shape, dl.shape + dl.ndim);
  in.dtype = from_dl_dtype(dl.dtype);
  if (dl.strides != nullptr) {
    int64_t expected = 1;
    for (int i = dl.ndim - 1; i >= 0; --i) {
      if (in.dims[size_t(i)] != 1 && dl.strides[i] != expected) in.compact = false;
      expected *= in.dims[size_t(i)];
    }
  }
  return in;
}

// Takes the capsule over: the braid Tensor shares the producer's memory and releases it last.
Tensor adopt(Imported& in) {
  BRAID_CONFIG_CHECK(in.compact,
                     "from_dlpack: the tensor is not contiguous (call .contiguous() or "
                     "np.ascontiguousarray first)");
  const Shape shape{std::span<const int64_t>(in.dims)};  // may throw: before we own the capsule
  DLManagedTensor* managed = in.managed;
  void* data = const_cast<char*>(in.data());
  // From here the capsule is ours: rename it so its destructor leaves the tensor alone.
  PyCapsule_SetName(in.capsule.ptr(), "used_dltensor");
  return Tensor::from_blob(data, shape, in.dtype, in.device, [managed] {
    // The producer's deleter may touch Python objects (numpy, torch).
    if (managed->deleter == nullptr || !Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    managed->deleter(managed);
  });
}

// dst = one row of n elements `stride` apart, narrowed to int32; false if one does not fit. The
// check is a branch-free AND so that the unit-stride loop vectorises.
template <typename T>
bool narrow_row(const T* src, int64_t n, int64_t stride, int32_t* dst) {
  bool fits = true;
  const auto one = [&](int64_t j, T v) {
    if constexpr (sizeof(T) > sizeof(int32_t)) fits &= (v >= INT32_MIN) & (v <= INT32_MAX);
    dst[j] = int32_t(v);
  };
  if (stride == 1) {
    for (int64_t j = 0; j < n; ++j) one(j, src[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) one(j, src[j * stride]);
  }
  return fits;
}

// dst[i] = src element i in row-major order, read through `strides` (elements; the compact
// ones when empty), each checked to fit in int32. One pass: strided gather and narrowing.
template <typename T>
void narrow_to_int32(const T* src, std::span<const int64_t> dims, std::span<const int64_t> strides,
                     int32_t* dst, const char* what) {
  const size_t nd = dims.size();
  std::vector<int64_t> step(nd), index(nd, 0);
  int64_t n = 1;
  for (size_t d = nd; d-- > 0;) {
    step[d] = strides.empty() ? n : strides[d];
    n *= dims[d];
  }
  const int64_t row = nd ? dims[nd - 1] : 1, row_stride = nd ? step[nd - 1] : 1;
  if (n == 0) return;
  int64_t offset = 0;
  for (int64_t first = 0; first < n; first += row) {
    if (!narrow_row(src + offset, row, row_stride, dst + first)) {
      for (int64_t j = 0; j < row; ++j) {
        const T v = src[offset + j * row_stride];
        BRAID_CONFIG_CHECK(v >= INT32_MIN && v <= INT32_MAX, what, "[", first + j, "] = ", v,
                           " does not fit in int32");
      }
    }
    for (size_t d = nd ? nd - 1 : 0; d-- > 0;) {  // the next row's first element
      offset += step[d];
      if (++index[d] < dims[d]) break;
      offset -= step[d] * dims[d];
      index[d] = 0;
    }
  }
}

// A contiguous int32 copy of an int32 or int64 host tensor given by its first element.
Tensor narrowed_copy(const void* data, DType dtype, std::span<const int64_t> dims,
                     std::span<const int64_t> strides, const char* what) {
  Tensor out = Tensor::empty(Shape{dims}, DType::i32);
  if (dtype == DType::i64) {
    narrow_to_int32(static_cast<const int64_t*>(data), dims, strides, out.data_ptr<int32_t>(),
                    what);
  } else {
    narrow_to_int32(static_cast<const int32_t*>(data), dims, strides, out.data_ptr<int32_t>(),
                    what);
  }
  return out;
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
  Imported in = import_dlpack(object);
  return adopt(in);
}

Tensor as_tensor(py::handle object) {
  if (py::isinstance<Tensor>(object)) return object.cast<Tensor>();
  return from_dlpack(object);
}

// Token ids and targets: int32 on the way in. A contiguous int32 tensor is used in place (on
// its device); anything else on the host - int64 (numpy's and torch's default), or a strided
// view such as batch[:, 1:] - becomes one int32 copy in a single pass with a range check, so
// that callers can pass what their data loader gives them. A CUDA int64 tensor is narrowed on
// the host (the model copies it back to its device); CUDA int32 stays where it is.
Tensor token_tensor(py::handle object, const char* what) {
  const auto check_dtype = [what](DType dtype) {
    BRAID_CONFIG_CHECK(dtype == DType::i32 || dtype == DType::i64, what,
                       " must be int32 or int64, got ", dtype_name(dtype));
  };
  if (py::isinstance<Tensor>(object)) {
    Tensor t = object.cast<Tensor>();
    check_dtype(t.dtype());
    if (t.dtype() == DType::i32) return t;
    Tensor host = t.device().is_cpu() ? t : t.to(Device::cpu());
    const std::vector<int64_t> dims(t.shape().begin(), t.shape().end());
    return narrowed_copy(host.data(), DType::i64, dims, {}, what);
  }
  Imported in = import_dlpack(object);
  check_dtype(in.dtype);
  if (in.dtype == DType::i32 && in.compact) return adopt(in);
  if (in.device.is_cpu()) {
    const DLTensor& dl = in.dl();
    const std::span<const int64_t> strides =
        dl.strides ? std::span<const int64_t>(dl.strides, size_t(dl.ndim))
                   : std::span<const int64_t>();
    return narrowed_copy(in.data(), in.dtype, in.dims, strides, what);
  }
  Tensor device_view = adopt(in);  // CUDA: contiguous only (the copy to the host needs it)
  return narrowed_copy(device_view.to(Device::cpu()).data(), in.dtype, in.dims, {}, what);
}

}  // namespace braid::python
