// Token embedding (vocab-parallel slices) and rotary position embedding (HF rotate_half, and
// interleaved pairs from a channel offset: multi-latent attention).
#include <limits>
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

// Linear position interpolation (HF rope_type "linear"): HF's inv_freq / factor, in f32; by a
// factor of 2, position 2p turns as position p does without it. It excludes the other scalings.
TEST(RotaryFrequencies, LinearInterpolationDividesEveryFrequency) {
  const ops::RotaryFrequencies plain{.theta = 10000.0f};
  const ops::RotaryFrequencies linear{.theta = 10000.0f, .linear_factor = 2.5f};
  const std::vector<float> f = plain.inv_freq(64), g = linear.inv_freq(64);
  ASSERT_EQ(f.size(), g.size());
  for (size_t i = 0; i < f.size(); ++i) EXPECT_EQ(g[i], f[i] / 2.5f) << "pair " << i;
  const ops::RotaryFrequencies half{.theta = 10000.0f, .linear_factor = 2.0f};
  Tensor x = random_tensor({1, 1, 2, 64}, 5), at_p = Tensor::empty({1, 1, 2, 64}, DType::f32);
  Tensor at_2p = Tensor::empty({1, 1, 2, 64}, DType::f32);
  ops::rope_forward(at_p, x, plain, 7);
  ops::rope_forward(at_2p, x, half, 14);
  EXPECT_EQ(values(at_2p), values(at_p));
  EXPECT_THROW((ops::RotaryFrequencies{.llama3_factor = 8.0f, .linear_factor = 2.0f}.validate()),
               Error);
  EXPECT_THROW((ops::RotaryFrequencies{.linear_factor = -1.0f}.validate()), Error);
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

// ---- YaRN (HF rope_type "yarn": DeepSeek-V3's long context, Qwen's)

// YaRN from its definition (Peng et al. 2023) in double: with d(r) = R ln(L / (2 pi r)) /
// (2 ln theta), the pairs up to low = floor(d(beta_fast)) keep theta^(-2i/R), those from
// high = ceil(d(beta_slow)) on are divided by the factor, and a linear ramp blends the two.
std::vector<double> yarn_inv_freq(int64_t r, double theta, double factor, double original,
                                  double beta_fast = 32, double beta_slow = 1) {
  auto d = [&](double rotations) {
    return double(r) * std::log(original / (2 * std::numbers::pi * rotations)) /
           (2 * std::log(theta));
  };
  const double low = std::max(std::floor(d(beta_fast)), 0.0);
  double high = std::min(std::ceil(d(beta_slow)), double(r - 1));
  if (high == low) high += 0.001;
  std::vector<double> f = plain_inv_freq(r, theta);
  for (size_t i = 0; i < f.size(); ++i) {
    const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
    f[i] = f[i] / factor * ramp + f[i] * (1 - ramp);
  }
  return f;
}

ops::RotaryFrequencies yarn_rotary(float theta, float factor, float original) {
  ops::RotaryFrequencies rotary{theta};
  rotary.yarn_factor = factor;
  rotary.original_max_positions = original;
  return rotary;
}

// transformers 5.24's _compute_yarn_parameters (modeling_rope_utils.py), printed with float.hex()
// from the venv: DeepSeek-V3's rope_scaling (theta 1e4, qk_rope_head_dim 64, yarn factor 40,
// original_max_position_embeddings 4096, beta_fast 32, beta_slow 1, mscale = mscale_all_dim =
// 1: attention_factor 1.0) ...
constexpr float kHfDeepSeekV3[32] = {
    0x1p+0f,         0x1.7ff222p-1f,  0x1.1feb34p-1f,  0x1.afd136p-2f,  0x1.43d136p-2f,
    0x1.e5a846p-3f,  0x1.6c310ep-3f,  0x1.111aeep-3f,  0x1.99999ap-4f,  0x1.33281ap-4f,
    0x1.ccab84p-5f,  0x1.3f8b74p-5f,  0x1.b86436p-6f,  0x1.2d1b86p-6f,  0x1.97e506p-7f,
    0x1.111aeep-7f,  0x1.6872b2p-8f,  0x1.d2e0ccp-9f,  0x1.26d42cp-9f,  0x1.67459ap-10f,
    0x1.9e7c6ep-11f, 0x1.b32624p-12f, 0x1.74eea6p-13f, 0x1.17a8e2p-15f, 0x1.a36e2ep-16f,
    0x1.3a8746p-16f, 0x1.d7b9ep-17f,  0x1.61bea2p-17f, 0x1.094566p-17f, 0x1.8dd9bap-18f,
    0x1.2a5884p-18f, 0x1.bf749ep-19f};
// ... and a Qwen2Config with head_dim 128, rope_theta 1e6 and rope_scaling yarn factor 4,
// original_max_position_embeddings 4096 x 8 (no mscale: attention_factor 1.138629436111989).
constexpr float kHfQwenYarn[64] = {
    0x1p+0f,         0x1.9c975ap-1f,  0x1.4c7bcp-1f,   0x1.0beddep-1f,  0x1.afd136p-2f,
    0x1.5bf9fep-2f,  0x1.186a08p-2f,  0x1.c3f06ap-3f,  0x1.6c310ep-3f,  0x1.257b22p-3f,
    0x1.d8ffacp-4f,  0x1.7d298cp-4f,  0x1.33281ap-4f,  0x1.ef0a26p-5f,  0x1.8eec7ep-5f,
    0x1.41783ap-5f,  0x1.030dc6p-5f,  0x1.a1835p-6f,   0x1.507316p-6f,  0x1.0f201p-6f,
    0x1.b4f7e4p-7f,  0x1.6020a4p-7f,  0x1.1bc25ap-7f,  0x1.c9548cp-8f,  0x1.6046eep-8f,
    0x1.0ec71p-8f,   0x1.9f4aap-9f,   0x1.3da49p-9f,   0x1.e483bep-10f, 0x1.70578p-10f,
    0x1.17040ep-10f, 0x1.a4fb7p-11f,  0x1.3c1d64p-11f, 0x1.d832dp-12f,  0x1.5e7a04p-12f,
    0x1.02387cp-12f, 0x1.79277cp-13f, 0x1.107c7p-13f,  0x1.847d34p-14f, 0x1.103a14p-14f,
    0x1.74eea6p-15f, 0x1.2c8648p-15f, 0x1.e459c4p-16f, 0x1.864f6ap-16f, 0x1.3a8748p-16f,
    0x1.faeba8p-17f, 0x1.987f7cp-17f, 0x1.492f56p-17f, 0x1.094564p-17f, 0x1.ab8882p-18f,
    0x1.58863ap-18f, 0x1.15a1dap-18f, 0x1.bf749ep-19f, 0x1.68941cp-19f, 0x1.2291c6p-19f,
    0x1.d44e64p-20f, 0x1.796182p-20f, 0x1.301c04p-20f, 0x1.ea20ep-21f,  0x1.8af756p-21f,
    0x1.3e47c8p-21f, 0x1.007bd8p-21f, 0x1.9d5ef2p-22f, 0x1.4d1c98p-22f};

TEST(RotaryFrequencies, YarnIsHfsToTheBit) {
  const std::vector<float> deepseek = yarn_rotary(10000.0f, 40.0f, 4096.0f).inv_freq(64);
  ASSERT_EQ(deepseek.size(), 32u);
  for (size_t i = 0; i < deepseek.size(); ++i) EXPECT_EQ(deepseek[i], kHfDeepSeekV3[i]) << i;
  const std::vector<float> qwen = yarn_rotary(1e6f, 4.0f, 32768.0f).inv_freq(128);
  ASSERT_EQ(qwen.size(), 64u);
  // Within one ulp: torch's vectorised pow (Sleef's, 1-ulp) rounds theta^(74/128) down where
  // std::pow rounds it correctly (as braid's plain frequencies do), which moves pair 37 by one.
  for (size_t i = 0; i < qwen.size(); ++i) {
    EXPECT_TRUE(qwen[i] == kHfQwenYarn[i] ||
                std::nextafter(qwen[i], kHfQwenYarn[i]) == kHfQwenYarn[i])
        << i << ": " << qwen[i] << " against HF's " << kHfQwenYarn[i];
  }
}

TEST(RotaryFrequencies, YarnFollowsItsDefinition) {
  // Every regime occurs (kept, blended, divided by the factor), with the default betas and
  // others, and from a channel offset (MLA's rope channels: R = 64 of a 192-channel head).
  struct Case {
    float theta, factor, original, beta_fast, beta_slow;
    int64_t first, head;
  };
  for (const Case& c : {Case{10000.0f, 40.0f, 4096.0f, 32.0f, 1.0f, 128, 192},
                        Case{1e6f, 4.0f, 32768.0f, 32.0f, 1.0f, 0, 128},
                        Case{500000.0f, 8.0f, 8192.0f, 16.0f, 2.0f, 0, 96}}) {
    ops::RotaryFrequencies rotary = yarn_rotary(c.theta, c.factor, c.original);
    rotary.yarn_beta_fast = c.beta_fast;
    rotary.yarn_beta_slow = c.beta_slow;
    rotary.first_channel = c.first;
    rotary.validate();
    const int64_t r = c.head - c.first;
    const std::vector<float> got = rotary.inv_freq(c.head);
    const std::vector<double> want =
        yarn_inv_freq(r, c.theta, c.factor, c.original, c.beta_fast, c.beta_slow);
    const std::vector<double> plain = plain_inv_freq(r, c.theta);
    ASSERT_EQ(got.size(), want.size());
    int kept = 0, blended = 0, divided = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 2e-6 * want[i]) << "theta " << c.theta << ", i = " << i;
      const double ratio = want[i] / plain[i];
      (ratio == 1.0 ? kept : std::abs(ratio * c.factor - 1) < 1e-12 ? divided : blended) += 1;
    }
    EXPECT_GT(kept, 0);
    EXPECT_GT(blended, 0);
    EXPECT_GT(divided, 0);
  }
}

