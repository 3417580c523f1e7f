// Mixture-of-experts token dispatch: the gather, the weighted combine and its weight gradient
// against double references and against finite differences of the combine; their argument
// checks. The routing is tested in test_moe_router.cpp.
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <numeric>

#include "moe_test_util.h"

namespace braid::testing {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------- dispatch and combine

class MoeDispatch : public KernelTest {};

TEST_P(MoeDispatch, GatherRowsCopiesAndScalesRows) {
  const int64_t t_count = 6;
  const std::vector<int32_t> index = {3, 0, 3, 3, 5, 1, 0, 2};  // repeats; row 4 unused
  const int64_t n = int64_t(index.size());
  for (int64_t c : {24, 13}) {  // whole vector packs, and single elements
    Tensor x = random_tensor({t_count, c}, uint64_t(c)), scale = random_tensor({n}, 7, 2.0f);
    const std::vector<double> xv = values(seen(x)), sv = values(scale);
    for (bool scaled : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "C " << c << " scaled " << scaled);
      std::vector<double> want;
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < c; ++j) {
          want.push_back((scaled ? sv[size_t(i)] : 1.0) * xv[size_t(index[size_t(i)] * c + j)]);
        }
      }
      Tensor out = up(filled({n, c}, kNaN));
      ops::gather_rows(out, up(x), up(i32_tensor({n}, index)), scaled ? up_f32(scale) : Tensor());
      // A copy is exact; a scaled row is one rounding of the product (twice in bf16).
      EXPECT_TRUE(all_close(out, want, scaled ? tol({0, 1e-7}, {0, 4e-3}) : Tolerance{0, 0}));
    }
  }
}

struct CombineCase {
  int64_t t, k, n, c;
  std::vector<int32_t> rows;  // empty: a permutation of the T k rows, as the dispatch plan makes
};

const std::vector<CombineCase>& combine_cases() {
  static const std::vector<CombineCase> cases = {
      {9, 1, 9, 40, {}},
      {7, 3, 21, 40, {}},
      {33, 3, 99, 13, {}},
      {5, 3, 4, 13, {0, 0, 0, 3, 1, 3, 2, 2, 1, 0, 3, 3, 1, 1, 1}},  // repeated rows
      {4, 1, 2, 16, {1, 1, 0, 1}},
  };
  return cases;
}

std::vector<int32_t> rows_of(const CombineCase& cc, uint64_t seed) {
  return cc.rows.empty() ? permutation(cc.t * cc.k, seed) : cc.rows;
}

TEST_P(MoeDispatch, CombineRowsSumsWeightedRows) {
  uint64_t seed = 10;
  for (const CombineCase& cc : combine_cases()) {
    const std::vector<int32_t> rows = rows_of(cc, seed);
    Tensor y = random_tensor({cc.n, cc.c}, seed + 1),
           weight = random_tensor({cc.t, cc.k}, seed + 2);
    seed += 3;
    const std::vector<double> yv = values(seen(y)), wv = values(weight);
    for (bool weighted : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "T " << cc.t << " k " << cc.k << " N " << cc.n << " C "
                                        << cc.c << " weighted " << weighted);
      std::vector<double> want(size_t(cc.t * cc.c), 0.0);
      for (int64_t t = 0; t < cc.t; ++t) {
        for (int64_t j = 0; j < cc.k; ++j) {
          const double f = weighted ? wv[size_t(t * cc.k + j)] : 1.0;
          const int32_t r = rows[size_t(t * cc.k + j)];
          for (int64_t i = 0; i < cc.c; ++i) {
            want[size_t(t * cc.c + i)] += f * yv[size_t(r * cc.c + i)];
          }
        }
      }
      Tensor out = up(filled({cc.t, cc.c}, kNaN));  // overwritten, not accumulated into
      ops::combine_rows(out, up(y), up(i32_tensor({cc.t, cc.k}, rows)),
                        weighted ? up_f32(weight) : Tensor());
      EXPECT_TRUE(all_close(out, want, tol({1e-6, 1e-5}, {1e-5, 8e-3})));
    }
  }
}

TEST_P(MoeDispatch, CombineRowsWeightGradIsADotProduct) {
  uint64_t seed = 30;
  std::vector<CombineCase> cases = combine_cases();
  cases.push_back({6, 2, 12, 520, {}});  // rows longer than one pass of a warp's packs
  for (const CombineCase& cc : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "T " << cc.t << " k " << cc.k << " N " << cc.n << " C " << cc.c);
    const std::vector<int32_t> rows = rows_of(cc, seed);
    Tensor y = random_tensor({cc.n, cc.c}, seed + 1), dout = random_tensor({cc.t, cc.c}, seed + 2);
    seed += 3;
    const std::vector<double> yv = values(seen(y)), gv = values(seen(dout));
    std::vector<double> want;
    for (int64_t t = 0; t < cc.t; ++t) {
      for (int64_t j = 0; j < cc.k; ++j) {
        const int32_t r = rows[size_t(t * cc.k + j)];
        double dot = 0;
        for (int64_t i = 0; i < cc.c; ++i)
          dot += gv[size_t(t * cc.c + i)] * yv[size_t(r * cc.c + i)];
        want.push_back(dot);
      }
    }
    Tensor dweight = up_f32(filled({cc.t, cc.k}, kNaN));
    ops::combine_rows_weight_grad(dweight, up(dout), up(y), up(i32_tensor({cc.t, cc.k}, rows)));
    // bf16 inputs multiply exactly in f32: only the f32 accumulation differs from the reference.
    EXPECT_TRUE(all_close(dweight, want, {2e-5, 2e-5}));
  }
}

