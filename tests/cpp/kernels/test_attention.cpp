// Causal attention with grouped-query heads: forward (out and log-sum-exp) against a double
// reference, backward against finite differences, over several S, D and head groupings, with
// as many queries as keys and with fewer (the queries are the last positions), with and
// without a sliding window.
#include <limits>

#include "attention_reference.h"
#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class Attention : public KernelTest {};

// s key positions; the queries are the last `q_rows` of them (0: all s); window: the keys
// before its own each query sees (-1: all).
struct AttnShape {
  int64_t b, s, hq, hkv, d, q_rows = 0, window = -1;
  int64_t sq() const { return q_rows > 0 ? q_rows : s; }
};

std::ostream& operator<<(std::ostream& out, const AttnShape& a) {
  return out << "B " << a.b << " Sq " << a.sq() << " Sk " << a.s << " Hq " << a.hq << " Hkv "
             << a.hkv << " D " << a.d << " window " << a.window;
}

// out [B, Sq, Hq, D] followed by lse [B, Hq, Sq].
std::pair<std::vector<double>, std::vector<double>> attention_reference(
    const AttnShape& a, const std::vector<double>& q, const std::vector<double>& k,
    const std::vector<double>& v) {
  AttentionReference ref{a.b, a.sq(), a.s, a.hq, a.hkv, a.d};
  ref.first_key = [w = a.window](int64_t, int64_t p) {
    return w < 0 ? int64_t(0) : std::max<int64_t>(0, p - w);
  };
  return ref(q, k, v);
}

TEST_P(Attention, ForwardMatchesReference) {
  const std::vector<AttnShape> shapes = {
      {2, 9, 4, 4, 8},
      {2, 17, 4, 2, 16},
      {1, 33, 4, 1, 8},
      {2, 1, 4, 2, 8},
      {1, 70, 2, 1, 64},
      {1, 5, 4, 2, 24},
      {2, 40, 4, 2, 16, 9},
      {1, 33, 2, 1, 8, 1},
      {1, 70, 2, 2, 64, 35},
      // sliding windows: inside a 16-column chunk and a 32-key tile, across them, of 0 (each
      // query its own value), as long as the sequence (no effect), and with fewer queries
      {1, 70, 2, 1, 64, 0, 20},
      {2, 50, 4, 2, 16, 0, 5},
      {1, 33, 4, 1, 8, 0, 0},
      {1, 17, 2, 2, 8, 0, 16},
      {2, 40, 4, 2, 16, 9, 7},
      {1, 90, 2, 1, 32, 41, 33}};
  int seed = 1;
  for (const AttnShape& a : shapes) {
    SCOPED_TRACE(::testing::Message() << a);
    Tensor q = random_tensor({a.b, a.sq(), a.hq, a.d}, seed++, 2.0f);
    Tensor k = random_tensor({a.b, a.s, a.hkv, a.d}, seed++, 2.0f);
    Tensor v = random_tensor({a.b, a.s, a.hkv, a.d}, seed++);
    Tensor out = empty({a.b, a.sq(), a.hq, a.d}), lse = empty_f32({a.b, a.hq, a.sq()});
    ops::attention_forward(out, lse, up(q), up(k), up(v), a.window);
    auto [want_out, want_lse] =
        attention_reference(a, values(seen(q)), values(seen(k)), values(seen(v)));
    EXPECT_TRUE(all_close(out, want_out, tol({2e-5, 1e-4})));
    EXPECT_TRUE(all_close(lse, want_lse, tol({2e-5, 1e-5}, {2e-2, 1e-2})));
  }
}

TEST_P(Attention, FirstRowCopiesTheFirstValue) {
  // Causality: position 0 sees only key 0, so out[0] = v[0] whatever the scores.
  Tensor q = random_tensor({1, 4, 2, 8}, 20, 5.0f), k = random_tensor({1, 4, 1, 8}, 21, 5.0f);
  Tensor v = random_tensor({1, 4, 1, 8}, 22);
  Tensor out = empty({1, 4, 2, 8}), lse = empty_f32({1, 2, 4});
  ops::attention_forward(out, lse, up(q), up(k), up(v));
  std::vector<double> o = values(out), vv = values(seen(v));
  for (int64_t h = 0; h < 2; ++h) {
    std::vector<double> row(o.begin() + h * 8, o.begin() + h * 8 + 8);
    EXPECT_TRUE(all_close(row, std::vector<double>(vv.begin(), vv.begin() + 8), tol({1e-6, 1e-6})));
  }
}

