// adamw_step against a hand-written double reference of torch.optim.AdamW over several steps
// (two weight-decay groups, gradient scaling, 16-bit model copies); sum_of_squares and
// count_zeros.
#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class Optimizer : public KernelTest {};

// torch.optim.AdamW, one tensor: decay, moments, bias-corrected update.
struct AdamWReference {
  std::vector<double> p, m, v;
  void step(const std::vector<double>& grad, const ops::AdamWHyper& h, double wd) {
    const double bc1 = 1 - std::pow(double(h.beta1), double(h.step));
    const double bc2 = 1 - std::pow(double(h.beta2), double(h.step));
    for (size_t i = 0; i < p.size(); ++i) {
      double g = grad[i] * h.grad_scale;
      p[i] *= 1 - double(h.lr) * wd;
      m[i] = h.beta1 * m[i] + (1 - double(h.beta1)) * g;
      v[i] = h.beta2 * v[i] + (1 - double(h.beta2)) * g * g;
      p[i] -= double(h.lr) / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + h.eps);
    }
  }
};

TEST_P(Optimizer, AdamWFollowsTorchOverSeveralSteps) {
  const std::vector<int64_t> sizes = {1000, 37};   // a weight matrix, a bias
  const std::vector<float> decays = {0.1f, 0.0f};  // decayed group, no-decay group
  const std::vector<DType> copies = {dtype() == DType::f32 ? DType::bf16 : dtype(), DType::f16};
  std::vector<ops::AdamWGroup> groups;
  std::vector<AdamWReference> refs;
  for (size_t k = 0; k < sizes.size(); ++k) {
    Tensor p = random_tensor({sizes[k]}, 10 + k);
    ops::AdamWGroup g;
    g.master = up_f32(p);
    g.grad = zeros_f32({sizes[k]});
    g.exp_avg = zeros_f32({sizes[k]});
    g.exp_avg_sq = zeros_f32({sizes[k]});
    g.weight_decay = decays[k];
    g.model_param = Tensor::empty({sizes[k]}, copies[k], device());
    groups.push_back(g);
    refs.push_back({values(p), std::vector<double>(size_t(sizes[k]), 0.0),
                    std::vector<double>(size_t(sizes[k]), 0.0)});
  }
  ops::AdamWHyper h;
  h.lr = 3e-3f;
  h.beta1 = 0.9f;
  h.beta2 = 0.95f;
  h.eps = 1e-8f;
  h.grad_scale = 0.5f;
  for (int64_t step = 1; step <= 5; ++step) {
    h.step = step;
    for (size_t k = 0; k < groups.size(); ++k) {
      Tensor grad = random_tensor({sizes[k]}, 100 * uint64_t(step) + k, 2.0f);
      groups[k].grad.copy_from(grad.to(device()));
      refs[k].step(values(grad), h, decays[k]);
    }
    ops::adamw_step(groups, h);
  }
  for (size_t k = 0; k < groups.size(); ++k) {
    SCOPED_TRACE(::testing::Message() << "group " << k);
    EXPECT_TRUE(all_close(groups[k].master, refs[k].p, {1e-6, 1e-5}));
    EXPECT_TRUE(all_close(groups[k].exp_avg, refs[k].m, {1e-7, 1e-5}));
    EXPECT_TRUE(all_close(groups[k].exp_avg_sq, refs[k].v, {1e-8, 1e-5}));
    // The model copy is the updated master rounded to nearest even.
    EXPECT_TRUE(all_close(groups[k].model_param,
                          values(rounded(download(groups[k].master), copies[k])), {0, 0}));
  }
}

TEST_P(Optimizer, AdamWWithoutModelCopyAndF32Copy) {
  Tensor p = random_tensor({300}, 1), grad = random_tensor({300}, 2);
  ops::AdamWGroup a{up_f32(p), up_f32(grad), zeros_f32({300}), zeros_f32({300}), 0.01f, {}};
  ops::AdamWGroup b{up_f32(p),        up_f32(grad), zeros_f32({300}),
                    zeros_f32({300}), 0.01f,        empty_f32({300})};
  ops::AdamWHyper h;
  std::vector<ops::AdamWGroup> groups = {a, b};
  ops::adamw_step(groups, h);
  AdamWReference ref{values(p), std::vector<double>(300, 0.0), std::vector<double>(300, 0.0)};
  ref.step(values(grad), h, 0.01);
  EXPECT_TRUE(all_close(a.master, ref.p, {1e-6, 1e-5}));
  EXPECT_TRUE(all_close(b.model_param, values(b.master), {0, 0}));
  // First step: the update is lr * sign(g) up to eps (m / sqrt(v) = g / |g| after correction).
  std::vector<double> pv = values(p), gv = values(grad), got = values(a.master);
  for (size_t i = 0; i < 300; ++i) {
    double want = pv[i] * (1 - 1e-3 * 0.01) - 1e-3 * (gv[i] > 0 ? 1 : -1);
    EXPECT_NEAR(got[i], want, 1e-6) << i;
  }
}

TEST_P(Optimizer, SumOfSquaresOverSeveralTensors) {
  std::vector<Tensor> tensors;
  double want = 0.0;
  const std::vector<DType> dtypes = {DType::f32, DType::bf16, DType::f16, DType::f32};
  const std::vector<int64_t> sizes = {1000, 333, 70000, 1};
  for (size_t k = 0; k < sizes.size(); ++k) {
    Tensor host = random_tensor({sizes[k]}, 20 + k, 3.0f);
    Tensor t = upload(host, device(), dtypes[k]);
    for (double v : values(t)) want += v * v;
    tensors.push_back(t);
  }
  tensors.push_back(zeros_f32({0}));  // an empty tensor adds nothing
  Tensor out = empty_f32({1});
  ops::sum_of_squares(out, tensors);
  EXPECT_NEAR(values(out)[0], want, want * 1e-6);
  ops::sum_of_squares(out, std::span<const Tensor>());
  EXPECT_EQ(values(out)[0], 0.0);
}

// Megatron's --log-num-zeros-in-grad: every zero (+0 and -0) of f32, bf16 and f16 tensors,
// across chunk boundaries, counted exactly.
TEST_P(Optimizer, CountZerosOverSeveralTensors) {
  std::vector<Tensor> tensors;
  int64_t want = 0;
  const std::vector<DType> dtypes = {DType::f32, DType::bf16, DType::f16, DType::f32};
  const std::vector<int64_t> sizes = {1000, 333, 70000, 1};
  for (size_t k = 0; k < sizes.size(); ++k) {
    Tensor host = random_tensor({sizes[k]}, 40 + k, 3.0f);
    float* x = host.data_ptr<float>();
    for (int64_t i = 0; i < sizes[k]; ++i)  // zeros at an irregular stride, some negative
      if ((i * 7 + int64_t(k)) % 13 < 3) x[i] = (i % 2 ? -0.0f : 0.0f);
    Tensor t = upload(host, device(), dtypes[k]);
    for (double v : values(t)) want += v == 0.0;
    tensors.push_back(t);
  }
  ASSERT_GT(want, 10000);
  tensors.push_back(zeros_f32({0}));  // an empty tensor adds nothing
  Tensor out = Tensor::empty({1}, DType::i64, device());
  auto counted = [&] { return out.to(Device::cpu()).data_ptr<int64_t>()[0]; };
  ops::count_zeros(out, tensors);
  EXPECT_EQ(counted(), want);
  ops::count_zeros(out, std::span<const Tensor>());
  EXPECT_EQ(counted(), 0);
}

BRAID_KERNEL_TEST_SUITE(Optimizer);

}  // namespace
}  // namespace braid::testing
