// Token embedding (vocab-parallel slices) and rotary position embedding (HF rotate_half, and
// interleaved pairs from a channel offset: multi-latent attention).
#include <numbers>
#include <tuple>

#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class EmbeddingRope : public KernelTest {
 protected:
  // rope_forward out of place of x [b, s, h, d] and rope_backward in place and out of place,
  // against the reference with frequencies f; returns the forward's output.
  Tensor check_rope(const ops::RotaryFrequencies& rotary, const std::vector<double>& f, int64_t b,
                    int64_t s, int64_t h, int64_t d, int64_t offset, uint64_t seed) const;
};

Tensor ids_tensor(const Shape& shape, const std::vector<int32_t>& ids) {
  Tensor t = Tensor::empty(shape, DType::i32);
  std::copy(ids.begin(), ids.end(), t.data_ptr<int32_t>());
  return t;
}

TEST_P(EmbeddingRope, EmbeddingForwardReadsOwnSliceOnly) {
  const int64_t v = 5, c = 12, offset = 3;  // this rank owns ids [3, 8)
  const std::vector<int32_t> ids = {3, 7, 0, 5, 8, 3};
  Tensor w = random_tensor({v, c}, 1);
  Tensor out = empty({2, 3, c});
  ops::embedding_forward(out, up(ids_tensor({2, 3}, ids)), up(w), offset);
  std::vector<double> wv = values(seen(w)), want;
  for (int32_t id : ids) {
    for (int64_t j = 0; j < c; ++j) {
      bool mine = id >= offset && id < offset + v;
      want.push_back(mine ? wv[size_t((id - offset) * c + j)] : 0.0);
    }
  }
  EXPECT_TRUE(all_close(out, want, {0, 0}));
}

TEST_P(EmbeddingRope, EmbeddingBackwardAddsRowsOfRepeatedIds) {
  const int64_t v = 6, c = 70;
  const std::vector<int32_t> ids = {2, 2, 0, 5, 9, 2, -1, 5};  // 9 and -1: not this slice
  Tensor dout = random_tensor({8, c}, 2), dw0 = random_tensor({v, c}, 3);
  Tensor dw = up_f32(dw0);
  ops::embedding_backward(dw, up(dout), up(ids_tensor({8}, ids)));
  std::vector<double> g = values(seen(dout)), want = values(dw0);
  for (size_t t = 0; t < ids.size(); ++t) {
    if (ids[t] < 0 || ids[t] >= v) continue;
    for (int64_t j = 0; j < c; ++j) want[size_t(ids[t] * c + j)] += g[t * c + size_t(j)];
  }
  EXPECT_TRUE(all_close(dw, want, tol({1e-6, 1e-6}, {1e-2, 1e-2})));
}

TEST_P(EmbeddingRope, EmbeddingBackwardMatchesFiniteDifferences) {
  GradCheck g;
  g.inputs = {ids_tensor({2, 4}, {1, 3, 3, 0, 6, 3, 1, 2}), random_tensor({5, 6}, 7)};
  g.wrt = {1};  // with vocab_offset 1: id 0 and id 6 belong to other ranks
  g.samples = 30;
  g.forward = [](const Tensors& in) {
    Tensor out = empty_as(in[1], {2, 4, 6});
    ops::embedding_forward(out, in[0], in[1], 1);
    return out;
  };
  g.backward = [](const Tensors& in, const Tensor& dout) {
    Tensor dw = zeros_f32_as(in[1], {5, 6});
    ops::embedding_backward(dw, dout, in[0], 1);
    return Tensors{dw};
  };
  g.f32_tol = {1e-3, 1e-3};
  check_gradients(GetParam(), g);
}

