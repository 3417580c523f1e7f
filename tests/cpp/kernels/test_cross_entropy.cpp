// Cross-entropy: partials, loss and gradient against double references; ignored targets;
// a vocabulary split in two slices, combined by hand, gives the full loss and gradient.
#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class CrossEntropy : public KernelTest {};

constexpr int64_t kT = 7, kV = 53;
const std::vector<int32_t> kTargets = {3, -1, 52, 0, 17, -100, 30};  // two ignored

Tensor targets_tensor() {
  Tensor t = Tensor::empty({kT}, DType::i32);
  std::copy(kTargets.begin(), kTargets.end(), t.data_ptr<int32_t>());
  return t;
}

Tensor logits_tensor(uint64_t seed) {
  Tensor x = random_tensor({kT, kV}, seed, 4.0f);
  x.data_ptr<float>()[2 * kV + 5] = 30.0f;  // a dominant logit: exp overflows without the max
  return x;
}

struct Reference {
  std::vector<double> loss, dlogits;
};

Reference reference(const std::vector<double>& x, const std::vector<double>& dloss) {
  Reference r;
  for (int64_t t = 0; t < kT; ++t) {
    double mx = -1e300, sum = 0;
    for (int64_t j = 0; j < kV; ++j) mx = std::max(mx, x[size_t(t * kV + j)]);
    for (int64_t j = 0; j < kV; ++j) sum += std::exp(x[size_t(t * kV + j)] - mx);
    const int32_t tg = kTargets[size_t(t)];
    r.loss.push_back(tg < 0 ? 0.0 : std::log(sum) + mx - x[size_t(t * kV + tg)]);
    for (int64_t j = 0; j < kV; ++j) {
      double p = std::exp(x[size_t(t * kV + j)] - mx) / sum;
      r.dlogits.push_back(tg < 0 ? 0.0 : dloss[size_t(t)] * (p - (j == tg ? 1.0 : 0.0)));
    }
  }
  return r;
}

TEST_P(CrossEntropy, LossAndGradientMatchReference) {
  Tensor x = logits_tensor(1), dloss = random_tensor({kT}, 2);
  Tensor logits = up(x), targets = up(targets_tensor());
  Tensor mx = empty_f32({kT}), se = empty_f32({kT}), tl = empty_f32({kT}), loss = empty_f32({kT});
  ops::cross_entropy_partials(mx, se, tl, logits, targets);
  ops::cross_entropy_loss(loss, mx, se, tl, targets);
  Reference want = reference(values(seen(x)), values(dloss));
  EXPECT_TRUE(all_close(loss, want.loss, {2e-5, 1e-5}));
  // The max is one of the logits, exactly; the target logit too (0 where ignored).
  std::vector<double> xv = values(seen(x)), mv = values(mx), tv = values(tl);
  for (int64_t t = 0; t < kT; ++t) {
    double row_max = *std::max_element(xv.begin() + t * kV, xv.begin() + (t + 1) * kV);
    EXPECT_EQ(mv[size_t(t)], row_max) << "row " << t;
    int32_t tg = kTargets[size_t(t)];
    EXPECT_EQ(tv[size_t(t)], tg < 0 ? 0.0 : xv[size_t(t * kV + tg)]) << "row " << t;
  }
  Tensor dlogits = empty({kT, kV});
  ops::cross_entropy_backward(dlogits, logits, targets, mx, se, up_f32(dloss));
  EXPECT_TRUE(all_close(dlogits, want.dlogits, tol({1e-6, 1e-5}, {2e-3, 1e-2})));
  // In place: dlogits aliases logits.
  ops::cross_entropy_backward(logits, logits, targets, mx, se, up_f32(dloss));
  EXPECT_TRUE(all_close(logits, want.dlogits, tol({1e-6, 1e-5}, {2e-3, 1e-2})));
}

TEST_P(CrossEntropy, GradientMatchesFiniteDifferences) {
  GradCheck g;
  g.inputs = {random_tensor({kT, kV}, 3, 3.0f), targets_tensor()};
  g.wrt = {0};
  g.samples = 64;
  g.forward = [](const Tensors& in) {
    Tensor mx = f32_as(in[0], {kT}), se = f32_as(in[0], {kT}), tl = f32_as(in[0], {kT}),
           loss = f32_as(in[0], {kT});
    ops::cross_entropy_partials(mx, se, tl, in[0], in[1]);
    ops::cross_entropy_loss(loss, mx, se, tl, in[1]);
    return loss;
  };
  g.backward = [](const Tensors& in, const Tensor& dloss) {
    Tensor mx = f32_as(in[0], {kT}), se = f32_as(in[0], {kT}), tl = f32_as(in[0], {kT});
    ops::cross_entropy_partials(mx, se, tl, in[0], in[1]);
    Tensor d32 = upload(download(dloss), in[0].device(), DType::f32);  // dloss is always f32
    Tensor dlogits = empty_as(in[0], in[0].shape());
    ops::cross_entropy_backward(dlogits, in[0], in[1], mx, se, d32);
    return Tensors{dlogits};
  };
  g.step = 1e-2;
  g.f32_tol = {1e-3, 2e-3};
  check_gradients(GetParam(), g);
}

