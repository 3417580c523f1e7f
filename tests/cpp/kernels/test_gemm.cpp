// matmul (all transposes, bias, alpha, accumulate, flattened leading dims) and bias_backward;
// the linear-layer recipes of ops.h checked against finite differences.
#include <array>
#include <cstdlib>
#include <string>

#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class Gemm : public KernelTest {};

// out[m][n] = alpha * sum_k A[m][k] B[k][n] + bias[n] (+ out0), from host tensors.
std::vector<double> gemm_reference(const Tensor& a, const Tensor& b, const Tensor& bias,
                                   bool trans_a, bool trans_b, double alpha, int64_t m, int64_t n,
                                   int64_t k, const std::vector<double>& out0) {
  std::vector<double> av = values(a), bv = values(b);
  std::vector<double> biasv = bias.defined() ? values(bias) : std::vector<double>();
  std::vector<double> out(size_t(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        double x = trans_a ? av[size_t(p * m + i)] : av[size_t(i * k + p)];
        double y = trans_b ? bv[size_t(j * k + p)] : bv[size_t(p * n + j)];
        sum += x * y;
      }
      double v = alpha * sum;
      if (bias.defined()) v += biasv[size_t(j)];
      if (!out0.empty()) v += out0[size_t(i * n + j)];
      out[size_t(i * n + j)] = v;
    }
  }
  return out;
}

TEST_P(Gemm, MatchesReferenceForEveryTransposeBiasAndAccumulate) {
  const int64_t m = 13, n = 17, k = 29;
  int seed = 1;
  for (bool trans_a : {false, true}) {
    for (bool trans_b : {false, true}) {
      for (bool with_bias : {false, true}) {
        for (bool accumulate : {false, true}) {
          SCOPED_TRACE(::testing::Message()
                       << "trans_a " << trans_a << " trans_b " << trans_b << " bias " << with_bias
                       << " accumulate " << accumulate);
          Tensor a = random_tensor(trans_a ? Shape{k, m} : Shape{m, k}, seed++);
          Tensor b = random_tensor(trans_b ? Shape{n, k} : Shape{k, n}, seed++);
          Tensor bias = with_bias ? random_tensor({n}, seed++) : Tensor();
          Tensor out0 = random_tensor({m, n}, seed++);
          Tensor out = up(out0);
          const float alpha = 0.75f;
          ops::matmul(out, up(a), up(b), with_bias ? up(bias) : Tensor(), trans_a, trans_b, alpha,
                      accumulate);
          std::vector<double> want = gemm_reference(
              seen(a), seen(b), with_bias ? seen(bias) : Tensor(), trans_a, trans_b, alpha, m, n, k,
              accumulate ? values(seen(out0)) : std::vector<double>{});
          // f32: K = 29 products of |x| < 1; bf16: the output is rounded to bf16.
          EXPECT_TRUE(all_close(out, want, tol({1e-5, 1e-5}, {3e-2, 1e-2})));
        }
      }
    }
  }
}

TEST_P(Gemm, LargeProductsSplitAcrossThreads) {
  // Big enough for the CPU to split the output between threads: by rows (M > N) and by
  // columns (N > M), with ragged last blocks.
  const std::vector<std::array<int64_t, 3>> shapes = {{301, 70, 130}, {40, 509, 120}};
  int seed = 50;
  for (const auto& [m, n, k] : shapes) {
    for (bool trans_a : {false, true}) {
      for (bool trans_b : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "M " << m << " N " << n << " K " << k << " trans_a "
                                          << trans_a << " trans_b " << trans_b);
        Tensor a = random_tensor(trans_a ? Shape{k, m} : Shape{m, k}, seed++);
        Tensor b = random_tensor(trans_b ? Shape{n, k} : Shape{k, n}, seed++);
        Tensor bias = random_tensor({n}, seed++), out0 = random_tensor({m, n}, seed++);
        Tensor out = up(out0);
        ops::matmul(out, up(a), up(b), up(bias), trans_a, trans_b, 0.5f, true);
        std::vector<double> want = gemm_reference(seen(a), seen(b), seen(bias), trans_a, trans_b,
                                                  0.5, m, n, k, values(seen(out0)));
        EXPECT_TRUE(all_close(out, want, tol({2e-5, 1e-5}, {5e-2, 1e-2})));
      }
    }
  }
}

TEST_P(Gemm, FlattensLeadingDims) {
  // a [2, 3, K] is [6, K]; out [2, 3, N].
  Tensor a = random_tensor({2, 3, 8}, 1), w = random_tensor({5, 8}, 2),
         bias = random_tensor({5}, 3);
  Tensor out = empty({2, 3, 5});
  ops::matmul(out, up(a), up(w), up(bias), false, true);
  EXPECT_TRUE(all_close(out,
                        gemm_reference(seen(a), seen(w), seen(bias), false, true, 1.0, 6, 5, 8, {}),
                        tol({1e-5, 1e-5})));
  // dW += dy^T x with dy [2, 3, N], x [2, 3, K]: K of the product is 6.
  Tensor dy = random_tensor({2, 3, 5}, 4), dw0 = random_tensor({5, 8}, 5);
  Tensor dw = up_f32(dw0);
  ops::matmul(dw, up(dy), up(a), Tensor(), true, false, 1.0f, true);
  EXPECT_TRUE(all_close(
      dw, gemm_reference(seen(dy), seen(a), Tensor(), true, false, 1.0, 5, 8, 6, values(dw0)),
      tol({1e-5, 1e-5})));
}

