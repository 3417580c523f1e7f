// gelu (tanh form, HF "gelu_new"), the exact gelu (erf), squared relu, sigmoid and the gated
// linear units (SwiGLU, quick-GeGLU), forward and backward.

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/elementwise.cuh"

namespace braid::ops::cuda {
namespace {

using detail::from_float;
using detail::load_pack;
using detail::store_pack;
using detail::to_float;

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

struct GeluForwardOp {
  __device__ float operator()(float x, int64_t) const {
    float u = kSqrt2OverPi * (x + kGeluCoeff * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
  }
};

struct GeluBackwardOp {  // (dout, x)
  __device__ float operator()(float dout, float x, int64_t) const {
    float x2 = x * x;
    float u = kSqrt2OverPi * (x + kGeluCoeff * x2 * x);
    float t = tanhf(u);
    float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * x2);
    return dout * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du);
  }
};

constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

struct GeluExactForwardOp {
  __device__ float operator()(float x, int64_t) const {
    return 0.5f * x * (1.0f + erff(x * kInvSqrt2));
  }
};

struct GeluExactBackwardOp {  // (dout, x)
  __device__ float operator()(float dout, float x, int64_t) const {
    const float cdf = 0.5f * (1.0f + erff(x * kInvSqrt2));
    return dout * (cdf + x * kInvSqrt2Pi * expf(-0.5f * x * x));
  }
};

struct SquaredReluForwardOp {
  __device__ float operator()(float x, int64_t) const {
    const float r = fmaxf(x, 0.0f);
    return r * r;
  }
};

struct SquaredReluBackwardOp {  // (dout, x)
  __device__ float operator()(float dout, float x, int64_t) const {
    return dout * 2.0f * fmaxf(x, 0.0f);
  }
};

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

struct SigmoidForwardOp {
  __device__ float operator()(float x, int64_t) const { return sigmoid(x); }
};

struct SigmoidBackwardOp {  // (dout, x)
  __device__ float operator()(float dout, float x, int64_t) const {
    const float s = sigmoid(x);
    return dout * s * (1.0f - s);
  }
};

// A gated linear unit (ops::GluSpec): out = act(g) (u + offset), act(g) = g sigmoid(alpha g)
// (silu: alpha 1; quick gelu: 1.702), g and u the gate and up clamped when clamp > 0.
struct Glu {
  float alpha, clamp, offset;  // clamp 0: none
  // Selects rather than fminf / fmaxf: a NaN stays NaN, as torch's clamp keeps it.
  __device__ float gate(float g) const { return clamp > 0.0f && g > clamp ? clamp : g; }
  __device__ float up(float u) const {
    if (clamp <= 0.0f) return u;
    return u < -clamp ? -clamp : (u > clamp ? clamp : u);
  }
  // torch's clamp backward: the gradient passes where the bounds hold, equality included.
  __device__ bool gate_passes(float g) const { return clamp <= 0.0f || g <= clamp; }
  __device__ bool up_passes(float u) const { return clamp <= 0.0f || (u >= -clamp && u <= clamp); }
};

Glu glu_of(const GluSpec& spec) {
  return {spec.quick_gelu ? 1.702f : 1.0f, spec.clamp, spec.linear_offset};
}

// x [rows, 2F] = [gate | up]; out [rows, F]. V elements of one row per step.
template <int V, typename T>
__global__ void glu_forward_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t rows,
                                   int64_t f, Glu glu) {
  int64_t n = rows * f;
  int64_t stride = int64_t(gridDim.x) * blockDim.x * V;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n; i += stride) {
    int64_t r = i / f, c = i % f;
    const T* gate = x + r * 2 * f + c;
    float g[V], u[V], res[V];
    load_pack<V>(gate, g);
    load_pack<V>(gate + f, u);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float gc = glu.gate(g[k]);
      res[k] = gc * sigmoid(glu.alpha * gc) * (glu.up(u[k]) + glu.offset);
    }
    store_pack<V>(out + i, res);
  }
}

// With s = sigmoid(alpha g): d act / dg = s (1 + alpha g (1 - s)); d/dup = dout act(g).
template <int V, typename T>
__global__ void glu_backward_kernel(T* __restrict__ dx, const T* __restrict__ dout,
                                    const T* __restrict__ x, int64_t rows, int64_t f, Glu glu) {
  int64_t n = rows * f;
  int64_t stride = int64_t(gridDim.x) * blockDim.x * V;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n; i += stride) {
    int64_t r = i / f, c = i % f;
    int64_t gate_at = r * 2 * f + c;
    float g[V], u[V], d[V], dg[V], du[V];
    load_pack<V>(x + gate_at, g);
    load_pack<V>(x + gate_at + f, u);
    load_pack<V>(dout + i, d);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float gc = glu.gate(g[k]), uc = glu.up(u[k]) + glu.offset;
      const float s = sigmoid(glu.alpha * gc);
      dg[k] = glu.gate_passes(g[k]) ? d[k] * uc * s * (1.0f + glu.alpha * gc * (1.0f - s)) : 0.0f;
      du[k] = glu.up_passes(u[k]) ? d[k] * gc * s : 0.0f;
    }
    store_pack<V>(dx + gate_at, dg);
    store_pack<V>(dx + gate_at + f, du);
  }
}

