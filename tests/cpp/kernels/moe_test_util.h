#pragma once
// Host tensors for the mixture-of-experts kernel tests (test_moe.cpp, test_moe_router.cpp).
#include <algorithm>
#include <numeric>
#include <vector>

#include "kernel_test_util.h"

namespace braid::testing {

inline Tensor f32_tensor(const Shape& shape, const std::vector<double>& v) {
  Tensor t = Tensor::empty(shape, DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_ptr<float>()[i] = float(v[size_t(i)]);
  return t;
}

inline Tensor i32_tensor(const Shape& shape, const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty(shape, DType::i32);
  std::copy(v.begin(), v.end(), t.data_ptr<int32_t>());
  return t;
}

// A host f32 tensor of one value (NaN: garbage an output must overwrite).
inline Tensor filled(const Shape& shape, float value) {
  Tensor t = Tensor::empty(shape, DType::f32);
  std::fill_n(t.data_ptr<float>(), t.numel(), value);
  return t;
}

// Any i32 tensor as a host vector.
inline std::vector<int32_t> ints(const Tensor& t) {
  Tensor h = t.to(Device::cpu());
  return std::vector<int32_t>(h.data_ptr<int32_t>(), h.data_ptr<int32_t>() + h.numel());
}

// The indices that sort x[0, n) ascending: a random permutation for random x.
inline std::vector<int32_t> argsort(const float* x, int64_t n) {
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[a] < x[b]; });
  return order;
}

inline std::vector<int32_t> permutation(int64_t n, uint64_t seed) {
  Tensor r = random_tensor({n}, seed);
  return argsort(r.data_ptr<float>(), n);
}

}  // namespace braid::testing
