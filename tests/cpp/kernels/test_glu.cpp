// Gated linear units (glu_forward, glu_backward) beyond the default SwiGLU (test_elementwise.cpp):
// silu and quick gelu, with and without a clamp, with and without a linear offset, against a
// double-precision reference; the backward against central differences of that reference, with
// elements exactly at a clamp bound (the gradient passes) and beyond it (no gradient).
#include "kernel_test_util.h"

namespace braid::testing {
namespace {

class Glu : public KernelTest {};

// One output element in double: act(g) (u + offset) of a gate and an up value, as ops.h defines
// it (torch's clamp: min(gate, c), min(max(up, -c), c)).
double glu_ref(double gate, double up, const ops::GluSpec& spec) {
  const double c = spec.clamp;
  const double g = c > 0 ? std::min(gate, c) : gate;
  const double u = c > 0 ? std::min(std::max(up, -c), c) : up;
  const double alpha = spec.quick_gelu ? 1.702 : 1.0;
  return g / (1.0 + std::exp(-alpha * g)) * (u + spec.linear_offset);
}

std::string describe(const ops::GluSpec& spec) {
  return std::string(spec.quick_gelu ? "quick_gelu" : "silu") + " clamp " +
         std::to_string(spec.clamp) + " offset " + std::to_string(spec.linear_offset);
}

std::vector<ops::GluSpec> specs() {
  std::vector<ops::GluSpec> out;
  for (bool quick : {false, true}) {
    for (float clamp : {0.0f, 7.0f}) {
      for (float offset : {0.0f, 1.0f}) out.push_back({quick, clamp, offset});
    }
  }
  return out;
}

// x [rows, 2F] in [-12, 12): wide enough to cross a clamp of 7, with elements exactly at the
// bounds (7 and -7 are bf16 values too) and just beyond them. Values within `margin` of a bound
// (but not on it) are pushed away from it, so that differences of width `margin` never straddle
// one.
Tensor glu_input(int64_t rows, int64_t f, uint64_t seed, double margin) {
  Tensor x = random_tensor({rows, 2 * f}, seed, 12.0f);
  float* p = x.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    for (float bound : {7.0f, -7.0f}) {
      if (p[i] != bound && std::fabs(p[i] - bound) < margin)
        p[i] = bound + (p[i] < bound ? -0.25f : 0.25f);
    }
  }
  // gates (row 0): at the bound, beyond it, far beyond, far below (no lower clamp on the gate)
  const std::vector<float> gates = {7.0f, 7.5f, 100.0f, -100.0f, -7.0f};
  // ups (row 1): at either bound, beyond either
  const std::vector<float> ups = {7.0f, -7.0f, 7.5f, -8.0f, 0.5f};
  for (size_t j = 0; j < gates.size(); ++j) p[j] = gates[j];
  for (size_t j = 0; j < ups.size(); ++j) p[2 * f + f + int64_t(j)] = ups[j];
  return x;
}

TEST_P(Glu, ForwardMatchesReference) {
  for (int64_t f : {int64_t(37), int64_t(64)}) {  // odd rows, and rows of whole vector packs
    const int64_t rows = 5;
    const Tensor x = glu_input(rows, f, 3 + uint64_t(f), 0.0);
    const std::vector<double> xv = values(seen(x));
    for (const ops::GluSpec& spec : specs()) {
      SCOPED_TRACE(describe(spec) + " F " + std::to_string(f));
      std::vector<double> want;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < f; ++j) {
          want.push_back(glu_ref(xv[size_t(r * 2 * f + j)], xv[size_t(r * 2 * f + f + j)], spec));
        }
      }
      Tensor out = empty({rows, f});
      ops::glu_forward(out, up(x), spec);
      EXPECT_TRUE(all_close(out, want, tol({1e-5, 1e-5})));
    }
  }
}