// out = f(x) elementwise in x's dtype (Op: f).
template <typename Op>
void activation_forward(Tensor out, const Tensor& x, Stream stream, const char* name) {
  detail::DeviceGuard guard(out.device());
  detail::dispatch_activation(x.dtype(), name, [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::launch_map1(static_cast<T*>(out.data()), static_cast<const T*>(x.data()), out.numel(),
                        Op{}, detail::cuda_stream(stream), out.device().index);
  });
}

// dx = dout f'(x) elementwise (Op: (dout, x) -> dx).
template <typename Op>
void activation_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream,
                         const char* name) {
  detail::DeviceGuard guard(dx.device());
  detail::dispatch_activation(x.dtype(), name, [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::launch_map2(static_cast<T*>(dx.data()), static_cast<const T*>(dout.data()),
                        static_cast<const T*>(x.data()), dx.numel(), Op{},
                        detail::cuda_stream(stream), dx.device().index);
  });
}

}  // namespace

void gelu_forward(Tensor out, const Tensor& x, Stream stream) {
  activation_forward<GeluForwardOp>(out, x, stream, "gelu_forward");
}

void gelu_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream) {
  activation_backward<GeluBackwardOp>(dx, dout, x, stream, "gelu_backward");
}

void gelu_exact_forward(Tensor out, const Tensor& x, Stream stream) {
  activation_forward<GeluExactForwardOp>(out, x, stream, "gelu_exact_forward");
}

void gelu_exact_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream) {
  activation_backward<GeluExactBackwardOp>(dx, dout, x, stream, "gelu_exact_backward");
}

void squared_relu_forward(Tensor out, const Tensor& x, Stream stream) {
  activation_forward<SquaredReluForwardOp>(out, x, stream, "squared_relu_forward");
}

void squared_relu_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream) {
  activation_backward<SquaredReluBackwardOp>(dx, dout, x, stream, "squared_relu_backward");
}

void sigmoid_forward(Tensor out, const Tensor& x, Stream stream) {
  activation_forward<SigmoidForwardOp>(out, x, stream, "sigmoid_forward");
}

void sigmoid_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream) {
  activation_backward<SigmoidBackwardOp>(dx, dout, x, stream, "sigmoid_backward");
}

void glu_forward(Tensor out, const Tensor& x, const GluSpec& spec, Stream stream) {
  detail::DeviceGuard guard(out.device());
  int64_t f = out.size(-1), rows = out.numel() / f;
  cudaStream_t s = detail::cuda_stream(stream);
  int device = out.device().index;
  const Glu glu = glu_of(spec);
  constexpr int kThreads = detail::kMapThreads;
  detail::dispatch_activation(x.dtype(), "glu_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out.data());
    const T* in = static_cast<const T*>(x.data());
    if (detail::pack_width<T>(f, {o, in}) > 1) {
      constexpr int V = detail::kPack<T>;
      glu_forward_kernel<V, T>
          <<<detail::grid_for(rows * f / V, kThreads, device), kThreads, 0, s>>>(o, in, rows, f,
                                                                                 glu);
    } else {
      glu_forward_kernel<1, T>
          <<<detail::grid_for(rows * f, kThreads, device), kThreads, 0, s>>>(o, in, rows, f, glu);
    }
    CUDA_CHECK_LAUNCH();
  });
}

void glu_backward(Tensor dx, const Tensor& dout, const Tensor& x, const GluSpec& spec,
                  Stream stream) {
  detail::DeviceGuard guard(dx.device());
  int64_t f = dout.size(-1), rows = dout.numel() / f;
  cudaStream_t s = detail::cuda_stream(stream);
  int device = dx.device().index;
  const Glu glu = glu_of(spec);
  constexpr int kThreads = detail::kMapThreads;
  detail::dispatch_activation(x.dtype(), "glu_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* d = static_cast<T*>(dx.data());
    const T* g = static_cast<const T*>(dout.data());
    const T* in = static_cast<const T*>(x.data());
    if (detail::pack_width<T>(f, {d, g, in}) > 1) {
      constexpr int V = detail::kPack<T>;
      glu_backward_kernel<V, T>
          <<<detail::grid_for(rows * f / V, kThreads, device), kThreads, 0, s>>>(d, g, in, rows, f,
                                                                                 glu);
    } else {
      glu_backward_kernel<1, T><<<detail::grid_for(rows * f, kThreads, device), kThreads, 0, s>>>(
          d, g, in, rows, f, glu);
    }
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace braid::ops::cuda
