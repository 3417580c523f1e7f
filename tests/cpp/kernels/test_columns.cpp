// Column copies (multi-latent attention): copy_columns, broadcast_heads and its backward
// sum_heads, against reference loops; the columns they do not write stay as they were.
#include <tuple>

#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class Columns : public KernelTest {
 protected:
  // The other activation dtype of this device's cases (for dtype mismatches).
  DType other_dtype() const { return is_f32() ? DType::bf16 : DType::f32; }
};

TEST_P(Columns, CopyColumnsMovesOneBlock) {
  const int64_t rows = 5, cd = 7, cs = 9;
  Tensor src = random_tensor({rows, cs}, 1), dst0 = random_tensor({rows, cd}, 2);
  const std::vector<double> sv = values(seen(src)), dv = values(seen(dst0));
  for (auto [dst_column, src_column, width] :
       {std::tuple<int64_t, int64_t, int64_t>{2, 3, 4}, {0, 0, 7}, {6, 8, 1}, {3, 5, 0}}) {
    Tensor dst = up(dst0);
    ops::copy_columns(dst, dst_column, up(src), src_column, width);
    std::vector<double> want = dv;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < width; ++j) {
        want[size_t(r * cd + dst_column + j)] = sv[size_t(r * cs + src_column + j)];
      }
    }
    EXPECT_TRUE(all_close(dst, want, {0, 0})) << dst_column << ", " << src_column << ", " << width;
  }
}

TEST_P(Columns, BroadcastHeadsWritesEveryHead) {
  const int64_t rows = 4, h = 3, d = 10, w = 3, column = 6;
  Tensor x = random_tensor({rows, w}, 3), out0 = random_tensor({rows, h, d}, 4);
  Tensor out = up(out0);
  ops::broadcast_heads(out, column, up(x));
  const std::vector<double> xv = values(seen(x));
  std::vector<double> want = values(seen(out0));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t head = 0; head < h; ++head) {
      for (int64_t j = 0; j < w; ++j) {
        want[size_t((r * h + head) * d + column + j)] = xv[size_t(r * w + j)];
      }
    }
  }
  EXPECT_TRUE(all_close(out, want, {0, 0}));
}

TEST_P(Columns, SumHeadsAddsHeadsInOrderRoundedOnce) {
  const int64_t rows = 6, h = 5, d = 12, w = 4, column = 7;
  Tensor dout = random_tensor({rows, h, d}, 5);
  Tensor dx = up(random_tensor({rows, w}, 6));  // overwritten
  ops::sum_heads(dx, up(dout), column);
  const std::vector<double> g = values(seen(dout));
  Tensor want = Tensor::empty({rows, w}, DType::f32);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < w; ++j) {
      float sum = 0.0f;  // f32, head after head
      for (int64_t head = 0; head < h; ++head) {
        sum += float(g[size_t((r * h + head) * d + column + j)]);
      }
      want.data_ptr<float>()[r * w + j] = sum;
    }
  }
  EXPECT_TRUE(all_close(dx, values(seen(want)), {0, 0}));
}

TEST_P(Columns, SumHeadsIsTheTransposeOfBroadcastHeads) {
  // <broadcast(x), y> = <x, sum(y)>, with the channels broadcast_heads does not write zero.
  const int64_t rows = 7, h = 4, d = 9, w = 5, column = 3;
  Tensor x = up(random_tensor({rows, w}, 7)), y = up(random_tensor({rows, h, d}, 8));
  Tensor bx = zeros({rows, h, d}), sy = empty({rows, w});
  ops::broadcast_heads(bx, column, x);
  ops::sum_heads(sy, y, column);
  const std::vector<double> bxv = values(bx), yv = values(y), xv = values(x), syv = values(sy);
  double lhs = 0.0, rhs = 0.0;
  for (size_t i = 0; i < bxv.size(); ++i) lhs += bxv[i] * yv[i];
  for (size_t i = 0; i < xv.size(); ++i) rhs += xv[i] * syv[i];
  EXPECT_NEAR(lhs, rhs, is_f32() ? 1e-5 : 5e-2) << "lhs " << lhs << ", rhs " << rhs;
}

