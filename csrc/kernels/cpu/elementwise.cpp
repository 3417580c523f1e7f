// Elementwise ops on the CPU: add, scale, cast, gelu (tanh approximation and exact), squared relu,
// sigmoid, gated linear units (SwiGLU, quick-GeGLU).
#include <cmath>
#include <cstring>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {
namespace {

constexpr int64_t kGrain = 1 << 15;  // elements below which a loop stays on one thread

// ---- add, scale ----

BRAID_CPU_MULTIVERSION void add_kernel(float* out, const float* a, const float* b, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

BRAID_CPU_MULTIVERSION void scale_kernel(float* out, const float* x, float alpha, float beta,
                                         int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = alpha * x[i] + beta;
}

// ---- cast ----

// Reads element i of a float tensor of any of the three float dtypes.
float load_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(p)[i];
    case DType::bf16:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default:
      return f16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

void store_float(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::f32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::bf16:
      static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
      break;
    default:
      static_cast<uint16_t*>(p)[i] = float_to_f16(v);
      break;
  }
}

// ---- gelu ----
// gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)   (HF "gelu_new")
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

BRAID_CPU_MULTIVERSION void gelu_forward_kernel(float* out, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i];
    float u = kSqrt2OverPi * (v + kGeluCoeff * v * v * v);
    out[i] = 0.5f * v * (1.0f + tanh_f32(u));
  }
}

BRAID_CPU_MULTIVERSION void squared_relu_forward_kernel(float* out, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float r = x[i] > 0.0f ? x[i] : 0.0f;
    out[i] = r * r;
  }
}

BRAID_CPU_MULTIVERSION void squared_relu_backward_kernel(float* dx, const float* dout,
                                                         const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dx[i] = dout[i] * 2.0f * (x[i] > 0.0f ? x[i] : 0.0f);
}

// d gelu / dx = 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx, du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
BRAID_CPU_MULTIVERSION void gelu_backward_kernel(float* dx, const float* dout, const float* x,
                                                 int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i];
    float u = kSqrt2OverPi * (v + kGeluCoeff * v * v * v);
    float t = tanh_f32(u);
    float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * v * v);
    dx[i] = dout[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
  }
}

// gelu_exact(x) = x Phi(x), Phi(x) = 0.5 (1 + erf(x / sqrt 2)); d/dx = Phi(x) + x phi(x),
// phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

void gelu_exact_forward_kernel(float* out, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * kInvSqrt2));
}

void gelu_exact_backward_kernel(float* dx, const float* dout, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float cdf = 0.5f * (1.0f + std::erf(v * kInvSqrt2));
    dx[i] = dout[i] * (cdf + v * kInvSqrt2Pi * std::exp(-0.5f * v * v));
  }
}

// ---- gated linear units ----
// Row of x: [gate (f) | up (f)]; out = act(g) (u + offset), act(g) = g sigmoid(alpha g) (silu:
// alpha 1; quick gelu: 1.702), with g, u the gate and up clamped (clamp > 0) or not.

struct Glu {
  float alpha, clamp, offset;  // clamp 0: none
  explicit Glu(const GluSpec& spec)
      : alpha(spec.quick_gelu ? 1.702f : 1.0f), clamp(spec.clamp), offset(spec.linear_offset) {}
  // Written as selects (a NaN stays NaN, as torch's clamp keeps it) so that the loops vectorise.
  float gate(float g) const { return clamp > 0.0f && g > clamp ? clamp : g; }
  float up(float u) const {
    if (clamp <= 0.0f) return u;
    return u < -clamp ? -clamp : (u > clamp ? clamp : u);
  }
  // torch's clamp backward: the gradient passes where the bounds hold, equality included.
  bool gate_passes(float g) const { return clamp <= 0.0f || g <= clamp; }
  bool up_passes(float u) const { return clamp <= 0.0f || (u >= -clamp && u <= clamp); }
};

BRAID_CPU_MULTIVERSION void glu_forward_row(float* __restrict out, const float* __restrict x,
                                            int64_t f, Glu glu) {
  const float* gate = x;
  const float* up = x + f;
#pragma omp simd
  for (int64_t j = 0; j < f; ++j) {
    const float g = glu.gate(gate[j]);
    out[j] = g * sigmoid_f32(glu.alpha * g) * (glu.up(up[j]) + glu.offset);
  }
}

// With s = sigmoid(alpha g): d act / dg = s (1 + alpha g (1 - s)); d/dup = dout act(g).
BRAID_CPU_MULTIVERSION void glu_backward_row(float* __restrict dx, const float* __restrict dout,
                                             const float* __restrict x, int64_t f, Glu glu) {
  const float* gate = x;
  const float* up = x + f;
#pragma omp simd
  for (int64_t j = 0; j < f; ++j) {
    const float g = glu.gate(gate[j]), u = glu.up(up[j]) + glu.offset;
    const float s = sigmoid_f32(glu.alpha * g);
    const float dg = dout[j] * u * s * (1.0f + glu.alpha * g * (1.0f - s));
    const float du = dout[j] * g * s;
    dx[j] = glu.gate_passes(gate[j]) ? dg : 0.0f;
    dx[f + j] = glu.up_passes(up[j]) ? du : 0.0f;
  }
}

}  // namespace