TEST_P(Attention, BackwardMatchesFiniteDifferences) {
  const std::vector<AttnShape> shapes = {{1, 9, 4, 2, 8},         {2, 6, 4, 1, 16},
                                         {1, 13, 2, 2, 8},        {1, 5, 4, 4, 24},
                                         {2, 13, 4, 2, 8, 5},     {1, 37, 2, 1, 16, 6},
                                         {1, 37, 2, 1, 16, 6, 4}, {2, 21, 4, 2, 8, 0, 3},
                                         {1, 40, 2, 2, 8, 0, 18}, {1, 9, 2, 1, 8, 0, 0}};
  int seed = 30;
  for (const AttnShape& a : shapes) {
    SCOPED_TRACE(::testing::Message() << a);
    GradCheck g;
    g.inputs = {random_tensor({a.b, a.sq(), a.hq, a.d}, seed++, 1.5f),
                random_tensor({a.b, a.s, a.hkv, a.d}, seed++, 1.5f),
                random_tensor({a.b, a.s, a.hkv, a.d}, seed++)};
    g.wrt = {0, 1, 2};
    g.samples = 32;
    g.forward = [a](const Tensors& in) {
      Tensor out = empty_as(in[0], {a.b, a.sq(), a.hq, a.d});
      Tensor lse = f32_as(in[0], {a.b, a.hq, a.sq()});
      ops::attention_forward(out, lse, in[0], in[1], in[2], a.window);
      return out;
    };
    g.backward = [a](const Tensors& in, const Tensor& dout) {
      Tensor out = empty_as(in[0], {a.b, a.sq(), a.hq, a.d});
      Tensor lse = f32_as(in[0], {a.b, a.hq, a.sq()});
      ops::attention_forward(out, lse, in[0], in[1], in[2], a.window);
      Tensor dq = empty_as(in[0], in[0].shape()), dk = empty_as(in[0], in[1].shape()),
             dv = empty_as(in[0], in[2].shape());
      ops::attention_backward(dq, dk, dv, dout, in[0], in[1], in[2], out, lse, a.window);
      return Tensors{dq, dk, dv};
    };
    g.step = 1e-2;
    g.f32_tol = {2e-3, 3e-3};
    check_gradients(GetParam(), g);
  }
}

TEST_P(Attention, GroupedHeadsEqualRepeatedKvHeads) {
  // GQA with Hkv = 1 equals plain attention with the kv head repeated for every query head,
  // and dK, dV are the sums over the repeated copies.
  const int64_t b = 1, s = 11, hq = 4, d = 8;
  Tensor q = random_tensor({b, s, hq, d}, 40), k = random_tensor({b, s, 1, d}, 41);
  Tensor v = random_tensor({b, s, 1, d}, 42), dout = random_tensor({b, s, hq, d}, 43);
  Tensor k4 = Tensor::empty({b, s, hq, d}, DType::f32),
         v4 = Tensor::empty({b, s, hq, d}, DType::f32);
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t h = 0; h < hq; ++h) {
      for (int64_t j = 0; j < d; ++j) {
        k4.data_ptr<float>()[(i * hq + h) * d + j] = k.data_ptr<float>()[i * d + j];
        v4.data_ptr<float>()[(i * hq + h) * d + j] = v.data_ptr<float>()[i * d + j];
      }
    }
  }
  auto run = [&](const Tensor& kk, const Tensor& vv, int64_t hkv) {
    Tensor out = empty({b, s, hq, d}), lse = empty_f32({b, hq, s});
    ops::attention_forward(out, lse, up(q), up(kk), up(vv));
    Tensor dq = empty({b, s, hq, d}), dk = empty({b, s, hkv, d}), dv = empty({b, s, hkv, d});
    ops::attention_backward(dq, dk, dv, up(dout), up(q), up(kk), up(vv), out, lse);
    return Tensors{out, dq, dk, dv};
  };
  Tensors gqa = run(k, v, 1), mha = run(k4, v4, hq);
  EXPECT_TRUE(all_close(gqa[0], values(mha[0]), tol({1e-6, 1e-5})));
  EXPECT_TRUE(all_close(gqa[1], values(mha[1]), tol({1e-6, 1e-5})));
  for (int which : {2, 3}) {
    std::vector<double> rep = values(mha[size_t(which)]), summed(size_t(s * d), 0.0);
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t h = 0; h < hq; ++h) {
        for (int64_t j = 0; j < d; ++j)
          summed[size_t(i * d + j)] += rep[size_t((i * hq + h) * d + j)];
      }
    }
    EXPECT_TRUE(all_close(gqa[size_t(which)], summed, tol({1e-5, 1e-5}, {3e-2, 2e-2})));
  }
}

