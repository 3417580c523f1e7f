// Dropout: the mask follows the rule documented in ops.h exactly (so every device draws the
// same one), is reproducible from (seed, offset), differs across offsets and seeds, keeps
// about 1 - p of the elements, and backward applies the same mask.
#include <string>
#include <utility>
#include <vector>

#include "braid/core/philox.h"
#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class Dropout : public KernelTest {};

// ops.h: element i keeps iff uniform_from_word(word i % 4 of random_words(seed, offset, i / 4)) >
// p.
bool kept(uint64_t seed, uint64_t offset, int64_t i, float p) {
  philox::Words4 w = philox::random_words(seed, offset, uint64_t(i / 4));
  return philox::uniform_from_word(w.x[i % 4]) > p;
}

Tensor ones_plus(int64_t n) {  // nonzero inputs, so a zero output means "dropped"
  Tensor x = random_tensor({n}, 1);
  for (int64_t i = 0; i < n; ++i) x.data_ptr<float>()[i] = 1.0f + 0.5f * x.data_ptr<float>()[i];
  return x;
}

TEST_P(Dropout, FollowsTheDocumentedRule) {
  const int64_t n = 1001;  // not a multiple of 4: the last group is partial
  const float p = 0.3f;
  const uint64_t seed = 1234, offset = 77;
  Tensor x = ones_plus(n);
  Tensor out = empty({n});
  ops::dropout_forward(out, up(x), p, seed, offset);
  std::vector<double> xv = values(seen(x)), want;
  const float scale = 1.0f / (1.0f - p);
  for (int64_t i = 0; i < n; ++i) {
    want.push_back(kept(seed, offset, i, p) ? double(float(xv[size_t(i)]) * scale) : 0.0);
  }
  EXPECT_TRUE(all_close(out, want, tol({0, 0}, {0, 1e-2})));
}

TEST_P(Dropout, SameSeedAndOffsetGiveTheSameMaskOthersDiffer) {
  const int64_t n = 4096;
  const float p = 0.5f;
  Tensor x = up(ones_plus(n));
  auto mask = [&](uint64_t seed, uint64_t offset) {
    Tensor out = empty({n});
    ops::dropout_forward(out, x, p, seed, offset);
    std::vector<bool> m;
    for (double v : values(out)) m.push_back(v != 0.0);
    return m;
  };
  std::vector<bool> base = mask(7, 100);
  EXPECT_EQ(base, mask(7, 100));
  EXPECT_NE(base, mask(7, 101));
  EXPECT_NE(base, mask(8, 100));
  // Offsets far apart (the high word of the stream) differ too.
  EXPECT_NE(base, mask(7, 100 + (uint64_t(1) << 32)));
}

TEST_P(Dropout, KeepsAboutOneMinusP) {
  const int64_t n = 200000;
  Tensor x = up(ones_plus(n));
  for (float p : {0.1f, 0.5f, 0.9f}) {
    Tensor out = empty({n});
    ops::dropout_forward(out, x, p, 42, 3);
    int64_t kept_count = 0;
    for (double v : values(out)) kept_count += v != 0.0;
    // Binomial: standard deviation sqrt(n p (1 - p)) / n <= 0.0012; allow 5 of them.
    EXPECT_NEAR(double(kept_count) / double(n), 1.0 - p, 0.006) << "p " << p;
  }
}

TEST_P(Dropout, BackwardAppliesTheForwardMask) {
  const int64_t n = 777;
  const float p = 0.25f;
  Tensor x = ones_plus(n), dout = random_tensor({n}, 2);
  Tensor out = empty({n}), dx = empty({n});
  ops::dropout_forward(out, up(x), p, 5, 9);
  ops::dropout_backward(dx, up(dout), p, 5, 9);
  std::vector<double> o = values(out), g = values(seen(dout)), want;
  for (int64_t i = 0; i < n; ++i) {
    want.push_back(o[size_t(i)] != 0.0 ? double(float(g[size_t(i)]) * (1.0f / (1.0f - p))) : 0.0);
  }
  EXPECT_TRUE(all_close(dx, want, tol({0, 0}, {0, 1e-2})));
}

// A part that starts at flat element `first` of a larger tensor draws that tensor's mask there
// (how sequence-parallel shards and context-parallel chunks match the unsharded run), wherever
// it starts in a group of four and however short it is.
TEST_P(Dropout, PartsDrawTheirSliceOfTheWholeMask) {
  const int64_t n = 1000;
  const float p = 0.4f;
  Tensor x = ones_plus(n);
  Tensor whole = empty({n});
  ops::dropout_forward(whole, up(x), p, 11, 5);
  std::vector<double> xv = values(seen(x)), all = values(whole);
  const std::vector<std::pair<int64_t, int64_t>> parts = {
      {364, 400}, {2, 400}, {365, 399}, {367, 1}, {1, 2}, {998, 2}, {5, 3}};
  for (const auto& [first, width] : parts) {
    SCOPED_TRACE("first " + std::to_string(first) + " width " + std::to_string(width));
    Tensor part = Tensor::empty({width}, DType::f32);
    for (int64_t i = 0; i < width; ++i) part.data_ptr<float>()[i] = float(xv[size_t(first + i)]);
    Tensor out = empty({width});
    ops::dropout_forward(out, up(part), p, 11, 5, first);
    EXPECT_TRUE(all_close(
        out, std::vector<double>(all.begin() + first, all.begin() + first + width), {0, 0}));
    Tensor dx = empty({width});
    ops::dropout_backward(dx, up(part), p, 11, 5, first);
    EXPECT_TRUE(all_close(dx, values(out), {0, 0}));
  }
  Tensor out = empty({4});
  EXPECT_THROW(ops::dropout_forward(out, up(ones_plus(4)), p, 11, 5, -1), Error);
}

TEST_P(Dropout, ZeroKeepsEverythingOneDropsEverything) {
  Tensor x = random_tensor({3, 33}, 3);
  Tensor out = empty({3, 33});
  ops::dropout_forward(out, up(x), 0.0f, 1, 1);
  EXPECT_TRUE(all_close(out, values(seen(x)), {0, 0}));
  ops::dropout_forward(out, up(x), 1.0f, 1, 1);
  EXPECT_TRUE(all_close(out, std::vector<double>(99, 0.0), {0, 0}));
}

BRAID_KERNEL_TEST_SUITE(Dropout);

}  // namespace
}  // namespace braid::testing
