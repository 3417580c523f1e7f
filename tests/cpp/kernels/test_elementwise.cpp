// add, scale, cast, gelu (tanh approximation and exact), squared relu, sigmoid, and SwiGLU (the
// gated linear unit's default spec; its other forms: test_glu.cpp).
#include <algorithm>

#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class Elementwise : public KernelTest {};

double gelu_ref(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}
double silu_ref(double x) { return x / (1.0 + std::exp(-x)); }

TEST_P(Elementwise, AddAndScale) {
  Tensor a = random_tensor({3, 50}, 1, 4.0f), b = random_tensor({3, 50}, 2, 4.0f);
  std::vector<double> av = values(seen(a)), bv = values(seen(b)), sum(av.size()), scaled(av.size());
  for (size_t i = 0; i < av.size(); ++i) {
    sum[i] = av[i] + bv[i];
    scaled[i] = -1.5 * av[i];
  }
  Tensor out = empty({3, 50});
  ops::add(out, up(a), up(b));
  EXPECT_TRUE(all_close(out, sum, tol({1e-6, 1e-6})));
  ops::scale(out, up(a), -1.5f);
  EXPECT_TRUE(all_close(out, scaled, tol({1e-6, 1e-6})));
  // In place: out aliases an input.
  Tensor x = up(a);
  ops::add(x, x, up(b));
  EXPECT_TRUE(all_close(x, sum, tol({1e-6, 1e-6})));
  ops::scale(x, x, 2.0f);
  for (double& v : sum) v *= 2.0;
  EXPECT_TRUE(all_close(x, sum, tol({1e-6, 1e-6})));
  ops::scale(x, x, 1.0f, 1.0f);  // with an offset: 1 + w, a zero-centered norm weight
  for (double& v : sum) v += 1.0;
  EXPECT_TRUE(all_close(x, sum, tol({1e-6, 1e-6})));
}

TEST_P(Elementwise, CastRoundsToNearestEven) {
  // 1 + 2^-8 lies halfway between two bf16 values: it rounds to the even one (1.0); 1 + 3*2^-8
  // rounds up to 1 + 2^-6. f16 has 10 mantissa bits: 1 + 2^-11 rounds to 1.
  const std::vector<float> in = {
      1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -2.5f, 65504.0f, 1.0f + 0x1p-11f, 0.0f, -0.0f, 3.0e-3f};
  Tensor host = Tensor::empty({int64_t(in.size())}, DType::f32);
  std::copy(in.begin(), in.end(), host.data_ptr<float>());
  Tensor x = host.to(device());
  for (DType to : {DType::bf16, DType::f16, DType::f32}) {
    Tensor y = Tensor::empty(host.shape(), to, device());
    ops::cast(y, x);
    Tensor back = Tensor::empty(host.shape(), DType::f32, device());
    ops::cast(back, y);
    std::vector<double> want;
    for (float v : in) {
      want.push_back(to == DType::bf16  ? bf16_to_float(float_to_bf16(v))
                     : to == DType::f16 ? f16_to_float(float_to_f16(v))
                                        : double(v));
    }
    EXPECT_TRUE(all_close(back, want, {0, 0})) << dtype_name(to);
  }
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 0x1p-8f)), 1.0f);
  // bf16 <-> f16 directly.
  Tensor h = Tensor::empty(host.shape(), DType::f16, device());
  Tensor bf = Tensor::empty(host.shape(), DType::bf16, device());
  ops::cast(bf, x);
  ops::cast(h, bf);
  std::vector<double> want;
  for (float v : in) want.push_back(f16_to_float(float_to_f16(bf16_to_float(float_to_bf16(v)))));
  EXPECT_TRUE(all_close(h, want, {0, 0}));
}

TEST_P(Elementwise, GeluForwardIsTheTanhApproximation) {
  Tensor x = random_tensor({7, 45}, 3, 5.0f);
  Tensor out = empty({7, 45});
  ops::gelu_forward(out, up(x));
  std::vector<double> want;
  for (double v : values(seen(x))) want.push_back(gelu_ref(v));
  EXPECT_TRUE(all_close(out, want, tol({1e-6, 1e-5})));
  // Large |x| saturates to x and 0.
  Tensor big = Tensor::empty({4}, DType::f32);
  const float bigs[] = {-30.0f, 30.0f, -100.0f, 100.0f};
  std::copy(bigs, bigs + 4, big.data_ptr<float>());
  Tensor o = empty({4});
  ops::gelu_forward(o, up(big));
  EXPECT_TRUE(all_close(o, {0.0, 30.0, 0.0, 100.0}, tol({1e-6, 1e-6})));
}

TEST_P(Elementwise, GeluBackwardMatchesFiniteDifferences) {
  GradCheck g;
  g.inputs = {random_tensor({5, 37}, 4, 4.0f)};
  g.wrt = {0};
  g.samples = 64;
  g.forward = [](const Tensors& in) {
    Tensor y = empty_as(in[0], in[0].shape());
    ops::gelu_forward(y, in[0]);
    return y;
  };
  g.backward = [](const Tensors& in, const Tensor& dy) {
    Tensor dx = empty_as(in[0], in[0].shape());
    ops::gelu_backward(dx, dy, in[0]);
    return Tensors{dx};
  };
  g.step = 1e-2;
  g.f32_tol = {2e-3, 2e-3};
  check_gradients(GetParam(), g);
}