BRAID_CPU_MULTIVERSION void add_into(float* out, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] += x[i];
}

BRAID_CPU_MULTIVERSION float max_of(const float* x, int64_t n) {
  // 16 independent running maxima: a plain max-reduction over floats does not vectorise.
  constexpr int64_t kLanes = 16;
  float lanes[kLanes];
  for (float& l : lanes) l = -__builtin_inff();
  const int64_t full = n / kLanes * kLanes;
  for (int64_t i = 0; i < full; i += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = x[i + l] > lanes[l] ? x[i + l] : lanes[l];
  }
  float m = -__builtin_inff();
  for (float l : lanes) m = l > m ? l : m;
  for (int64_t i = full; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

void add(Tensor out, const Tensor& a, const Tensor& b, Stream) {
  float* o = out.data_ptr<float>();
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  parallel_for(out.numel(), kGrain,
               [&](int64_t i0, int64_t i1) { add_kernel(o + i0, pa + i0, pb + i0, i1 - i0); });
}

void scale(Tensor out, const Tensor& x, float alpha, float beta, Stream) {
  float* o = out.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  parallel_for(out.numel(), kGrain, [&](int64_t i0, int64_t i1) {
    scale_kernel(o + i0, px + i0, alpha, beta, i1 - i0);
  });
}

void cast(Tensor out, const Tensor& x, Stream) {
  if (out.dtype() == x.dtype()) {
    if (out.data() != x.data()) std::memmove(out.data(), x.data(), out.nbytes());
    return;
  }
  void* o = out.data();
  const void* px = x.data();
  DType to = out.dtype(), from = x.dtype();
  parallel_for(out.numel(), kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) store_float(o, to, i, load_float(px, from, i));
  });
}

void gelu_forward(Tensor out, const Tensor& x, Stream) {
  float* o = out.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  parallel_for(out.numel(), kGrain / 8,
               [&](int64_t i0, int64_t i1) { gelu_forward_kernel(o + i0, px + i0, i1 - i0); });
}

void gelu_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream) {
  float* d = dx.data_ptr<float>();
  const float* g = dout.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  parallel_for(dx.numel(), kGrain / 8, [&](int64_t i0, int64_t i1) {
    gelu_backward_kernel(d + i0, g + i0, px + i0, i1 - i0);
  });
}

void gelu_exact_forward(Tensor out, const Tensor& x, Stream) {
  float* o = out.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  parallel_for(out.numel(), kGrain / 8, [&](int64_t i0, int64_t i1) {
    gelu_exact_forward_kernel(o + i0, px + i0, i1 - i0);
  });
}

void gelu_exact_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream) {
  float* d = dx.data_ptr<float>();
  const float* g = dout.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  parallel_for(dx.numel(), kGrain / 8, [&](int64_t i0, int64_t i1) {
    gelu_exact_backward_kernel(d + i0, g + i0, px + i0, i1 - i0);
  });
}

void squared_relu_forward(Tensor out, const Tensor& x, Stream) {
  float* o = out.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  parallel_for(out.numel(), kGrain, [&](int64_t i0, int64_t i1) {
    squared_relu_forward_kernel(o + i0, px + i0, i1 - i0);
  });
}

void squared_relu_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream) {
  float* d = dx.data_ptr<float>();
  const float* g = dout.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  parallel_for(dx.numel(), kGrain, [&](int64_t i0, int64_t i1) {
    squared_relu_backward_kernel(d + i0, g + i0, px + i0, i1 - i0);
  });
}

void sigmoid_forward(Tensor out, const Tensor& x, Stream) {
  float* o = out.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  parallel_for(out.numel(), kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) o[i] = 1.0f / (1.0f + std::exp(-px[i]));
  });
}

void sigmoid_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream) {
  float* d = dx.data_ptr<float>();
  const float* g = dout.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  parallel_for(dx.numel(), kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float s = 1.0f / (1.0f + std::exp(-px[i]));
      d[i] = g[i] * s * (1.0f - s);
    }
  });
}

void glu_forward(Tensor out, const Tensor& x, const GluSpec& spec, Stream) {
  const int64_t f = out.size(-1), rows = out.numel() / f;
  const Glu glu(spec);
  float* o = out.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  parallel_for(rows, std::max<int64_t>(1, kGrain / 8 / f), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) glu_forward_row(o + r * f, px + r * 2 * f, f, glu);
  });
}

void glu_backward(Tensor dx, const Tensor& dout, const Tensor& x, const GluSpec& spec, Stream) {
  const int64_t f = dout.size(-1), rows = dout.numel() / f;
  const Glu glu(spec);
  float* d = dx.data_ptr<float>();
  const float* g = dout.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  parallel_for(rows, std::max<int64_t>(1, kGrain / 8 / f), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      glu_backward_row(d + r * 2 * f, g + r * f, px + r * 2 * f, f, glu);
    }
  });
}

}  // namespace braid::ops::cpu