TEST(RotaryFrequencies, YarnRefusesWhatHfWarnsAbout) {
  auto refused = [](auto change, const char* message) {
    ops::RotaryFrequencies rotary = yarn_rotary(10000.0f, 40.0f, 4096.0f);
    change(rotary);
    return raises([&] { rotary.validate(); }, message);
  };
  EXPECT_TRUE(refused([](auto& r) { r.llama3_factor = 8.0f; }, "exclude each other"));
  EXPECT_TRUE(refused([](auto& r) { r.yarn_factor = 0.5f; }, "YaRN factor 0.5 must be >= 1"));
  EXPECT_TRUE(refused([](auto& r) { r.yarn_factor = -1.0f; }, "YaRN factor -1"));
  EXPECT_TRUE(refused([](auto& r) { r.yarn_beta_slow = 64.0f; }, "0 < yarn_beta_slow (64)"));
  EXPECT_TRUE(refused([](auto& r) { r.yarn_beta_slow = 0.0f; }, "0 < yarn_beta_slow (0)"));
  EXPECT_TRUE(refused([](auto& r) { r.original_max_positions = 0.0f; }, "original_max_positions"));
  EXPECT_TRUE(refused([](auto& r) { r.attention_factor = 0.0f; }, "attention_factor = 0"));
  EXPECT_TRUE(refused([](auto& r) { r.attention_factor = std::numeric_limits<float>::quiet_NaN(); },
                      "attention_factor = nan"));
  yarn_rotary(10000.0f, 1.0f, 4096.0f).validate();  // factor 1 interpolates nothing
}