// The combine's gradients: combine_rows_weight_grad for the weights, and for y the gather of
// dout by each row's token, scaled by its weight (the rows are a permutation, so every row of y
// feeds exactly one token). Checked against finite differences of combine_rows (linear in both:
// exact up to rounding); for bf16 against the f32 CPU on the same rounded inputs.
TEST_P(MoeDispatch, CombineGradientsMatchFiniteDifferences) {
  for (int64_t k : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << "k " << k);
    const int64_t t_count = 5, n = t_count * k, c = 16;
    GradCheck g;
    g.inputs = {random_tensor({n, c}, 50 + uint64_t(k)),
                i32_tensor({t_count, k}, permutation(n, 51 + uint64_t(k))),
                random_tensor({t_count, k}, 52 + uint64_t(k))};
    g.wrt = {0, 2};
    g.samples = 40;
    g.f32_tol = {1e-4, 1e-4};
    // The weights travel as activations in GradCheck; combine_rows wants them in f32.
    auto weight_f32 = [](const Tensor& w) { return upload(download(w), w.device(), DType::f32); };
    g.forward = [=](const Tensors& in) {
      Tensor out = empty_as(in[0], {t_count, c});
      ops::combine_rows(out, in[0], in[1], weight_f32(in[2]));
      return out;
    };
    g.backward = [=](const Tensors& in, const Tensor& dout) {
      const std::vector<int32_t> rows = ints(in[1]);
      const std::vector<double> wv = values(weight_f32(in[2]));
      std::vector<int32_t> token(static_cast<size_t>(n));
      std::vector<double> scale(static_cast<size_t>(n));
      for (int64_t p = 0; p < t_count * k; ++p) {
        token[size_t(rows[size_t(p)])] = int32_t(p / k);
        scale[size_t(rows[size_t(p)])] = wv[size_t(p)];
      }
      const Device d = in[0].device();
      Tensor dy = empty_as(in[0], {n, c});
      ops::gather_rows(dy, dout, i32_tensor({n}, token).to(d), f32_tensor({n}, scale).to(d));
      Tensor dweight = f32_as(in[0], {t_count, k});
      ops::combine_rows_weight_grad(dweight, dout, in[0], in[1]);
      return Tensors{dy, dweight};
    };
    check_gradients(GetParam(), g);
  }
}

TEST_P(MoeDispatch, ZeroSizedInputsDoNothing) {
  auto i32 = [&](const Shape& shape) { return Tensor::zeros(shape, DType::i32, device()); };
  Tensor x = up(random_tensor({6, 8}, 1));
  ops::gather_rows(empty({0, 8}), x, i32({0}), Tensor());
  ops::gather_rows(empty({0, 8}), x, i32({0}), zeros_f32({0}));
  ops::gather_rows(empty({0, 8}), empty({0, 8}), i32({0}), Tensor());
  ops::combine_rows(empty({0, 8}), x, i32({0, 2}), Tensor());
  ops::combine_rows(empty({0, 8}), empty({0, 8}), i32({0, 3}), zeros_f32({0, 3}));
  ops::combine_rows_weight_grad(zeros_f32({0, 2}), empty({0, 8}), x, i32({0, 2}));
}