// HF Llama: inv_freq[i] = theta^(-2i/R); out[i] = x[i] cos - x[i + R/2] sin,
// out[i + R/2] = x[i + R/2] cos + x[i] sin, angle = position * inv_freq[i], R = 2 x the
// frequencies (D, or fewer with partial rotary: HF StableLM's, whose other channels pass).
// From channel `first` on, and with interleaved pairs (2i, 2i + 1) in place of (i, i + R/2):
// DeepSeek-V2/V3's complex product (x[2i] + i x[2i + 1]) e^(i angle).
std::vector<double> rope_reference(const std::vector<double>& x, int64_t b, int64_t s, int64_t h,
                                   int64_t d, const std::vector<double>& inv_freq, int64_t offset,
                                   double sign, int64_t first = 0, bool interleaved = false) {
  std::vector<double> out(x);
  const auto half = int64_t(inv_freq.size());
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t si = 0; si < s; ++si) {
      for (int64_t hi = 0; hi < h; ++hi) {
        size_t at = size_t(((bi * s + si) * h + hi) * d + first);
        for (int64_t i = 0; i < half; ++i) {
          double angle = double(offset + si) * inv_freq[size_t(i)];
          double c = std::cos(angle), sn = sign * std::sin(angle);
          size_t p1 = at + size_t(interleaved ? 2 * i : i);
          size_t p2 = p1 + size_t(interleaved ? 1 : half);
          double x1 = x[p1], x2 = x[p2];
          out[p1] = x1 * c - x2 * sn;
          out[p2] = x2 * c + x1 * sn;
        }
      }
    }
  }
  return out;
}

std::vector<double> plain_inv_freq(int64_t d, double theta) {
  std::vector<double> f(size_t(d / 2));
  for (int64_t i = 0; i < d / 2; ++i) f[size_t(i)] = std::pow(theta, -2.0 * double(i) / double(d));
  return f;
}

// Llama 3.1's scaling, written from its definition in double: wavelengths w = 2 pi / f longer
// than L / low are slowed by the factor, shorter than L / high kept, and in between blended
// with s = (L / w - low) / (high - low).
std::vector<double> llama3_inv_freq(int64_t d, double theta, double factor, double low, double high,
                                    double original) {
  std::vector<double> f = plain_inv_freq(d, theta);
  for (double& x : f) {
    const double w = 2 * std::numbers::pi / x;
    if (w > original / low) {
      x /= factor;
    } else if (w >= original / high) {
      const double smooth = (original / w - low) / (high - low);
      x = (1 - smooth) * x / factor + smooth * x;
    }
  }
  return f;
}

TEST_P(EmbeddingRope, RopeForwardAndBackward) {
  const int64_t b = 2, s = 7, h = 3, d = 16, offset = 5;
  const float theta = 10000.0f;
  Tensor x = random_tensor({b, s, h, d}, 4);
  std::vector<double> xv = values(seen(x));
  Tensor out = empty({b, s, h, d});
  ops::rope_forward(out, up(x), {theta}, offset);
  const std::vector<double> f = plain_inv_freq(d, theta);
  EXPECT_TRUE(all_close(out, rope_reference(xv, b, s, h, d, f, offset, 1.0), tol({2e-6, 1e-5})));
  // Backward is the transposed rotation, i.e. the opposite angle; in place (dx aliases dout).
  Tensor g = up(x);
  ops::rope_backward(g, g, {theta}, offset);
  EXPECT_TRUE(all_close(g, rope_reference(xv, b, s, h, d, f, offset, -1.0), tol({2e-6, 1e-5})));
}

// Llama 3.1's frequencies (factor 8, low 1, high 4, original 8192) at head dim 128 and theta
// 5e5: every regime occurs - kept, blended, slowed - and each frequency is the definition's.
TEST(RotaryFrequencies, Llama3ScalingFollowsItsDefinition) {
  const ops::RotaryFrequencies rotary{500000.0f, 8.0f, 1.0f, 4.0f, 8192.0f};
  const std::vector<float> got = rotary.inv_freq(128);
  const std::vector<double> want = llama3_inv_freq(128, 500000.0, 8, 1, 4, 8192);
  const std::vector<double> plain = plain_inv_freq(128, 500000.0);
  ASSERT_EQ(got.size(), 64u);
  int kept = 0, blended = 0, slowed = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 2e-6 * want[i]) << "i = " << i;
    const double ratio = want[i] / plain[i];
    (ratio == 1.0 ? kept : ratio == 1.0 / 8 ? slowed : blended) += 1;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(blended, 0);
  EXPECT_GT(slowed, 0);
  const std::vector<float> unscaled = ops::RotaryFrequencies{500000.0f}.inv_freq(128);
  for (size_t i = 0; i < unscaled.size(); ++i)
    EXPECT_NEAR(unscaled[i], plain[i], 2e-6 * plain[i]) << "i = " << i;
  EXPECT_THROW(ops::RotaryFrequencies({500000.0f, 8.0f, 4.0f, 1.0f, 8192.0f}).validate(), Error);
  EXPECT_THROW(ops::RotaryFrequencies({500000.0f, -1.0f}).validate(), Error);
}