// torch's F.gelu: x Phi(x) with erf, and its gradient; up to 4.7e-4 from the tanh form.
TEST_P(Elementwise, GeluExactIsTheErfForm) {
  Tensor x = random_tensor({7, 45}, 3, 5.0f), dout = random_tensor({7, 45}, 8, 1.0f);
  Tensor out = empty({7, 45}), dx = empty({7, 45});
  ops::gelu_exact_forward(out, up(x));
  ops::gelu_exact_backward(dx, up(dout), up(x));
  std::vector<double> want, want_dx, tanh_form;
  const std::vector<double> xs = values(seen(x)), gs = values(seen(dout));
  for (size_t i = 0; i < xs.size(); ++i) {
    const double v = xs[i], cdf = 0.5 * (1.0 + std::erf(v / std::sqrt(2.0)));
    want.push_back(v * cdf);
    want_dx.push_back(gs[i] * (cdf + v * std::exp(-0.5 * v * v) / std::sqrt(2.0 * M_PI)));
    tanh_form.push_back(gelu_ref(v));
  }
  EXPECT_TRUE(all_close(out, want, tol({1e-6, 1e-5})));
  EXPECT_TRUE(all_close(dx, want_dx, tol({1e-6, 1e-5})));
  if (is_f32()) {  // 16-bit outputs round by more than the two forms differ
    EXPECT_FALSE(all_close(out, tanh_form, {1e-6, 1e-5}));  // a different function
    EXPECT_TRUE(all_close(out, tanh_form, {5e-4, 0}));
  }
}

TEST_P(Elementwise, SquaredReluAndItsGradient) {
  // relu(x)^2 and dout * 2 relu(x), negatives and exact zeros included.
  Tensor x = random_tensor({6, 41}, 6, 3.0f), dout = random_tensor({6, 41}, 7, 1.0f);
  x.data_ptr<float>()[0] = 0.0f;
  x.data_ptr<float>()[1] = -0.0f;
  const std::vector<double> xv = values(seen(x)), dv = values(seen(dout));
  std::vector<double> want_y, want_dx;
  for (size_t i = 0; i < xv.size(); ++i) {
    const double r = std::max(xv[i], 0.0);
    want_y.push_back(r * r);
    want_dx.push_back(dv[i] * 2.0 * r);
  }
  Tensor y = empty({6, 41}), dx = empty({6, 41});
  ops::squared_relu_forward(y, up(x));
  EXPECT_TRUE(all_close(y, want_y, tol({1e-6, 1e-5})));
  ops::squared_relu_backward(dx, up(dout), up(x));
  EXPECT_TRUE(all_close(dx, want_dx, tol({1e-6, 1e-5})));
}

TEST_P(Elementwise, SigmoidAndItsGradient) {
  // 1 / (1 + exp(-x)) and dout s (1 - s), far into both tails (the shared expert's gate).
  Tensor x = random_tensor({5, 37}, 8, 12.0f), dout = random_tensor({5, 37}, 9, 1.0f);
  x.data_ptr<float>()[0] = 0.0f;
  x.data_ptr<float>()[1] = 90.0f;
  x.data_ptr<float>()[2] = -90.0f;
  const std::vector<double> xv = values(seen(x)), dv = values(seen(dout));
  std::vector<double> want_y, want_dx;
  for (size_t i = 0; i < xv.size(); ++i) {
    const double sig = 1.0 / (1.0 + std::exp(-xv[i]));
    want_y.push_back(sig);
    want_dx.push_back(dv[i] * sig * (1.0 - sig));
  }
  Tensor y = empty({5, 37}), dx = empty({5, 37});
  ops::sigmoid_forward(y, up(x));
  EXPECT_TRUE(all_close(y, want_y, tol({1e-6, 1e-5})));
  ops::sigmoid_backward(dx, up(dout), up(x));
  EXPECT_TRUE(all_close(dx, want_dx, tol({1e-6, 1e-5})));
}

TEST_P(Elementwise, SwigluForward) {
  const int64_t f = 19;
  Tensor x = random_tensor({2, 3, 2 * f}, 5, 4.0f);
  Tensor out = empty({2, 3, f});
  ops::glu_forward(out, up(x));
  std::vector<double> xv = values(seen(x)), want;
  for (int64_t r = 0; r < 6; ++r) {
    for (int64_t j = 0; j < f; ++j) {
      want.push_back(silu_ref(xv[size_t(r * 2 * f + j)]) * xv[size_t(r * 2 * f + f + j)]);
    }
  }
  EXPECT_TRUE(all_close(out, want, tol({1e-5, 1e-5})));
}

TEST_P(Elementwise, SwigluBackwardMatchesFiniteDifferences) {
  GradCheck g;
  g.inputs = {random_tensor({4, 2 * 23}, 6, 3.0f)};
  g.wrt = {0};
  g.samples = 64;
  g.forward = [](const Tensors& in) {
    Tensor y = empty_as(in[0], {4, 23});
    ops::glu_forward(y, in[0]);
    return y;
  };
  g.backward = [](const Tensors& in, const Tensor& dy) {
    Tensor dx = empty_as(in[0], in[0].shape());
    ops::glu_backward(dx, dy, in[0]);
    return Tensors{dx};
  };
  g.step = 1e-2;
  g.f32_tol = {2e-3, 2e-3};
  check_gradients(GetParam(), g);
}

BRAID_KERNEL_TEST_SUITE(Elementwise);

}  // namespace
}  // namespace braid::testing