TEST_P(MoeDispatch, BadArgumentsNameTheOp) {
  auto i32 = [&](const Shape& shape) { return Tensor::zeros(shape, DType::i32, device()); };
  const DType other = is_f32() ? DType::f16 : DType::f32;  // an activation dtype x is not
  Tensor x = zeros({6, 8}), index = i32({4}), out = zeros({4, 8});
  EXPECT_TRUE(raises([&] { ops::gather_rows(out, x, zeros_f32({4}), Tensor()); },
                     "gather_rows: index must be i32"));
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(zeros({4, 9}), x, index, Tensor());
      },
      "gather_rows: out"));
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(zeros({5, 8}), x, index, Tensor());
      },
      "gather_rows: out"));
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(Tensor::zeros({4, 8}, other, device()), x, index, Tensor());
      },
      "gather_rows: out"));
  EXPECT_TRUE(
      raises([&] { ops::gather_rows(out, x, index, zeros_f32({5})); }, "gather_rows: scale"));
  EXPECT_TRUE(
      raises([&] { ops::gather_rows(out, x, index, Tensor::zeros({4}, DType::bf16, device())); },
             "gather_rows: scale must be f32"));
  EXPECT_TRUE(
      raises([&] { ops::gather_rows(out, zeros({48}), index, Tensor()); }, "gather_rows: x"));
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(zeros({4, 2, 8}), x, i32({4, 2}), Tensor());
      },
      "gather_rows: index"));

  Tensor y = zeros({6, 8}), rows = i32({3, 2}), combined = zeros({3, 8});
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(combined, y, rows, zeros_f32({3, 3}));
      },
      "combine_rows: weight"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(combined, y, rows, Tensor::zeros({3, 2}, DType::bf16, device()));
      },
      "combine_rows: weight must be f32"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(zeros({2, 8}), y, rows, Tensor());
      },
      "combine_rows: out"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(zeros({3, 7}), y, rows, Tensor());
      },
      "combine_rows: out"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(combined, y, zeros_f32({3, 2}), Tensor());
      },
      "combine_rows: rows must be i32"));
  EXPECT_TRUE(
      raises([&] { ops::combine_rows(combined, y, i32({6}), Tensor()); }, "combine_rows: rows"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(Tensor::zeros({3, 8}, other, device()), y, rows, Tensor());
      },
      "combine_rows: out"));

  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows_weight_grad(zeros_f32({3, 3}), combined, y, rows);
      },
      "combine_rows_weight_grad: dweight"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows_weight_grad(Tensor::zeros({3, 2}, DType::bf16, device()), combined, y,
                                      rows);
      },
      "combine_rows_weight_grad: dweight must be f32"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows_weight_grad(zeros_f32({3, 2}), zeros({3, 7}), y, rows);
      },
      "combine_rows_weight_grad: dout"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows_weight_grad(zeros_f32({3, 2}), Tensor::zeros({3, 8}, other, device()), y,
                                      rows);
      },
      "combine_rows_weight_grad: dout"));
}

BRAID_KERNEL_TEST_SUITE(MoeDispatch);

// The CPU rejects row indices outside their tensor (CUDA reads zero rows instead, see moe.cu).
TEST(MoeCpu, OutOfRangeRowsAreErrors) {
  Tensor x = random_tensor({5, 4}, 1), out = Tensor::empty({2, 4}, DType::f32);
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(out, x, i32_tensor({2}, {0, 5}), Tensor());
      },
      "gather_rows: index[1] = 5"));
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(out, x, i32_tensor({2}, {-1, 0}), Tensor());
      },
      "gather_rows: index[0] = -1"));
  Tensor y = random_tensor({3, 4}, 2);
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(out, y, i32_tensor({2, 2}, {0, 1, 2, 3}), Tensor());
      },
      "combine_rows: rows[1, 1] = 3"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows_weight_grad(Tensor::empty({2, 2}, DType::f32), out, y,
                                      i32_tensor({2, 2}, {0, -2, 1, 2}));
      },
      "combine_rows_weight_grad: rows[0, 1] = -2"));
}

// The CPU computes activations in f32 only.
TEST(MoeCpu, Bf16IsNotSupported) {
  Tensor x = Tensor::empty({3, 4}, DType::bf16), index = i32_tensor({2}, {0, 1});
  EXPECT_TRUE(raises(
      [&] {
        ops::gather_rows(Tensor::empty({2, 4}, DType::bf16), x, index, Tensor());
      },
      "gather_rows: bf16 is not supported on cpu"));
  EXPECT_TRUE(raises(
      [&] {
        ops::combine_rows(Tensor::empty({1, 4}, DType::bf16), x, i32_tensor({1, 2}, {0, 1}),
                          Tensor());
      },
      "combine_rows: bf16 is not supported on cpu"));
}

// An empty sum (k = 0 choices, or rows of C = 0 columns) is zeros, as on CUDA.
TEST(MoeCpu, EmptySumsAreZeros) {
  auto all_zero = [](const Tensor& t) {
    const std::vector<double> got = values(t);
    return std::all_of(got.begin(), got.end(), [](double v) { return v == 0.0; });
  };
  Tensor out = filled({3, 4}, kNaN);
  ops::combine_rows(out, random_tensor({2, 4}, 1), Tensor::empty({3, 0}, DType::i32), Tensor());
  EXPECT_TRUE(all_zero(out)) << "combine_rows with k = 0";
  Tensor dweight = filled({3, 2}, kNaN);
  ops::combine_rows_weight_grad(dweight, Tensor::empty({3, 0}, DType::f32),
                                Tensor::empty({2, 0}, DType::f32),
                                Tensor::zeros({3, 2}, DType::i32));
  EXPECT_TRUE(all_zero(dweight)) << "combine_rows_weight_grad with C = 0";
}

}  // namespace
}  // namespace braid::testing