Tensor EmbeddingRope::check_rope(const ops::RotaryFrequencies& rotary, const std::vector<double>& f,
                                 int64_t b, int64_t s, int64_t h, int64_t d, int64_t offset,
                                 uint64_t seed) const {
  Tensor x = random_tensor({b, s, h, d}, seed);
  std::vector<double> xv = values(seen(x));
  Tensor out = empty({b, s, h, d});
  ops::rope_forward(out, up(x), rotary, offset);
  EXPECT_TRUE(all_close(out, rope_reference(xv, b, s, h, d, f, offset, 1.0), tol({2e-6, 1e-5})));
  Tensor g = up(x);
  ops::rope_backward(g, g, rotary, offset);
  EXPECT_TRUE(all_close(g, rope_reference(xv, b, s, h, d, f, offset, -1.0), tol({2e-6, 1e-5})));
  Tensor back = empty({b, s, h, d});
  ops::rope_backward(back, out, rotary, offset);  // out of place: undoes the forward
  EXPECT_TRUE(all_close(back, xv, tol({2e-6, 1e-5})));
  return out;
}

TEST_P(EmbeddingRope, ScaledRopeRotatesByTheScaledFrequencies) {
  // Head dim 32 with theta 5e5 and a short original context (64): all three regimes.
  const ops::RotaryFrequencies rotary{500000.0f, 8.0f, 1.0f, 4.0f, 64.0f};
  check_rope(rotary, llama3_inv_freq(32, 500000.0, 8, 1, 4, 64), 1, 5, 2, 32, 9, 7);
}

TEST_P(EmbeddingRope, PartialRopeTurnsTheLeadingChannelsAlone) {
  // rotary_dim 6 of an odd head of 11 (StableLM: a quarter of each head): channels 0-5 turn by
  // the frequencies of a 6-channel head, 6-10 pass through, out of place and in place.
  ops::RotaryFrequencies rotary{10000.0f};
  rotary.rotary_dim = 6;
  Tensor out = check_rope(rotary, plain_inv_freq(6, 10000.0), 2, 4, 3, 11, 2, 8);
  rotary.rotary_dim = 12;
  EXPECT_THROW(ops::rope_forward(out, out, rotary, 2), Error);
  rotary.rotary_dim = 5;
  EXPECT_THROW(ops::rope_forward(out, out, rotary, 2), Error);
}

TEST_P(EmbeddingRope, RopeBackwardMatchesFiniteDifferences) {
  GradCheck g;
  g.inputs = {random_tensor({1, 5, 2, 8}, 5)};
  g.wrt = {0};
  g.samples = 80;
  g.forward = [](const Tensors& in) {
    Tensor y = empty_as(in[0], in[0].shape());
    ops::rope_forward(y, in[0], {500000.0f}, 3);
    return y;
  };
  g.backward = [](const Tensors& in, const Tensor& dy) {
    Tensor dx = empty_as(in[0], in[0].shape());
    ops::rope_backward(dx, dy, {500000.0f}, 3);
    return Tensors{dx};
  };
  g.step = 1e-2;
  g.f32_tol = {1e-3, 1e-3};
  check_gradients(GetParam(), g);
}