TEST_P(Attention, TrailingQueriesEqualTheLastRowsOfTheWholeAttention) {
  // The last Sq queries against all Sk keys give the last Sq rows of the whole (Sq = Sk)
  // attention; backward with the output gradient zero on the other rows, its dq's last rows
  // and all of its dk and dv. Context parallelism computes its chunks this way.
  const int64_t b = 2, s = 45, sq = 13, hq = 4, hkv = 2, d = 16, first = s - sq;
  Tensor q = random_tensor({b, s, hq, d}, 60, 2.0f), k = random_tensor({b, s, hkv, d}, 61, 2.0f);
  Tensor v = random_tensor({b, s, hkv, d}, 62), dout = random_tensor({b, s, hq, d}, 63);
  // The trailing rows of a [B, S, ...] tensor as [B, sq, ...], and the whole with the leading
  // rows zeroed.
  auto trailing = [&](const Tensor& t) {
    const int64_t row = t.numel() / (b * s);
    Tensor out = Tensor::zeros({b, sq, t.size(2), t.size(3)}, DType::f32);
    for (int64_t i = 0; i < b; ++i)
      out.slice(i * sq * row, {sq * row}).copy_from(t.slice((i * s + first) * row, {sq * row}));
    return out;
  };
  Tensor dout_tail = trailing(dout);
  Tensor dout_masked = Tensor::zeros(dout.shape(), DType::f32);
  const int64_t row = hq * d;
  for (int64_t i = 0; i < b; ++i) {
    dout_masked.slice((i * s + first) * row, {sq * row})
        .copy_from(dout.slice((i * s + first) * row, {sq * row}));
  }
  Tensor out = empty({b, s, hq, d}), lse = empty_f32({b, hq, s});
  ops::attention_forward(out, lse, up(q), up(k), up(v));
  Tensor dq = empty({b, s, hq, d}), dk = empty({b, s, hkv, d}), dv = empty({b, s, hkv, d});
  ops::attention_backward(dq, dk, dv, up(dout_masked), up(q), up(k), up(v), out, lse);

  Tensor q_tail = trailing(q);
  Tensor out_t = empty({b, sq, hq, d}), lse_t = empty_f32({b, hq, sq});
  ops::attention_forward(out_t, lse_t, up(q_tail), up(k), up(v));
  Tensor dq_t = empty({b, sq, hq, d}), dk_t = empty({b, s, hkv, d}), dv_t = empty({b, s, hkv, d});
  ops::attention_backward(dq_t, dk_t, dv_t, up(dout_tail), up(q_tail), up(k), up(v), out_t, lse_t);

  const Tolerance t = tol({1e-6, 1e-5}, {2e-2, 2e-2});
  EXPECT_TRUE(all_close(out_t, values(trailing(download(out))), t));
  std::vector<double> lse_want;
  const std::vector<double> lse_all = values(lse);
  for (int64_t i = 0; i < b * hq; ++i)
    lse_want.insert(lse_want.end(), lse_all.begin() + i * s + first, lse_all.begin() + (i + 1) * s);
  EXPECT_TRUE(all_close(lse_t, lse_want, t));
  EXPECT_TRUE(all_close(dq_t, values(trailing(download(dq))), tol({1e-5, 1e-4}, {3e-2, 2e-2})));
  EXPECT_TRUE(all_close(dk_t, values(dk), tol({1e-5, 1e-4}, {3e-2, 2e-2})));
  EXPECT_TRUE(all_close(dv_t, values(dv), tol({1e-5, 1e-4}, {3e-2, 2e-2})));
}