TEST_P(Gemm, F32OutputFromActivationInputs) {
  // On CUDA, bf16 operands may write an f32 out (logits, weight gradients).
  Tensor a = random_tensor({9, 31}, 6), b = random_tensor({31, 7}, 7);
  Tensor out = empty_f32({9, 7});
  ops::matmul(out, up(a), up(b), Tensor(), false, false);
  EXPECT_TRUE(all_close(out,
                        gemm_reference(seen(a), seen(b), Tensor(), false, false, 1.0, 9, 7, 31, {}),
                        tol({1e-5, 1e-5}, {1e-3, 1e-3})));
}

TEST_P(Gemm, EmptyKGivesBiasOrZeros) {
  Tensor a = Tensor::empty({4, 0}, DType::f32), b = Tensor::empty({0, 3}, DType::f32);
  Tensor bias = random_tensor({3}, 8);
  Tensor out = up(random_tensor({4, 3}, 9));
  ops::matmul(out, up(a), up(b), up(bias), false, false);
  std::vector<double> want;
  for (int i = 0; i < 4; ++i) {
    for (double v : values(seen(bias))) want.push_back(v);
  }
  EXPECT_TRUE(all_close(out, want, {0, 0}));
  ops::matmul(out, up(a), up(b), Tensor(), false, false);
  EXPECT_TRUE(all_close(out, std::vector<double>(12, 0.0), {0, 0}));
}

TEST_P(Gemm, BiasBackwardAddsColumnSums) {
  for (int64_t rows : {1, 5, 300}) {
    Tensor dout = random_tensor({rows, 70}, 10 + rows), db0 = random_tensor({70}, 11);
    Tensor db = up_f32(db0);
    ops::bias_backward(db, up(dout));
    std::vector<double> g = values(seen(dout)), want = values(db0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < 70; ++j) want[size_t(j)] += g[size_t(r * 70 + j)];
    }
    EXPECT_TRUE(all_close(db, want, tol({1e-5, 1e-5}, {1e-2, 1e-2}))) << rows << " rows";
  }
}

// y = x W^T + b; the backward recipes documented in ops.h against finite differences.
TEST_P(Gemm, LinearLayerRecipesMatchFiniteDifferences) {
  GradCheck g;
  g.inputs = {random_tensor({2, 6, 10}, 12), random_tensor({7, 10}, 13), random_tensor({7}, 14)};
  g.wrt = {0, 1, 2};
  g.forward = [](const Tensors& in) {
    Tensor y = empty_as(in[0], {2, 6, 7});
    ops::matmul(y, in[0], in[1], in[2], false, true);
    return y;
  };
  g.backward = [](const Tensors& in, const Tensor& dy) {
    Tensor dx = empty_as(in[0], {2, 6, 10}), dw = zeros_f32_as(in[0], {7, 10}),
           db = zeros_f32_as(in[0], {7});
    ops::matmul(dx, dy, in[1], Tensor(), false, false);
    ops::matmul(dw, dy, in[0], Tensor(), true, false, 1.0f, true);
    ops::bias_backward(db, dy);
    return Tensors{dx, dw, db};
  };
  check_gradients(GetParam(), g);
}

BRAID_KERNEL_TEST_SUITE(Gemm);

// OpenBLAS's kernels follow the CPU's features, not its model number, which Debian 12's OpenBLAS
// does not know for recent Xeons (it then falls back to its SSE3 kernels, Prescott, 4.6x slower
// here); braid's choice is not left in the environment, and the user's OPENBLAS_CORETYPE wins.
TEST(CpuBlas, KernelsFollowTheCpuFeatures) {
  const char* before = std::getenv("OPENBLAS_CORETYPE");  // set empty counts as unset
  const std::string user_core = before ? before : "";
  const ops::CpuBlas blas = ops::cpu_blas();
  EXPECT_FALSE(blas.library.empty());
  if (!user_core.empty()) {
    EXPECT_EQ(blas.chosen_by, "OPENBLAS_CORETYPE=" + user_core + " (yours)");
    return;
  }
  const char* after = std::getenv("OPENBLAS_CORETYPE");
  EXPECT_EQ(after == nullptr, before == nullptr) << "braid's choice left in the environment";
  EXPECT_STREQ(after ? after : "", "");
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl")) {
    EXPECT_EQ(blas.kernels, "SkylakeX") << blas.chosen_by;
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_EQ(blas.kernels, "Haswell") << blas.chosen_by;
  } else {
    EXPECT_EQ(blas.chosen_by, "OpenBLAS's own choice");
  }
#endif
}

}  // namespace
}  // namespace braid::testing