TEST_P(EmbeddingRope, RopeAtLongPositionsFollowsF32Angles) {
  // HF computes angles in f32 (position * inv_freq rounded to f32): at position 4000 that is
  // ~1e-4 rad away from the exact angle; braid follows HF, so compare with a loose tolerance
  // against the exact double reference and a tight one against HF's f32 recipe.
  const int64_t d = 8, offset = 4000;
  Tensor x = random_tensor({1, 2, 1, d}, 6);
  Tensor out = empty({1, 2, 1, d});
  ops::rope_forward(out, up(x), {10000.0f}, offset);
  std::vector<double> xv = values(seen(x)), hf(xv.size());
  for (int64_t si = 0; si < 2; ++si) {
    for (int64_t i = 0; i < d / 2; ++i) {
      float inv_freq = 1.0f / std::pow(10000.0f, float(2 * i) / float(d));
      float angle = float(offset + si) * inv_freq;
      double c = std::cos(double(angle)), sn = std::sin(double(angle));
      double x1 = xv[size_t(si * d + i)], x2 = xv[size_t(si * d + i + d / 2)];
      hf[size_t(si * d + i)] = x1 * c - x2 * sn;
      hf[size_t(si * d + i + d / 2)] = x2 * c + x1 * sn;
    }
  }
  EXPECT_TRUE(all_close(out, hf, tol({2e-6, 1e-5})));
  EXPECT_TRUE(all_close(out,
                        rope_reference(xv, 1, 2, 1, d, plain_inv_freq(d, 10000.0), offset, 1.0),
                        tol({1e-3, 1e-3})));
}

// ---- first_channel and interleaved pairs (multi-latent attention: [no-rope | rope] heads)

ops::RotaryFrequencies mla_rotary(int64_t first, int64_t rotary_dim, bool interleaved) {
  ops::RotaryFrequencies rotary{10000.0f};
  rotary.first_channel = first;
  rotary.rotary_dim = rotary_dim;
  rotary.interleaved = interleaved;
  return rotary;
}

// The channels of x [.., d] outside [first, first + r) of each head, exactly.
std::vector<double> passed_channels(const std::vector<double>& x, int64_t d, int64_t first,
                                    int64_t r) {
  std::vector<double> kept;
  for (size_t i = 0; i < x.size(); ++i) {
    const auto j = int64_t(i) % d;
    if (j < first || j >= first + r) kept.push_back(x[i]);
  }
  return kept;
}

TEST(RotaryFrequencies, FirstChannelTurnsTheRestOfTheHead) {
  // R = head_dim - first_channel: the frequencies of an R-channel head.
  const ops::RotaryFrequencies rotary = mla_rotary(4, 0, true);
  EXPECT_EQ(rotary.rotated_channels(12), 8);
  EXPECT_EQ(rotary.inv_freq(12), ops::RotaryFrequencies{10000.0f}.inv_freq(8));
  EXPECT_EQ(mla_rotary(4, 6, false).inv_freq(12), ops::RotaryFrequencies{10000.0f}.inv_freq(6));
  EXPECT_THROW(mla_rotary(4, 10, false).inv_freq(12), Error);
  EXPECT_THROW(mla_rotary(13, 0, false).inv_freq(12), Error);
  EXPECT_TRUE(raises([] { mla_rotary(-1, 0, false).validate(); }, "rope: first_channel = -1"));
}