TEST_P(Attention, WindowedQueriesEqualTheirWindowAttendedAlone) {
  // Windowed attention at query i equals whole (causal) attention over the window's keys alone,
  // with i the last of them; and a window as long as the sequence, or longer, changes nothing:
  // it is no window, bit for bit.
  const int64_t b = 1, s = 41, hq = 2, hkv = 1, d = 16, window = 9;
  Tensor q = random_tensor({b, s, hq, d}, 80, 2.0f), k = random_tensor({b, s, hkv, d}, 81, 2.0f);
  Tensor v = random_tensor({b, s, hkv, d}, 82);
  Tensor out = empty({b, s, hq, d}), lse = empty_f32({b, hq, s});
  ops::attention_forward(out, lse, up(q), up(k), up(v), window);
  const std::vector<double> all = values(out);
  for (int64_t i : {int64_t(0), window - 1, window, window + 1, s - 1}) {
    SCOPED_TRACE(::testing::Message() << "query " << i);
    const int64_t first = std::max<int64_t>(0, i - window), n = i - first + 1;
    auto rows = [&](const Tensor& t, int64_t from, int64_t count) {
      const int64_t width = t.numel() / s;
      return up(t.slice(from * width, {1, count, t.size(2), d}));
    };
    Tensor out_i = empty({1, 1, hq, d}), lse_i = empty_f32({1, hq, 1});
    ops::attention_forward(out_i, lse_i, rows(q, i, 1), rows(k, first, n), rows(v, first, n));
    const std::vector<double> want(all.begin() + i * hq * d, all.begin() + (i + 1) * hq * d);
    EXPECT_TRUE(all_close(out_i, want, tol({1e-6, 1e-5}, {1e-2, 1e-2})));
  }
  Tensor out_none = empty({b, s, hq, d}), lse_none = empty_f32({b, hq, s});
  ops::attention_forward(out_none, lse_none, up(q), up(k), up(v));
  // As long as the sequence, longer, and as long as int64 allows ("infinite"): no window.
  for (int64_t long_window : {s - 1, s + 100, std::numeric_limits<int64_t>::max()}) {
    SCOPED_TRACE(::testing::Message() << "window " << long_window);
    Tensor out_long = empty({b, s, hq, d}), lse_long = empty_f32({b, hq, s});
    ops::attention_forward(out_long, lse_long, up(q), up(k), up(v), long_window);
    EXPECT_EQ(values(out_long), values(out_none));
    EXPECT_EQ(values(lse_long), values(lse_none));
    Tensor dq = empty({b, s, hq, d}), dk = empty({b, s, hkv, d}), dv = empty({b, s, hkv, d});
    Tensor dq_none = empty({b, s, hq, d}), dk_none = empty({b, s, hkv, d}),
           dv_none = empty({b, s, hkv, d});
    ops::attention_backward(dq, dk, dv, up(q), up(q), up(k), up(v), out_long, lse_long,
                            long_window);
    ops::attention_backward(dq_none, dk_none, dv_none, up(q), up(q), up(k), up(v), out_none,
                            lse_none);
    EXPECT_EQ(values(dk), values(dk_none));
    EXPECT_EQ(values(dv), values(dv_none));
  }
}

TEST_P(Attention, MoreQueriesThanKeysIsAnError) {
  Tensor q = random_tensor({1, 6, 2, 8}, 70), k = random_tensor({1, 5, 2, 8}, 71);
  Tensor out = empty({1, 6, 2, 8}), lse = empty_f32({1, 2, 6});
  EXPECT_THROW(ops::attention_forward(out, lse, up(q), up(k), up(k)), Error);
}

TEST_P(Attention, WindowBelowMinusOneIsAnError) {
  Tensor q = random_tensor({1, 5, 2, 8}, 72);
  Tensor out = empty({1, 5, 2, 8}), lse = empty_f32({1, 2, 5});
  EXPECT_THROW(ops::attention_forward(out, lse, up(q), up(q), up(q), -2), Error);
}

BRAID_KERNEL_TEST_SUITE(Attention);

}  // namespace
}  // namespace braid::testing
