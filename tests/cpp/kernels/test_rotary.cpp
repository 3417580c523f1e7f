// RotaryFrequencies::yarn_truncate: YaRN's correction range unrounded (HF's rope_parameters
// truncate: false, GPT-OSS's) against HF's _compute_yarn_parameters recomputed here in double,
// the rounded default unchanged, and rope on every device turning by the host's frequencies.
#include <numbers>

#include "kernel_test_util.h"

namespace braid::testing {
namespace {

struct YarnCase {
  double theta, factor, original, beta_fast, beta_slow;
  int64_t dim;  // R, the channels that turn
};

std::ostream& operator<<(std::ostream& out, const YarnCase& c) {
  return out << "theta " << c.theta << " factor " << c.factor << " L " << c.original << " betas "
             << c.beta_fast << "/" << c.beta_slow << " R " << c.dim;
}

// HF's _compute_yarn_parameters (transformers' modeling_rope_utils.py) in double:
// find_correction_dim, find_correction_range (floor and ceil only when truncating, then
// max(low, 0) and min(high, dim - 1)), linear_ramp_factor (+ 0.001 on a zero width), and the
// blend of the interpolated and extrapolated frequencies.
std::vector<double> hf_yarn(const YarnCase& c, bool truncate) {
  auto correction_dim = [&](double rotations) {
    return double(c.dim) * std::log(c.original / (rotations * 2 * std::numbers::pi)) /
           (2 * std::log(c.theta));
  };
  double low = correction_dim(c.beta_fast), high = correction_dim(c.beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, double(c.dim - 1));
  if (low == high) high += 0.001;
  std::vector<double> out;
  for (int64_t i = 0; i < c.dim / 2; ++i) {
    const double pos_freq = std::pow(c.theta, double(2 * i) / double(c.dim));
    const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation_factor = 1 - ramp;
    out.push_back(1 / (c.factor * pos_freq) * (1 - extrapolation_factor) +
                  1 / pos_freq * extrapolation_factor);
  }
  return out;
}

ops::RotaryFrequencies yarn_of(const YarnCase& c, bool truncate) {
  ops::RotaryFrequencies rotary{float(c.theta)};
  rotary.yarn_factor = float(c.factor);
  rotary.original_max_positions = float(c.original);
  rotary.yarn_beta_fast = float(c.beta_fast);
  rotary.yarn_beta_slow = float(c.beta_slow);
  rotary.yarn_truncate = truncate;
  rotary.validate();
  return rotary;
}

// GPT-OSS's rope (theta 150000, factor 32, L 4096, betas 32 and 1, head dim 64); a range whose
// low end falls below 0 and whose high end passes R - 1 (both clamped); equal betas (a zero-width
// ramp widened by 0.001).
const std::vector<YarnCase> kCases = {{150000, 32, 4096, 32, 1, 64},
                                      {10000, 8, 2048, 400, 1, 32},
                                      {500, 4, 1e6, 16, 0.015625, 32},
                                      {10000, 40, 4096, 8, 8, 64}};

TEST(RotaryFrequencies, UntruncatedYarnIsHfsFormula) {
  for (const YarnCase& c : kCases) {
    SCOPED_TRACE(::testing::Message() << c);
    for (bool truncate : {false, true}) {
      SCOPED_TRACE(truncate ? "truncate" : "no truncate");
      const std::vector<float> got = yarn_of(c, truncate).inv_freq(c.dim);
      const std::vector<double> want = hf_yarn(c, truncate);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 2e-6 * want[i]) << i;
    }
  }
}

TEST(RotaryFrequencies, TruncateIsTheDefaultAndMattersForGptOss) {
  const YarnCase c = kCases[0];
  ops::RotaryFrequencies rounded = yarn_of(c, true);
  rounded.yarn_truncate = ops::RotaryFrequencies{}.yarn_truncate;  // the default: true
  EXPECT_EQ(rounded.inv_freq(c.dim), yarn_of(c, true).inv_freq(c.dim));
  // GPT-OSS's unrounded range moves the blended pairs' frequencies by far more than rounding.
  const std::vector<float> exact = yarn_of(c, false).inv_freq(c.dim);
  const std::vector<float> truncated = yarn_of(c, true).inv_freq(c.dim);
  int moved = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    moved += std::fabs(exact[i] - truncated[i]) > 1e-3 * truncated[i];
  }
  EXPECT_GT(moved, 0);
}

class Rotary : public KernelTest {};

TEST_P(Rotary, UntruncatedYarnRopeTurnsByHfsFrequencies) {
  // rope_forward (the CPU's and CUDA's kernels, fed the host's frequencies) turns each pair
  // (i, i + R/2) of position p by p * inv_freq[i] of HF's formula.
  const YarnCase c = kCases[0];
  const int64_t b = 1, s = 19, h = 2, d = c.dim, half = d / 2;
  const std::vector<double> f = hf_yarn(c, false);
  Tensor x = random_tensor({b, s, h, d}, 5);
  Tensor out = empty({b, s, h, d});
  ops::rope_forward(out, up(x), yarn_of(c, false));
  const std::vector<double> xv = values(seen(x));
  std::vector<double> want(xv.size());
  for (int64_t p = 0; p < s; ++p) {
    for (int64_t hh = 0; hh < h; ++hh) {
      const size_t row = size_t((p * h + hh) * d);
      for (int64_t i = 0; i < half; ++i) {
        const double angle = double(p) * f[size_t(i)];
        const double x0 = xv[row + size_t(i)], x1 = xv[row + size_t(i + half)];
        want[row + size_t(i)] = x0 * std::cos(angle) - x1 * std::sin(angle);
        want[row + size_t(i + half)] = x1 * std::cos(angle) + x0 * std::sin(angle);
      }
    }
  }
  EXPECT_TRUE(all_close(out, want, tol({1e-5, 1e-5})));
}

BRAID_KERNEL_TEST_SUITE(Rotary);

}  // namespace
}  // namespace braid::testing
