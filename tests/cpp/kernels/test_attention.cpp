// Causal attention with grouped-query heads: forward (out and log-sum-exp) against a double
// reference, backward against finite differences, over several S, D and head groupings.
#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class Attention : public KernelTest {};

struct AttnShape {
  int64_t b, s, hq, hkv, d;
};

std::ostream& operator<<(std::ostream& out, const AttnShape& a) {
  return out << "B " << a.b << " S " << a.s << " Hq " << a.hq << " Hkv " << a.hkv << " D " << a.d;
}

// out [B, S, Hq, D] followed by lse [B, Hq, S].
std::pair<std::vector<double>, std::vector<double>> attention_reference(
    const AttnShape& a, const std::vector<double>& q, const std::vector<double>& k,
    const std::vector<double>& v) {
  std::vector<double> out(size_t(a.b * a.s * a.hq * a.d)), lse(size_t(a.b * a.hq * a.s));
  const double scale = 1.0 / std::sqrt(double(a.d));
  for (int64_t b = 0; b < a.b; ++b) {
    for (int64_t h = 0; h < a.hq; ++h) {
      const int64_t kvh = h / (a.hq / a.hkv);
      for (int64_t i = 0; i < a.s; ++i) {
        std::vector<double> score(size_t(i + 1));
        double mx = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < a.d; ++d) {
            dot += q[size_t(((b * a.s + i) * a.hq + h) * a.d + d)] *
                   k[size_t(((b * a.s + j) * a.hkv + kvh) * a.d + d)];
          }
          score[size_t(j)] = dot * scale;
          mx = std::max(mx, score[size_t(j)]);
        }
        double sum = 0;
        for (double& sc : score) sum += std::exp(sc - mx);
        lse[size_t((b * a.hq + h) * a.s + i)] = mx + std::log(sum);
        for (int64_t d = 0; d < a.d; ++d) {
          double acc = 0;
          for (int64_t j = 0; j <= i; ++j) {
            acc += std::exp(score[size_t(j)] - mx) / sum *
                   v[size_t(((b * a.s + j) * a.hkv + kvh) * a.d + d)];
          }
          out[size_t(((b * a.s + i) * a.hq + h) * a.d + d)] = acc;
        }
      }
    }
  }
  return {out, lse};
}

TEST_P(Attention, ForwardMatchesReference) {
  const std::vector<AttnShape> shapes = {{2, 9, 4, 4, 8}, {2, 17, 4, 2, 16}, {1, 33, 4, 1, 8},
                                         {2, 1, 4, 2, 8}, {1, 70, 2, 1, 64}, {1, 5, 4, 2, 24}};
  int seed = 1;
  for (const AttnShape& a : shapes) {
    SCOPED_TRACE(::testing::Message() << a);
    Tensor q = random_tensor({a.b, a.s, a.hq, a.d}, seed++, 2.0f);
    Tensor k = random_tensor({a.b, a.s, a.hkv, a.d}, seed++, 2.0f);
    Tensor v = random_tensor({a.b, a.s, a.hkv, a.d}, seed++);
    Tensor out = empty({a.b, a.s, a.hq, a.d}), lse = empty_f32({a.b, a.hq, a.s});
    ops::attention_forward(out, lse, up(q), up(k), up(v));
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
  const std::vector<AttnShape> shapes = {
      {1, 9, 4, 2, 8}, {2, 6, 4, 1, 16}, {1, 13, 2, 2, 8}, {1, 5, 4, 4, 24}};
  int seed = 30;
  for (const AttnShape& a : shapes) {
    SCOPED_TRACE(::testing::Message() << a);
    GradCheck g;
    g.inputs = {random_tensor({a.b, a.s, a.hq, a.d}, seed++, 1.5f),
                random_tensor({a.b, a.s, a.hkv, a.d}, seed++, 1.5f),
                random_tensor({a.b, a.s, a.hkv, a.d}, seed++)};
    g.wrt = {0, 1, 2};
    g.samples = 32;
    g.forward = [a](const Tensors& in) {
      Tensor out = empty_as(in[0], {a.b, a.s, a.hq, a.d}), lse = f32_as(in[0], {a.b, a.hq, a.s});
      ops::attention_forward(out, lse, in[0], in[1], in[2]);
      return out;
    };
    g.backward = [a](const Tensors& in, const Tensor& dout) {
      Tensor out = empty_as(in[0], {a.b, a.s, a.hq, a.d}), lse = f32_as(in[0], {a.b, a.hq, a.s});
      ops::attention_forward(out, lse, in[0], in[1], in[2]);
      Tensor dq = empty_as(in[0], in[0].shape()), dk = empty_as(in[0], in[1].shape()),
             dv = empty_as(in[0], in[2].shape());
      ops::attention_backward(dq, dk, dv, dout, in[0], in[1], in[2], out, lse);
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

BRAID_KERNEL_TEST_SUITE(Attention);

}  // namespace
}  // namespace braid::testing