TEST_P(Columns, NoHeadsSumToZero) {
  Tensor dx = up(random_tensor({3, 2}, 9));
  ops::sum_heads(dx, empty({3, 0, 8}), 1);
  EXPECT_TRUE(all_close(dx, std::vector<double>(6, 0.0), {0, 0}));
}

TEST_P(Columns, ZeroSizedCopiesDoNothing) {
  Tensor dst = up(random_tensor({2, 4}, 10));
  const std::vector<double> before = values(dst);
  ops::copy_columns(dst, 4, empty({2, 3}), 3, 0);
  ops::copy_columns(empty({0, 4}), 1, empty({0, 3}), 0, 3);
  ops::broadcast_heads(empty({0, 2, 4}), 1, empty({0, 3}));
  ops::broadcast_heads(empty({2, 0, 4}), 1, empty({2, 3}));
  ops::broadcast_heads(empty({2, 3, 4}), 4, empty({2, 0}));
  ops::sum_heads(empty({0, 3}), empty({0, 2, 4}), 1);
  EXPECT_TRUE(all_close(dst, before, {0, 0}));
}

TEST_P(Columns, BadArgumentsNameTheOp) {
  Tensor dst = empty({4, 8}), src = empty({4, 6});
  EXPECT_TRUE(raises([&] { ops::copy_columns(dst, 5, src, 0, 4); },
                     "copy_columns: dst_column 5 with width 4 is outside [0, 8)"));
  EXPECT_TRUE(raises([&] { ops::copy_columns(dst, 0, src, 3, 4); },
                     "copy_columns: src_column 3 with width 4 is outside [0, 6)"));
  EXPECT_TRUE(
      raises([&] { ops::copy_columns(dst, -1, src, 0, 2); }, "copy_columns: dst_column -1"));
  EXPECT_TRUE(
      raises([&] { ops::copy_columns(dst, 0, src, 0, -1); }, "copy_columns: width -1 must not"));
  EXPECT_TRUE(raises([&] { ops::copy_columns(dst, 0, empty({3, 6}), 0, 2); }, "disagree on R"));
  EXPECT_TRUE(raises([&] { ops::copy_columns(empty({4, 2, 4}), 0, src, 0, 2); }, "must be [R, C]"));
  EXPECT_TRUE(raises(
      [&] {
        ops::copy_columns(Tensor::empty({4, 8}, other_dtype(), device()), 0, src, 0, 2);
      },
      "copy_columns: dst is"));

  Tensor out = empty({4, 3, 10}), x = empty({4, 3});
  EXPECT_TRUE(raises([&] { ops::broadcast_heads(out, 8, x); },
                     "broadcast_heads: column 8 with width 3 is outside [0, 10)"));
  EXPECT_TRUE(raises([&] { ops::broadcast_heads(out, -1, x); }, "broadcast_heads: column -1"));
  EXPECT_TRUE(raises(
      [&] {
        ops::broadcast_heads(out, 0, empty({5, 3}));
      },
      "broadcast_heads: out"));  // rows
  EXPECT_TRUE(raises([&] { ops::broadcast_heads(empty({4, 30}), 0, x); }, "must be [R, H, D]"));
  EXPECT_TRUE(raises(
      [&] {
        ops::broadcast_heads(out, 0, Tensor::empty({4, 3}, other_dtype(), device()));
      },
      "broadcast_heads"));

  EXPECT_TRUE(raises([&] { ops::sum_heads(x, out, 8); },
                     "sum_heads: column 8 with width 3 is outside [0, 10)"));
  EXPECT_TRUE(raises([&] { ops::sum_heads(empty({2, 3}), out, 0); }, "disagree on R"));
  EXPECT_TRUE(raises([&] { ops::sum_heads(x, empty({4, 30}), 0); }, "must be [R, H, D]"));
  EXPECT_TRUE(raises(
      [&] {
        ops::sum_heads(x, Tensor::empty({4, 3, 10}, other_dtype(), device()), 0);
      },
      "sum_heads: dout is"));
}

BRAID_KERNEL_TEST_SUITE(Columns);

}  // namespace
}  // namespace braid::testing
