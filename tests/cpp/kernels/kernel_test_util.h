#pragma once
// Shared machinery of the kernel tests. Every test is written once and instantiated for each
// KernelCase: (device, activation dtype) = (cpu, f32), and with a GPU also (cuda, f32) and
// (cuda, bf16). Forward results are compared with naive double-precision references written
// in the tests; backward results with central finite differences through the forward op (f32),
// or, for bf16, with the f32 CPU backward on the same rounded inputs.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "braid/core/tensor.h"
#include "braid/kernels/ops.h"
#include "test_devices.h"

namespace braid::testing {

struct KernelCase {
  Device device;
  DType dtype;  // of the activations
};

inline std::vector<KernelCase> kernel_cases() {
  std::vector<KernelCase> cases;
  for (Device d : test_devices()) {
    cases.push_back({d, DType::f32});
    if (d.is_cuda()) cases.push_back({d, DType::bf16});
  }
  return cases;
}

inline std::string kernel_case_name(const ::testing::TestParamInfo<KernelCase>& info) {
  return std::string(info.param.device.is_cpu() ? "cpu" : "cuda") + "_" +
         dtype_name(info.param.dtype);
}

struct Tolerance {
  double atol, rtol;
};

using Tensors = std::vector<Tensor>;

// A host tensor on `device`; host f32 tensors are first rounded to `dtype` (other dtypes,
// e.g. i32 ids, travel unchanged).
inline Tensor upload(const Tensor& host, Device device, DType dtype = DType::f32) {
  Tensor h = host;
  if (host.dtype() == DType::f32 && dtype != DType::f32) {
    h = Tensor::empty(host.shape(), dtype);
    ops::cast(h, host);
  }
  return h.to(device);
}

// Any float tensor on any device as a host f32 tensor.
inline Tensor download(const Tensor& t) {
  Tensor h = t.to(Device::cpu());
  if (h.dtype() == DType::f32) return h;
  Tensor f = Tensor::empty(h.shape(), DType::f32);
  ops::cast(f, h);
  return f;
}

// The values a device computing in `dtype` actually sees.
inline Tensor rounded(const Tensor& host, DType dtype) {
  return download(upload(host, Device::cpu(), dtype));
}

inline std::vector<double> values(const Tensor& t) {
  Tensor h = download(t);
  std::vector<double> v(static_cast<size_t>(h.numel()));
  for (int64_t i = 0; i < h.numel(); ++i) v[size_t(i)] = h.data_ptr<float>()[i];
  return v;
}

// Element-wise |got - want| <= atol + rtol |want|; names the first few failures.
inline ::testing::AssertionResult all_close(const std::vector<double>& got,
                                            const std::vector<double>& want, Tolerance tol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "sizes differ: " << got.size() << " vs " << want.size();
  }
  int bad = 0;
  std::ostringstream msg;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;  // also equal infinities
    double err = std::fabs(got[i] - want[i]);
    if (!(err <= tol.atol + tol.rtol * std::fabs(want[i]))) {
      if (bad < 5) msg << "\n  [" << i << "] got " << got[i] << ", want " << want[i];
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements differ (atol "
                                       << tol.atol << ", rtol " << tol.rtol << ")" << msg.str();
}

inline ::testing::AssertionResult all_close(const Tensor& got, const std::vector<double>& want,
                                            Tolerance tol) {
  return all_close(values(got), want, tol);
}

// Runs f and expects a braid::Error whose message contains `needle` (the op's name).
template <typename F>
::testing::AssertionResult raises(F&& f, const std::string& needle) {
  try {
    f();
  } catch (const Error& e) {
    if (e.message().find(needle) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "message '" << e.message() << "' lacks '" << needle << "'";
  }
  return ::testing::AssertionFailure() << "no braid::Error (expected one naming " << needle << ")";
}

// Allocation beside an argument of a GradCheck lambda (which runs on the device under test and,
// for bf16 references, on the CPU): ref's device, and ref's dtype or f32.
inline Tensor empty_as(const Tensor& ref, const Shape& shape) {
  return Tensor::empty(shape, ref.dtype(), ref.device());
}
inline Tensor f32_as(const Tensor& ref, const Shape& shape) {
  return Tensor::empty(shape, DType::f32, ref.device());
}
inline Tensor zeros_f32_as(const Tensor& ref, const Shape& shape) {
  return Tensor::zeros(shape, DType::f32, ref.device());
}

// A backward check. `forward` maps device inputs to one device output; `backward` maps device
// inputs and the output's gradient to the gradients of inputs[wrt[0]], inputs[wrt[1]], ...
// The objective is sum(out * w) for random w, so the output gradient is w.
struct GradCheck {
  Tensors inputs;             // host f32 (or i32) tensors
  std::vector<int> wrt;       // inputs with a gradient, in the order backward returns them
  std::function<Tensor(const Tensors&)> forward;
  std::function<Tensors(const Tensors&, const Tensor&)> backward;
  double step = 1e-2;              // finite-difference step (f32 runs)
  Tolerance f32_tol{2e-3, 2e-3};   // analytic vs finite differences
  Tolerance bf16_tol{3e-2, 3e-2};  // bf16 device vs f32 cpu
  int samples = 24;                // elements of each input probed by finite differences
};

inline Tensors upload_all(const GradCheck& g, Device device, DType dtype) {
  Tensors out;
  for (const Tensor& t : g.inputs) out.push_back(upload(t, device, dtype));
  return out;
}

inline void check_gradients(const KernelCase& c, const GradCheck& g, uint64_t seed = 99) {
  Tensor probe = g.forward(upload_all(g, c.device, c.dtype));
  Tensor w = random_tensor(probe.shape(), seed);
  Tensors grads = g.backward(upload_all(g, c.device, c.dtype), upload(w, c.device, c.dtype));
  ASSERT_EQ(grads.size(), g.wrt.size());
  if (c.dtype != DType::f32) {
    // bf16: against the f32 CPU backward on the inputs the device saw.
    GradCheck ref = g;
    for (size_t i = 0; i < ref.inputs.size(); ++i) {
      if (ref.inputs[i].dtype() == DType::f32) ref.inputs[i] = rounded(ref.inputs[i], c.dtype);
    }
    Tensors want = ref.backward(upload_all(ref, Device::cpu(), DType::f32), rounded(w, c.dtype));
    for (size_t k = 0; k < grads.size(); ++k) {
      EXPECT_TRUE(all_close(grads[k], values(want[k]), g.bf16_tol)) << "gradient " << k;
    }
    return;
  }
  const std::vector<double> wv = values(w);
  Tensors host = g.inputs;  // perturbed in place, one element at a time
  auto objective = [&]() {
    Tensors dev;
    for (const Tensor& t : host) dev.push_back(t.to(c.device));
    std::vector<double> out = values(g.forward(dev));
    double sum = 0.0;
    for (size_t i = 0; i < out.size(); ++i) sum += out[i] * wv[i];
    return sum;
  };
  for (size_t k = 0; k < g.wrt.size(); ++k) {
    Tensor& x = host[size_t(g.wrt[k])];
    const std::vector<double> analytic = values(grads[k]);
    ASSERT_EQ(int64_t(analytic.size()), x.numel()) << "gradient " << k;
    int64_t n = x.numel(), probes = std::min<int64_t>(n, g.samples);
    std::vector<double> got, want;
    for (int64_t s = 0; s < probes; ++s) {
      // One probe per stretch of n / probes elements, at a varying place within it.
      int64_t i = (s * n) / probes + (s * 7919) % std::max<int64_t>(n / probes, 1);
      float* p = x.data_ptr<float>() + i;
      const float orig = *p;
      const float up = float(double(orig) + g.step), down = float(double(orig) - g.step);
      *p = up;
      double f_up = objective();
      *p = down;
      double f_down = objective();
      *p = orig;
      got.push_back(analytic[size_t(i)]);
      want.push_back((f_up - f_down) / (double(up) - double(down)));
    }
    EXPECT_TRUE(all_close(got, want, g.f32_tol))
        << "gradient " << k << " (input " << g.wrt[k] << ") against finite differences";
  }
}

// Base of the parametrised kernel tests.
class KernelTest : public ::testing::TestWithParam<KernelCase> {
 protected:
  Device device() const { return GetParam().device; }
  DType dtype() const { return GetParam().dtype; }
  bool is_f32() const { return GetParam().dtype == DType::f32; }
  // Activation-dtype tensor on the device under test.
  Tensor empty(const Shape& shape) const { return Tensor::empty(shape, dtype(), device()); }
  Tensor zeros(const Shape& shape) const { return Tensor::zeros(shape, dtype(), device()); }
  Tensor empty_f32(const Shape& shape) const { return Tensor::empty(shape, DType::f32, device()); }
  Tensor zeros_f32(const Shape& shape) const { return Tensor::zeros(shape, DType::f32, device()); }
  Tensor up(const Tensor& host) const { return upload(host, device(), dtype()); }
  Tensor up_f32(const Tensor& host) const { return upload(host, device(), DType::f32); }
  // Host inputs as the device sees them (for the double references).
  Tensor seen(const Tensor& host) const { return rounded(host, dtype()); }
  // Forward tolerance: f32 against double, or bf16 (inputs and output rounded).
  Tolerance tol(Tolerance f32, Tolerance bf16 = {2e-2, 2e-2}) const {
    return is_f32() ? f32 : bf16;
  }
};

#define BRAID_KERNEL_TEST_SUITE(Suite) \
  INSTANTIATE_TEST_SUITE_P(Devices, Suite, ::testing::ValuesIn(kernel_cases()), kernel_case_name)

}  // namespace braid::testing