TEST_P(Glu, BackwardMatchesDifferencesOfTheReference) {
  // dx = dout times the partial derivatives of the reference, by central differences in double
  // (step h; no element within 4 h of a bound but those on it). An element on a bound takes the
  // inside's slope (torch's clamp passes the gradient there), checked by a one-sided difference
  // from the inside; an element beyond a bound gets exactly zero.
  const double h = 1e-4;
  for (int64_t f : {int64_t(37), int64_t(64)}) {
    const int64_t rows = 5;
    const Tensor x = glu_input(rows, f, 11 + uint64_t(f), 4 * h);
    const Tensor dout = random_tensor({rows, f}, 12 + uint64_t(f), 2.0f);
    const std::vector<double> xv = values(seen(x)), dv = values(seen(dout));
    for (const ops::GluSpec& spec : specs()) {
      SCOPED_TRACE(describe(spec) + " F " + std::to_string(f));
      Tensor dx = empty({rows, 2 * f});
      ops::glu_backward(dx, up(dout), up(x), spec);
      const std::vector<double> got = values(dx);
      std::vector<double> want(got.size());
      const double c = spec.clamp;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < f; ++j) {
          const size_t gi = size_t(r * 2 * f + j), ui = gi + size_t(f);
          const double g = xv[gi], u = xv[ui], d = dv[size_t(r * f + j)];
          auto ref = [&](double gg, double uu) { return glu_ref(gg, uu, spec); };
          // Second-order one-sided difference of y(t) at 0, with steps s (signed) to the inside.
          auto one_sided = [&](auto y, double s) {
            return (-3 * y(0.0) + 4 * y(s) - y(2 * s)) / (2 * s);
          };
          // d/dgate: beyond the clamp 0; on it, from below; elsewhere central.
          if (c > 0 && g > c) {
            want[gi] = 0.0;
            EXPECT_EQ(got[gi], 0.0) << "gate " << g << " beyond the clamp";
          } else if (c > 0 && g == c) {
            want[gi] = d * one_sided([&](double t) { return ref(g + t, u); }, -h);
          } else {
            want[gi] = d * (ref(g + h, u) - ref(g - h, u)) / (2 * h);
          }
          // d/dup: beyond either bound 0; on one, from the inside; elsewhere central.
          if (c > 0 && std::fabs(u) > c) {
            want[ui] = 0.0;
            EXPECT_EQ(got[ui], 0.0) << "up " << u << " beyond the clamp";
          } else if (c > 0 && std::fabs(u) == c) {
            want[ui] = d * one_sided([&](double t) { return ref(g, u + t); }, u > 0 ? -h : h);
          } else {
            want[ui] = d * (ref(g, u + h) - ref(g, u - h)) / (2 * h);
          }
        }
      }
      EXPECT_TRUE(all_close(got, want, tol({2e-5, 1e-4}, {3e-2, 3e-2})));
      // The elements placed on the bounds pass a gradient (gate 7 of row 0, up 7 and -7 of row 1).
      if (c > 0) {
        EXPECT_NE(got[0], 0.0);
        EXPECT_NE(got[size_t(2 * f + f)], 0.0);
        EXPECT_NE(got[size_t(2 * f + f + 1)], 0.0);
      }
    }
  }
}

TEST_P(Glu, GptOssBackwardMatchesFiniteDifferencesOfTheOp) {
  // GPT-OSS's unit (quick gelu, clamp 7, offset 1) through the op's own forward.
  const ops::GluSpec spec{true, 7.0f, 1.0f};
  GradCheck g;
  g.inputs = {glu_input(4, 23, 21, 0.05)};
  g.wrt = {0};
  g.samples = 4 * 2 * 23;
  g.forward = [spec](const Tensors& in) {
    Tensor y = empty_as(in[0], {4, 23});
    ops::glu_forward(y, in[0], spec);
    return y;
  };
  g.backward = [spec](const Tensors& in, const Tensor& dy) {
    Tensor dx = empty_as(in[0], in[0].shape());
    ops::glu_backward(dx, dy, in[0], spec);
    return Tensors{dx};
  };
  // A central difference across a bound's kink sees half the slope: the elements placed on a
  // bound move off it (the test above covers them); every other one is 0.05 or more from one.
  float* p = g.inputs[0].data_ptr<float>();
  for (int64_t i = 0; i < g.inputs[0].numel(); ++i) {
    if (std::fabs(p[i]) == 7.0f) p[i] = p[i] > 0 ? 6.5f : -6.5f;
  }
  g.step = 1e-2;
  g.f32_tol = {3e-3, 3e-3};
  check_gradients(GetParam(), g);
}

BRAID_KERNEL_TEST_SUITE(Glu);

}  // namespace
}  // namespace braid::testing