TEST_P(CrossEntropy, VocabSlicesCombineToTheFullLossAndGradient) {
  const int64_t split = 20;  // rank 0 owns [0, 20), rank 1 owns [20, 53)
  Tensor x = logits_tensor(4), dloss = random_tensor({kT}, 5);
  Reference want = reference(values(seen(x)), values(dloss));
  Tensor targets = up(targets_tensor());
  std::vector<double> xv = values(seen(x));
  struct Slice {
    int64_t begin, width;
    Tensor logits, mx, se, tl;
  };
  std::vector<Slice> slices = {{0, split, {}, {}, {}, {}}, {split, kV - split, {}, {}, {}, {}}};
  for (Slice& s : slices) {
    Tensor part = Tensor::empty({kT, s.width}, DType::f32);
    for (int64_t t = 0; t < kT; ++t) {
      for (int64_t j = 0; j < s.width; ++j) {
        part.data_ptr<float>()[t * s.width + j] = float(xv[size_t(t * kV + s.begin + j)]);
      }
    }
    s.logits = up(part);
    s.mx = empty_f32({kT});
    s.se = empty_f32({kT});
    s.tl = empty_f32({kT});
    ops::cross_entropy_partials(s.mx, s.se, s.tl, s.logits, targets, s.begin);
  }
  // What the vocab-parallel loss does with all-reduces: the global max, each slice's sum
  // re-based on it (cross_entropy_rescale), summed, and the target logit from whichever slice
  // holds it (the others contribute 0).
  Tensor mx = Tensor::empty({kT}, DType::f32), se = Tensor::empty({kT}, DType::f32);
  Tensor tl = Tensor::empty({kT}, DType::f32);
  std::vector<double> m0 = values(slices[0].mx), m1 = values(slices[1].mx);
  for (int64_t t = 0; t < kT; ++t)
    mx.data_ptr<float>()[t] = float(std::max(m0[size_t(t)], m1[size_t(t)]));
  for (Slice& s : slices) ops::cross_entropy_rescale(s.se, s.mx, up_f32(mx));
  std::vector<double> s0 = values(slices[0].se), s1 = values(slices[1].se);
  std::vector<double> t0 = values(slices[0].tl), t1 = values(slices[1].tl);
  for (int64_t t = 0; t < kT; ++t) {
    se.data_ptr<float>()[t] = float(s0[size_t(t)] + s1[size_t(t)]);
    tl.data_ptr<float>()[t] = float(t0[size_t(t)] + t1[size_t(t)]);
  }
  Tensor loss = empty_f32({kT});
  ops::cross_entropy_loss(loss, up_f32(mx), up_f32(se), up_f32(tl), targets);
  EXPECT_TRUE(all_close(loss, want.loss, {2e-5, 1e-5}));
  std::vector<double> grad(size_t(kT * kV));
  for (Slice& s : slices) {
    Tensor d = empty({kT, s.width});
    ops::cross_entropy_backward(d, s.logits, targets, up_f32(mx), up_f32(se), up_f32(dloss),
                                s.begin);
    std::vector<double> dv = values(d);
    for (int64_t t = 0; t < kT; ++t) {
      for (int64_t j = 0; j < s.width; ++j) {
        grad[size_t(t * kV + s.begin + j)] = dv[size_t(t * s.width + j)];
      }
    }
  }
  EXPECT_TRUE(all_close(grad, want.dlogits, tol({1e-6, 1e-5}, {2e-3, 1e-2})));
}

TEST_P(CrossEntropy, LongRowsAcrossChunks) {
  // A row longer than the CPU's chunk, with its max in the last chunk: the running sum must be
  // rescaled when the max grows.
  const int64_t v = 5000;
  Tensor x = random_tensor({2, v}, 6, 2.0f);
  x.data_ptr<float>()[v - 3] = 12.0f;
  x.data_ptr<float>()[v + 1] = 9.0f;
  Tensor targets = Tensor::empty({2}, DType::i32);
  targets.data_ptr<int32_t>()[0] = int32_t(v - 1);
  targets.data_ptr<int32_t>()[1] = 4000;
  Tensor mx = empty_f32({2}), se = empty_f32({2}), tl = empty_f32({2}), loss = empty_f32({2});
  ops::cross_entropy_partials(mx, se, tl, up(x), up(targets));
  ops::cross_entropy_loss(loss, mx, se, tl, up(targets));
  std::vector<double> xv = values(seen(x)), want;
  for (int64_t t = 0; t < 2; ++t) {
    double m = *std::max_element(xv.begin() + t * v, xv.begin() + (t + 1) * v), sum = 0;
    for (int64_t j = 0; j < v; ++j) sum += std::exp(xv[size_t(t * v + j)] - m);
    want.push_back(std::log(sum) + m - xv[size_t(t * v + targets.data_ptr<int32_t>()[t])]);
  }
  EXPECT_TRUE(all_close(loss, want, {1e-4, 1e-5}));
}

BRAID_KERNEL_TEST_SUITE(CrossEntropy);

}  // namespace
}  // namespace braid::testing
