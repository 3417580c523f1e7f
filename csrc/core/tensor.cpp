#include "braid/core/tensor.h"

#include <cstring>
#include <sstream>

#include "device_runtime.h"

namespace braid {

// ---- Shape ----

Shape::Shape(std::initializer_list<int64_t> dims)
    : Shape(std::span<const int64_t>(dims.begin(), dims.size())) {}

Shape::Shape(std::span<const int64_t> dims) {
  BRAID_CHECK(dims.size() <= size_t(kMaxDims), "a tensor has at most ", kMaxDims, " dims, got ",
              dims.size());
  ndim_ = int(dims.size());
  for (int i = 0; i < ndim_; ++i) {
    BRAID_CHECK(dims[i] >= -1, "negative dimension ", dims[i], " in shape");
    dims_[i] = dims[i];
  }
}

int64_t Shape::operator[](int i) const {
  int j = i < 0 ? i + ndim_ : i;
  BRAID_CHECK(j >= 0 && j < ndim_, "dim ", i, " out of range for shape ", str());
  return dims_[j];
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= dims_[i];
  return n;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < ndim_; ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
  return s + "]";
}

bool Shape::operator==(const Shape& other) const {
  if (ndim_ != other.ndim_) return false;
  for (int i = 0; i < ndim_; ++i)
    if (dims_[i] != other.dims_[i]) return false;
  return true;
}

std::ostream& operator<<(std::ostream& out, const Shape& shape) { return out << shape.str(); }

// ---- Storage ----

Storage::Storage(Device device, size_t nbytes)
    : device_(device), data_(allocator_for(device).allocate(nbytes)), nbytes_(nbytes) {}

Storage::Storage(Device device, void* data, size_t nbytes, std::function<void()> release)
    : device_(device), data_(data), nbytes_(nbytes), release_(std::move(release)) {
  if (!release_) release_ = [] {};  // foreign memory without a deleter: nothing to free
}

Storage::~Storage() {
  if (release_) {
    release_();
  } else {
    allocator_for(device_).deallocate(data_, nbytes_);
  }
}

// ---- Tensor ----

Tensor::Tensor(std::shared_ptr<Storage> storage, size_t offset, const Shape& shape, DType dtype)
    : storage_(std::move(storage)),
      offset_(offset),
      shape_(shape),
      dtype_(dtype),
      device_(storage_->device()) {}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape) BRAID_CHECK(d >= 0, "Tensor::empty: bad shape ", shape);
  size_t nbytes = size_t(shape.numel()) * dtype_size(dtype);
  return Tensor(std::make_shared<Storage>(device, nbytes), 0, shape, dtype);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::from_blob(void* data, const Shape& shape, DType dtype, Device device,
                         std::function<void()> release) {
  size_t nbytes = size_t(shape.numel()) * dtype_size(dtype);
  return Tensor(std::make_shared<Storage>(device, data, nbytes, std::move(release)), 0, shape,
                dtype);
}

void* Tensor::data() const {
  BRAID_CHECK(defined(), "data() of an undefined tensor");
  if (storage_->data() == nullptr) return nullptr;  // zero-sized
  return static_cast<char*>(storage_->data()) + offset_;
}

Tensor Tensor::view(const Shape& shape) const {
  BRAID_CHECK(defined(), "view of an undefined tensor");
  std::array<int64_t, kMaxDims> dims{};
  int infer = -1;
  int64_t known = 1;
  for (int i = 0; i < shape.dim(); ++i) {
    dims[i] = shape[i];
    if (dims[i] == -1) {
      BRAID_CHECK(infer < 0, "view: more than one -1 in ", shape);
      infer = i;
    } else {
      known *= dims[i];
    }
  }
  if (infer >= 0) {
    BRAID_CHECK(known > 0 && numel() % known == 0, "view: cannot infer ", shape, " from ", shape_);
    dims[infer] = numel() / known;
  }
  Shape resolved(std::span<const int64_t>(dims.data(), size_t(shape.dim())));
  BRAID_CHECK(resolved.numel() == numel(), "view: ", shape, " does not match ", shape_, " (",
              numel(), " elements)");
  return Tensor(storage_, offset_, resolved, dtype_);
}

Tensor Tensor::slice(int64_t offset, const Shape& shape) const {
  BRAID_CHECK(defined(), "slice of an undefined tensor");
  BRAID_CHECK(offset >= 0 && offset + shape.numel() <= numel(), "slice: elements [", offset, ", ",
              offset + shape.numel(), ") out of range for ", shape_);
  return Tensor(storage_, offset_ + size_t(offset) * dtype_size(dtype_), shape, dtype_);
}

Tensor Tensor::narrow(int64_t start, int64_t length) const {
  BRAID_CHECK(dim() >= 1, "narrow of a 0-d tensor");
  BRAID_CHECK(start >= 0 && length >= 0 && start + length <= shape_[0], "narrow: rows [", start,
              ", ", start + length, ") out of range for ", shape_);
  std::array<int64_t, kMaxDims> dims{};
  for (int i = 0; i < dim(); ++i) dims[i] = shape_[i];
  dims[0] = length;
  int64_t row = numel() / std::max<int64_t>(shape_[0], 1);
  return slice(start * row, Shape(std::span<const int64_t>(dims.data(), size_t(dim()))));
}