// x [.., d] with channels [first, first + r) of each head times `factor`.
std::vector<double> scaled_channels(std::vector<double> x, int64_t d, int64_t first, int64_t r,
                                    double factor) {
  for (size_t i = 0; i < x.size(); ++i) {
    const auto j = int64_t(i) % d;
    if (j >= first && j < first + r) x[i] *= factor;
  }
  return x;
}

TEST_P(EmbeddingRope, YarnRopeScalesCosAndSinByTheAttentionFactor) {
  // DeepSeek-V3's frequencies on MLA's layout (4 no-rope channels, then 64 interleaved rope
  // channels), with attention factor 1 (a rotation) and 1.25.
  const int64_t b = 2, s = 3, h = 2, first = 4, r = 64, d = first + r, offset = 7;
  ops::RotaryFrequencies rotary = yarn_rotary(10000.0f, 40.0f, 4096.0f);
  rotary.first_channel = first;
  rotary.interleaved = true;
  std::vector<double> f;
  for (float x : rotary.inv_freq(d)) f.push_back(x);  // HF's f32 frequencies (tested above)
  Tensor x = random_tensor({b, s, h, d}, 19);
  const std::vector<double> xv = values(seen(x));
  const std::vector<double> turned = rope_reference(xv, b, s, h, d, f, offset, 1.0, first, true);
  for (float factor : {1.0f, 1.25f}) {
    rotary.attention_factor = factor;
    Tensor out = empty({b, s, h, d});
    ops::rope_forward(out, up(x), rotary, offset);
    EXPECT_TRUE(all_close(out, scaled_channels(turned, d, first, r, factor), tol({2e-6, 1e-5})))
        << "factor " << factor;
    // The backward is the transpose: the opposite angle, the same factor (back = factor^2 x).
    Tensor back = empty({b, s, h, d});
    ops::rope_backward(back, out, rotary, offset);
    EXPECT_TRUE(all_close(back, scaled_channels(xv, d, first, r, double(factor) * factor),
                          tol({2e-6, 1e-5}, {2e-2, 2e-2})))
        << "factor " << factor;
  }
  // A unit vector in every pair comes out with norm attention_factor.
  Tensor unit = Tensor::zeros({1, s, 1, d}, DType::f32);
  for (int64_t row = 0; row < s; ++row) {
    for (int64_t i = 0; i < r / 2; ++i) unit.data_ptr<float>()[row * d + first + 2 * i] = 1.0f;
  }
  Tensor turned_unit = empty({1, s, 1, d});
  ops::rope_forward(turned_unit, up(unit), rotary, offset);
  const std::vector<double> u = values(turned_unit);
  const double atol = dtype() == DType::f32 ? 1e-6 : 1e-2;
  for (int64_t row = 0; row < s; ++row) {
    for (int64_t i = 0; i < r / 2; ++i) {
      const size_t at = size_t(row * d + first + 2 * i);
      EXPECT_NEAR(std::hypot(u[at], u[at + 1]), 1.25, atol) << "row " << row << " pair " << i;
    }
  }
}

TEST_P(EmbeddingRope, YarnRopeBackwardMatchesFiniteDifferences) {
  auto rotary = [] {
    ops::RotaryFrequencies r = yarn_rotary(10000.0f, 40.0f, 64.0f);
    r.first_channel = 2;
    r.interleaved = true;
    r.attention_factor = 1.3f;
    return r;
  };
  GradCheck g;
  g.inputs = {random_tensor({1, 4, 2, 18}, 20)};
  g.wrt = {0};
  g.samples = 80;
  g.forward = [&](const Tensors& in) {
    Tensor y = empty_as(in[0], in[0].shape());
    ops::rope_forward(y, in[0], rotary(), 70);
    return y;
  };
  g.backward = [&](const Tensors& in, const Tensor& dy) {
    Tensor dx = empty_as(in[0], in[0].shape());
    ops::rope_backward(dx, dy, rotary(), 70);
    return Tensors{dx};
  };
  g.f32_tol = {1e-3, 1e-3};
  check_gradients(GetParam(), g);
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