TEST_P(EmbeddingRope, InterleavedRopeFromAChannelOffset) {
  // DeepSeek's layout: 5 no-rope channels, then 8 rope channels (and a 3-channel tail with
  // rotary_dim 8 of 16, which passes through too).
  const int64_t b = 2, s = 5, h = 3, offset = 3;
  for (auto [d, first, rotary_dim] :
       {std::tuple<int64_t, int64_t, int64_t>{13, 5, 0}, {16, 5, 8}}) {
    const ops::RotaryFrequencies rotary = mla_rotary(first, rotary_dim, true);
    const int64_t r = rotary.rotated_channels(d);
    const std::vector<double> f = plain_inv_freq(r, 10000.0);
    Tensor x = random_tensor({b, s, h, d}, 11);
    const std::vector<double> xv = values(seen(x));
    const std::vector<double> want = rope_reference(xv, b, s, h, d, f, offset, 1.0, first, true);
    // Out of place, into a buffer holding other values: every channel is written.
    Tensor out = up(random_tensor({b, s, h, d}, 12));
    ops::rope_forward(out, up(x), rotary, offset);
    EXPECT_TRUE(all_close(out, want, tol({2e-6, 1e-5}))) << "d " << d;
    EXPECT_EQ(passed_channels(values(out), d, first, r), passed_channels(xv, d, first, r));
    // In place.
    Tensor in_place = up(x);
    ops::rope_forward(in_place, in_place, rotary, offset);
    EXPECT_TRUE(all_close(in_place, values(out), {0, 0})) << "d " << d;
    // Backward turns by the opposite angle, in and out of place; it undoes the forward.
    Tensor g = up(x);
    ops::rope_backward(g, g, rotary, offset);
    EXPECT_TRUE(all_close(g, rope_reference(xv, b, s, h, d, f, offset, -1.0, first, true),
                          tol({2e-6, 1e-5})));
    Tensor back = up(random_tensor({b, s, h, d}, 13));
    ops::rope_backward(back, out, rotary, offset);
    EXPECT_TRUE(all_close(back, xv, tol({2e-6, 1e-5}, {2e-2, 2e-2}))) << "d " << d;
    EXPECT_EQ(passed_channels(values(back), d, first, r), passed_channels(xv, d, first, r));
  }
}

TEST_P(EmbeddingRope, RotateHalfFromAChannelOffset) {
  const int64_t b = 1, s = 4, h = 2, d = 14, first = 4, offset = 7;
  const ops::RotaryFrequencies rotary = mla_rotary(first, 0, false);
  Tensor x = random_tensor({b, s, h, d}, 14);
  const std::vector<double> xv = values(seen(x));
  Tensor out = up(random_tensor({b, s, h, d}, 15));
  ops::rope_forward(out, up(x), rotary, offset);
  EXPECT_TRUE(all_close(
      out, rope_reference(xv, b, s, h, d, plain_inv_freq(10, 10000.0), offset, 1.0, first, false),
      tol({2e-6, 1e-5})));
  EXPECT_EQ(passed_channels(values(out), d, first, 10), passed_channels(xv, d, first, 10));
}