Tensor Tensor::reinterpret(DType dtype) const {
  BRAID_CHECK(dtype_size(dtype) == dtype_size(dtype_), "reinterpret: ", dtype_name(dtype_), " as ",
              dtype_name(dtype), " changes the element size");
  return Tensor(storage_, offset_, shape_, dtype);
}

void Tensor::copy_from(const Tensor& src) {
  BRAID_CHECK(defined() && src.defined(), "copy_from: undefined tensor");
  BRAID_CHECK(src.dtype() == dtype_ && src.numel() == numel(),
              "copy_from: ", dtype_name(src.dtype()), src.shape(), " into ", dtype_name(dtype_),
              shape_);
  if (nbytes() == 0) return;
  if (device_.is_cpu() && src.device().is_cpu()) {
    std::memmove(data(), src.data(), nbytes());
    return;
  }
#ifdef BRAID_WITH_CUDA
  detail::cuda_copy(data(), device_, src.data(), src.device(), nbytes());
#else
  BRAID_FAIL("copy between ", src.device().str(), " and ", device_.str(), " without CUDA");
#endif
}

Tensor Tensor::to(Device device) const {
  Tensor out = empty(shape_, dtype_, device);
  out.copy_from(*this);
  return out;
}

Tensor Tensor::clone() const { return to(device_); }

void Tensor::zero_() {
  if (nbytes() == 0) return;
  if (device_.is_cpu()) {
    std::memset(data(), 0, nbytes());
    return;
  }
#ifdef BRAID_WITH_CUDA
  detail::cuda_zero(data(), device_, nbytes());
#endif
}

double Tensor::item(int64_t i) const {
  BRAID_CHECK(i >= 0 && i < numel(), "item(", i, ") out of range for ", shape_);
  if (!device_.is_cpu()) return to(Device::cpu()).item(i);
  switch (dtype_) {
    case DType::f32:
      return data_ptr<float>()[i];
    case DType::bf16:
      return bf16_to_float(data_ptr<uint16_t>()[i]);
    case DType::f16:
      return f16_to_float(data_ptr<uint16_t>()[i]);
    case DType::i32:
      return data_ptr<int32_t>()[i];
    case DType::i64:
      return double(data_ptr<int64_t>()[i]);
    case DType::u8:
      return data_ptr<uint8_t>()[i];
  }
  return 0;
}

void Tensor::set_item(int64_t i, double value) const {
  BRAID_CHECK(i >= 0 && i < numel(), "set_item(", i, ") out of range for ", shape_);
  BRAID_CHECK(device_.is_cpu(), "set_item: tensor on ", device_.str(), " (host tensors only)");
  switch (dtype_) {
    case DType::f32:
      data_ptr<float>()[i] = float(value);
      return;
    case DType::bf16:
      data_ptr<uint16_t>()[i] = float_to_bf16(float(value));
      return;
    case DType::f16:
      data_ptr<uint16_t>()[i] = float_to_f16(float(value));
      return;
    case DType::i32:
      data_ptr<int32_t>()[i] = int32_t(value);
      return;
    case DType::i64:
      data_ptr<int64_t>()[i] = int64_t(value);
      return;
    case DType::u8:
      data_ptr<uint8_t>()[i] = uint8_t(value);
      return;
  }
}

std::string Tensor::str(int64_t max_elements) const {
  std::ostringstream out;
  out << "Tensor(" << dtype_name(dtype_) << shape_ << ", " << device_.str();
  if (defined()) {
    Tensor host = device_.is_cpu() ? *this : to(Device::cpu());
    out << ", [";
    for (int64_t i = 0; i < std::min(numel(), max_elements); ++i)
      out << (i ? ", " : "") << host.item(i);
    if (numel() > max_elements) out << ", ...";
    out << "]";
  }
  out << ")";
  return out.str();
}

void synchronize(const Device& device, Stream stream) {
  if (device.is_cpu()) return;
#ifdef BRAID_WITH_CUDA
  detail::cuda_synchronize(device, stream);
#else
  (void)stream;
#endif
}

void stream_wait(const Device& device, Stream waiter, Stream producer) {
  if (device.is_cpu() || waiter.handle == producer.handle) return;
#ifdef BRAID_WITH_CUDA
  detail::cuda_stream_wait(device, waiter, producer);
#endif
}

SideStream::SideStream(const Device& device) : device_(device) {
#ifdef BRAID_WITH_CUDA
  if (device.is_cuda()) stream_ = detail::cuda_stream_create(device);
#endif
}

SideStream::~SideStream() {
#ifdef BRAID_WITH_CUDA
  if (stream_.handle != nullptr) detail::cuda_stream_destroy(device_, stream_);
#endif
}

}  // namespace braid
