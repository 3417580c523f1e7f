#pragma once
// The devices a test runs on: always the CPU (the reference), plus CUDA device 0 when
// braid was built with CUDA and a GPU is visible. BRAID_TEST_DEVICE=cuda makes a missing
// GPU an error instead of a skip, and makes `default_test_device()` CUDA, so the model and
// engine tests run there too.

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "braid/core/tensor.h"

namespace braid::testing {

inline bool cuda_required() {
  const char* env = std::getenv("BRAID_TEST_DEVICE");
  return env != nullptr && std::string(env) == "cuda";
}

inline void require_cuda_if_asked() {
  if (cuda_required() && !cuda_available())
    throw std::runtime_error("BRAID_TEST_DEVICE=cuda but no CUDA device");
}

// Called where the parametrized suites are instantiated, before main: the throw ends the
// program with its message rather than letting the suites pass on the CPU alone.
inline std::vector<Device> test_devices() {
  require_cuda_if_asked();
  std::vector<Device> devices{Device::cpu()};
  if (cuda_available()) devices.push_back(Device::cuda(0));
  return devices;
}

inline Device default_test_device() {
  require_cuda_if_asked();
  return cuda_required() ? Device::cuda(0) : Device::cpu();
}

inline std::string device_test_name(const ::testing::TestParamInfo<Device>& info) {
  return info.param.is_cpu() ? "cpu" : "cuda";
}

// Fills a host f32 tensor with reproducible values in [-scale, scale).
inline Tensor random_tensor(const Shape& shape, uint64_t seed, float scale = 1.0f) {
  Tensor t = Tensor::empty(shape, DType::f32);
  float* p = t.data_ptr<float>();
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < t.numel(); ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = scale * (float((x >> 11) & 0xFFFFFF) / float(1 << 23) - 1.0f);
  }
  return t;
}

}  // namespace braid::testing
