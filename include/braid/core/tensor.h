#pragma once
// Tensor: dtype, shape (at most 5 dims), device, and a shared Storage plus a byte offset.
// Always contiguous; a view is a slice of one storage (that is how parameters and
// gradients live in flat buffers). No autograd: forward and backward are explicit.

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <span>
#include <string>

#include "braid/core/allocator.h"
#include "braid/core/dtype.h"
#include "braid/core/error.h"

namespace braid {

constexpr int kMaxDims = 5;

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(std::span<const int64_t> dims);

  int dim() const { return ndim_; }
  int64_t operator[](int i) const;  // negative i counts from the back
  int64_t numel() const;
  const int64_t* begin() const { return dims_.data(); }
  const int64_t* end() const { return dims_.data() + ndim_; }
  std::string str() const;  // "[2, 3]"
  bool operator==(const Shape& other) const;

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int ndim_ = 0;
};

std::ostream& operator<<(std::ostream& out, const Shape& shape);

// A block of device memory. Owns it through its allocator, or wraps foreign memory
// (DLPack, numpy) and runs the given deleter when the last view goes away.
class Storage {
 public:
  Storage(Device device, size_t nbytes);  // allocates
  Storage(Device device, void* data, size_t nbytes, std::function<void()> release);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  Device device_;
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  std::function<void()> release_;  // empty: return the bytes to allocator_for(device_)
};

class Tensor {
 public:
  Tensor() = default;  // undefined: optional arguments (a bias that is absent) use this

  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  // Wraps memory braid does not own; `release` runs when the last view is gone.
  static Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device,
                          std::function<void()> release = {});

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  int dim() const { return shape_.dim(); }
  int64_t size(int d) const { return shape_[d]; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }
  size_t offset_bytes() const { return offset_; }
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  void* data() const;
  template <typename T>
  T* data_ptr() const;  // checks that T matches dtype()

  // Views (share storage). `view` reinterprets the shape (same numel; one dim may be -1).
  Tensor view(const Shape& shape) const;
  // `slice` takes `shape.numel()` elements starting at element `offset` of this tensor.
  Tensor slice(int64_t offset, const Shape& shape) const;
  // Rows [start, start + length) of dim 0.
  Tensor narrow(int64_t start, int64_t length) const;
  // The same bytes seen as another dtype of equal size (bf16 <-> f16 bits, i32 <-> f32 bits).
  Tensor reinterpret(DType dtype) const;

  // Copies (same shape and dtype; any devices). Async on CUDA with respect to the host.
  void copy_from(const Tensor& src);
  Tensor to(Device device) const;
  Tensor clone() const;
  void zero_();

  // Host conveniences for tests and small tensors: element `i` as a double (any dtype).
  double item(int64_t i = 0) const;
  // Element `i` of a host tensor set from a double, rounded as a cast to the dtype would.
  void set_item(int64_t i, double value) const;
  std::string str(int64_t max_elements = 8) const;

 private:
  Tensor(std::shared_ptr<Storage> storage, size_t offset, const Shape& shape, DType dtype);
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;
  Shape shape_;
  DType dtype_ = DType::f32;
  Device device_;
};

template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::i32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::i64;
};
template <>
struct DTypeOf<uint8_t> {
  static constexpr DType value = DType::u8;
};

template <typename T>
T* Tensor::data_ptr() const {
  if constexpr (std::is_same_v<T, uint16_t>) {
    BRAID_CHECK(dtype_ == DType::bf16 || dtype_ == DType::f16, "data_ptr<uint16_t> on a ",
                dtype_name(dtype_), " tensor");
  } else {
    BRAID_CHECK(dtype_ == DTypeOf<T>::value, "data_ptr: tensor is ", dtype_name(dtype_),
                ", asked for ", dtype_name(DTypeOf<T>::value));
  }
  return static_cast<T*>(data());
}

}  // namespace braid