// HF's DeepseekV3 (apply_rotary_pos_emb_interleave) de-interleaves the rope channels of q and k
// to [evens | odds], then applies rotate_half with cos, sin = cat(freqs, freqs) in f32. Putting
// the channels back in their interleaved places gives braid's interleaved output.
TEST_P(EmbeddingRope, InterleavedRopeIsHfDeinterleavedRotateHalf) {
  const int64_t s = 6, h = 2, first = 4, r = 8, d = first + r, offset = 100;
  Tensor x = random_tensor({1, s, h, d}, 16);
  const std::vector<double> xv = values(seen(x));
  Tensor out = empty({1, s, h, d});
  const ops::RotaryFrequencies rotary = mla_rotary(first, 0, true);
  ops::rope_forward(out, up(x), rotary, offset);
  const std::vector<float> inv_freq = rotary.inv_freq(d);
  std::vector<double> hf(xv);
  for (int64_t si = 0; si < s; ++si) {
    std::vector<double> cos(static_cast<size_t>(r)), sin(cos);  // emb = cat(freqs, freqs)
    for (int64_t i = 0; i < r; ++i) {
      const float angle = float(offset + si) * inv_freq[size_t(i % (r / 2))];
      cos[size_t(i)] = std::cos(double(angle));
      sin[size_t(i)] = std::sin(double(angle));
    }
    for (int64_t hi = 0; hi < h; ++hi) {
      const size_t at = size_t((si * h + hi) * d + first);
      std::vector<double> q(static_cast<size_t>(r)), rotated(q), embed(q);
      for (int64_t i = 0; i < r / 2; ++i) {  // view(.., r/2, 2).transpose: [evens | odds]
        q[size_t(i)] = xv[at + size_t(2 * i)];
        q[size_t(i + r / 2)] = xv[at + size_t(2 * i + 1)];
      }
      for (int64_t i = 0; i < r / 2; ++i) {  // rotate_half: cat(-x2, x1)
        rotated[size_t(i)] = -q[size_t(i + r / 2)];
        rotated[size_t(i + r / 2)] = q[size_t(i)];
      }
      for (int64_t i = 0; i < r; ++i) {
        embed[size_t(i)] = q[size_t(i)] * cos[size_t(i)] + rotated[size_t(i)] * sin[size_t(i)];
      }
      for (int64_t i = 0; i < r / 2; ++i) {  // back to the interleaved places
        hf[at + size_t(2 * i)] = embed[size_t(i)];
        hf[at + size_t(2 * i + 1)] = embed[size_t(i + r / 2)];
      }
    }
  }
  EXPECT_TRUE(all_close(out, hf, tol({2e-6, 1e-5})));
  // The same through braid itself: rotate_half on the de-interleaved channels.
  Tensor deinterleaved = Tensor::empty({1, s, h, d}, DType::f32);
  const std::vector<double> outv = values(out);
  std::vector<double> want(outv);
  for (int64_t row = 0; row < s * h; ++row) {
    for (int64_t j = 0; j < d; ++j) {
      const int64_t k = row * d + j, i = j - first;
      const int64_t from = i < 0 ? j : first + (i < r / 2 ? 2 * i : 2 * (i - r / 2) + 1);
      deinterleaved.data_ptr<float>()[k] = float(xv[size_t(row * d + from)]);
      want[size_t(k)] = outv[size_t(row * d + from)];
    }
  }
  Tensor halves = empty({1, s, h, d});
  ops::rope_forward(halves, up(deinterleaved), mla_rotary(first, 0, false), offset);
  EXPECT_TRUE(all_close(halves, want, tol({1e-6, 1e-6}, {1e-2, 1e-2})));
}

TEST_P(EmbeddingRope, RopeChannelsMustFitTheHead) {
  Tensor x = empty({1, 2, 2, 12});
  EXPECT_TRUE(raises([&] { ops::rope_forward(x, x, mla_rotary(4, 10, true)); },
                     "rope_forward: first_channel 4 + rotary_dim 10 exceeds the head's 12"));
  EXPECT_TRUE(raises([&] { ops::rope_backward(x, x, mla_rotary(13, 0, true)); },
                     "rope_backward: first_channel 13 exceeds the head's 12"));
  EXPECT_TRUE(raises([&] { ops::rope_forward(x, x, mla_rotary(3, 0, false)); },
                     "rope_forward: the 9 channels that turn"));
  EXPECT_TRUE(raises([&] { ops::rope_forward(x, x, mla_rotary(-2, 0, false)); },
                     "rope: first_channel = -2"));
  // Every channel before the head's end is fine, and so is turning none.
  ops::rope_forward(x, up(random_tensor({1, 2, 2, 12}, 17)), mla_rotary(4, 8, true));
  ops::rope_forward(x, x, mla_rotary(12, 0, true));
}

TEST_P(EmbeddingRope, InterleavedRopeBackwardMatchesFiniteDifferences) {
  GradCheck g;
  g.inputs = {random_tensor({1, 4, 2, 10}, 18)};
  g.wrt = {0};
  g.samples = 80;
  g.forward = [](const Tensors& in) {
    Tensor y = empty_as(in[0], in[0].shape());
    ops::rope_forward(y, in[0], mla_rotary(2, 0, true), 3);
    return y;
  };
  g.backward = [](const Tensors& in, const Tensor& dy) {
    Tensor dx = empty_as(in[0], in[0].shape());
    ops::rope_backward(dx, dy, mla_rotary(2, 0, true), 3);
    return Tensors{dx};
  };
  g.f32_tol = {1e-3, 1e-3};
  check_gradients(GetParam(), g);
}

BRAID_KERNEL_TEST_SUITE(EmbeddingRope);

}  // namespace
}  // namespace braid::testing
