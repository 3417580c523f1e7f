// layernorm (biased variance) and rmsnorm, forward and backward.
#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class Norm : public KernelTest {};

constexpr int64_t kRows = 6, kC = 40;

TEST_P(Norm, LayernormForward) {
  Tensor x = random_tensor({2, 3, kC}, 1, 3.0f), w = random_tensor({kC}, 2),
         b = random_tensor({kC}, 3);
  // A constant offset per row: the mean must not leak into the variance.
  float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) xp[i] += float(i / kC);
  Tensor out = empty({2, 3, kC}), mean = empty_f32({2, 3}), rstd = empty_f32({kRows});
  const float eps = 1e-5f;
  ops::layernorm_forward(out, mean, rstd, up(x), up(w), up(b), eps);
  std::vector<double> xv = values(seen(x)), wv = values(seen(w)), bv = values(seen(b));
  std::vector<double> want, want_mean, want_rstd;
  for (int64_t r = 0; r < kRows; ++r) {
    double mu = 0, var = 0;
    for (int64_t j = 0; j < kC; ++j) mu += xv[size_t(r * kC + j)] / kC;
    for (int64_t j = 0; j < kC; ++j) var += std::pow(xv[size_t(r * kC + j)] - mu, 2) / kC;
    double rs = 1.0 / std::sqrt(var + eps);
    want_mean.push_back(mu);
    want_rstd.push_back(rs);
    for (int64_t j = 0; j < kC; ++j) {
      want.push_back((xv[size_t(r * kC + j)] - mu) * rs * wv[size_t(j)] + bv[size_t(j)]);
    }
  }
  EXPECT_TRUE(all_close(out, want, tol({1e-5, 1e-5})));
  EXPECT_TRUE(all_close(mean, want_mean, {1e-5, 1e-5}));
  EXPECT_TRUE(all_close(rstd, want_rstd, {1e-5, 1e-5}));
}

TEST_P(Norm, LayernormBackwardMatchesFiniteDifferences) {
  GradCheck g;
  g.inputs = {random_tensor({kRows, kC}, 4, 2.0f), random_tensor({kC}, 5), random_tensor({kC}, 6)};
  g.wrt = {0, 1, 2};
  g.forward = [](const Tensors& in) {
    Tensor y = empty_as(in[0], {kRows, kC}), mean = f32_as(in[0], {kRows}),
           rstd = f32_as(in[0], {kRows});
    ops::layernorm_forward(y, mean, rstd, in[0], in[1], in[2], 1e-5f);
    return y;
  };
  g.backward = [](const Tensors& in, const Tensor& dy) {
    Tensor y = empty_as(in[0], {kRows, kC}), mean = f32_as(in[0], {kRows}),
           rstd = f32_as(in[0], {kRows});
    ops::layernorm_forward(y, mean, rstd, in[0], in[1], in[2], 1e-5f);
    Tensor dx = empty_as(in[0], {kRows, kC}), dw = zeros_f32_as(in[0], {kC}),
           db = zeros_f32_as(in[0], {kC});
    ops::layernorm_backward(dx, dw, db, dy, in[0], in[1], mean, rstd);
    return Tensors{dx, dw, db};
  };
  g.step = 1e-2;
  g.f32_tol = {3e-3, 3e-3};
  g.samples = 40;
  check_gradients(GetParam(), g);
}

TEST_P(Norm, ParameterGradientsAccumulate) {
  Tensor x = random_tensor({kRows, kC}, 7), w = random_tensor({kC}, 8), b = random_tensor({kC}, 9);
  Tensor dy = random_tensor({kRows, kC}, 10);
  Tensor y = empty({kRows, kC}), mean = empty_f32({kRows}), rstd = empty_f32({kRows});
  ops::layernorm_forward(y, mean, rstd, up(x), up(w), up(b), 1e-5f);
  Tensor dx = empty({kRows, kC}), dw = zeros_f32({kC}), db = zeros_f32({kC});
  ops::layernorm_backward(dx, dw, db, up(dy), up(x), up(w), mean, rstd);
  std::vector<double> once_w = values(dw), once_b = values(db);
  ops::layernorm_backward(dx, dw, db, up(dy), up(x), up(w), mean, rstd);
  for (double& v : once_w) v *= 2;
  for (double& v : once_b) v *= 2;
  EXPECT_TRUE(all_close(dw, once_w, {1e-6, 1e-6}));
  EXPECT_TRUE(all_close(db, once_b, {1e-6, 1e-6}));
  Tensor rms = empty_f32({kRows}), dwr = zeros_f32({kC});
  ops::rmsnorm_forward(y, rms, up(x), up(w), 1e-6f);
  ops::rmsnorm_backward(dx, dwr, up(dy), up(x), up(w), rms);
  std::vector<double> once_r = values(dwr);
  ops::rmsnorm_backward(dx, dwr, up(dy), up(x), up(w), rms);
  for (double& v : once_r) v *= 2;
  EXPECT_TRUE(all_close(dwr, once_r, {1e-6, 1e-6}));
}

TEST_P(Norm, RmsnormForward) {
  Tensor x = random_tensor({kRows, kC}, 11, 3.0f), w = random_tensor({kC}, 12);
  Tensor out = empty({kRows, kC}), rstd = empty_f32({kRows});
  const float eps = 1e-6f;
  ops::rmsnorm_forward(out, rstd, up(x), up(w), eps);
  std::vector<double> xv = values(seen(x)), wv = values(seen(w)), want, want_rstd;
  for (int64_t r = 0; r < kRows; ++r) {
    double ms = 0;
    for (int64_t j = 0; j < kC; ++j) ms += std::pow(xv[size_t(r * kC + j)], 2) / kC;
    double rs = 1.0 / std::sqrt(ms + eps);
    want_rstd.push_back(rs);
    for (int64_t j = 0; j < kC; ++j) want.push_back(xv[size_t(r * kC + j)] * rs * wv[size_t(j)]);
  }
  EXPECT_TRUE(all_close(out, want, tol({1e-5, 1e-5})));
  EXPECT_TRUE(all_close(rstd, want_rstd, {1e-5, 1e-5}));
}

TEST_P(Norm, RmsnormBackwardMatchesFiniteDifferences) {
  GradCheck g;
  g.inputs = {random_tensor({kRows, kC}, 13, 2.0f), random_tensor({kC}, 14)};
  g.wrt = {0, 1};
  g.forward = [](const Tensors& in) {
    Tensor y = empty_as(in[0], {kRows, kC}), rstd = f32_as(in[0], {kRows});
    ops::rmsnorm_forward(y, rstd, in[0], in[1], 1e-6f);
    return y;
  };
  g.backward = [](const Tensors& in, const Tensor& dy) {
    Tensor y = empty_as(in[0], {kRows, kC}), rstd = f32_as(in[0], {kRows});
    ops::rmsnorm_forward(y, rstd, in[0], in[1], 1e-6f);
    Tensor dx = empty_as(in[0], {kRows, kC}), dw = zeros_f32_as(in[0], {kC});
    ops::rmsnorm_backward(dx, dw, dy, in[0], in[1], rstd);
    return Tensors{dx, dw};
  };
  g.step = 1e-2;
  g.f32_tol = {3e-3, 3e-3};
  g.samples = 40;
  check_gradients(GetParam(), g);
}

BRAID_KERNEL_TEST_SUITE(Norm);

}  // namespace
}  // namespace braid::testing
