// layernorm and rmsnorm, forward and backward. One warp per row (f32 statistics, two passes
// over the row for the variance); the weight and bias gradients are deterministic column
// sums (column_reduce.cuh) added into the f32 gradient buffers.

#include "kernels/cuda/column_reduce.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace braid::ops::cuda {
namespace {

using detail::load_pack;
using detail::store_pack;
using detail::to_float;
using detail::warp_sum;

constexpr int kNormThreads = 256;
constexpr int kRowsPerBlock = kNormThreads / 32;

// Warp-per-row loop: `row` is this warp's row, `lane` its lane; the row's elements are
// visited V at a time starting at lane * V.
#define BRAID_FOR_ROWS(rows)                                                               \
  for (int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32; row < (rows); \
       row += int64_t(gridDim.x) * kRowsPerBlock)

// ---- layernorm: y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var + eps), biased var

template <int V, typename T>
__global__ void layernorm_forward_kernel(T* __restrict__ out, float* __restrict__ mean,
                                         float* __restrict__ rstd, const T* __restrict__ x,
                                         const T* __restrict__ weight, const T* __restrict__ bias,
                                         int64_t rows, int64_t c, float eps) {
  const int lane = threadIdx.x % 32;
  BRAID_FOR_ROWS(rows) {
    const T* xr = x + row * c;
    float sum = 0.0f;
    for (int64_t j = lane * V; j < c; j += 32 * V) {
      float v[V];
      load_pack<V>(xr + j, v);
#pragma unroll
      for (int k = 0; k < V; ++k) sum += v[k];
    }
    const float mu = warp_sum(sum) / float(c);
    float sq = 0.0f;
    for (int64_t j = lane * V; j < c; j += 32 * V) {
      float v[V];
      load_pack<V>(xr + j, v);
#pragma unroll
      for (int k = 0; k < V; ++k) sq += (v[k] - mu) * (v[k] - mu);
    }
    const float rs = 1.0f / sqrtf(warp_sum(sq) / float(c) + eps);
    T* yr = out + row * c;
    for (int64_t j = lane * V; j < c; j += 32 * V) {
      float v[V], w[V], b[V];
      load_pack<V>(xr + j, v);
      load_pack<V>(weight + j, w);
      load_pack<V>(bias + j, b);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = (v[k] - mu) * rs * w[k] + b[k];
      store_pack<V>(yr + j, v);
    }
    if (lane == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w, xhat = (x - mean) * rstd
template <int V, typename T>
__global__ void layernorm_backward_kernel(T* __restrict__ dx, const T* __restrict__ dout,
                                          const T* __restrict__ x, const T* __restrict__ weight,
                                          const float* __restrict__ mean,
                                          const float* __restrict__ rstd, int64_t rows, int64_t c) {
  const int lane = threadIdx.x % 32;
  BRAID_FOR_ROWS(rows) {
    const T* xr = x + row * c;
    const T* dyr = dout + row * c;
    const float mu = mean[row], rs = rstd[row];
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int64_t j = lane * V; j < c; j += 32 * V) {
      float v[V], dy[V], w[V];
      load_pack<V>(xr + j, v);
      load_pack<V>(dyr + j, dy);
      load_pack<V>(weight + j, w);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float g = dy[k] * w[k];
        sum_g += g;
        sum_gx += g * (v[k] - mu) * rs;
      }
    }
    const float mean_g = warp_sum(sum_g) / float(c);
    const float mean_gx = warp_sum(sum_gx) / float(c);
    T* dxr = dx + row * c;
    for (int64_t j = lane * V; j < c; j += 32 * V) {
      float v[V], dy[V], w[V];
      load_pack<V>(xr + j, v);
      load_pack<V>(dyr + j, dy);
      load_pack<V>(weight + j, w);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float xhat = (v[k] - mu) * rs;
        v[k] = rs * (dy[k] * w[k] - mean_g - xhat * mean_gx);
      }
      store_pack<V>(dxr + j, v);
    }
  }
}

// dweight += sum_r dy * xhat, dbias += sum_r dy
template <typename T>
struct LayernormParamGrads {
  const T* dout;
  const T* x;
  const float* mean;
  const float* rstd;
  int64_t c;
  __device__ void operator()(int64_t r, int64_t j, float (&v)[2]) const {
    float dy = to_float(dout[r * c + j]);
    v[0] = dy * (to_float(x[r * c + j]) - mean[r]) * rstd[r];
    v[1] = dy;
  }
};

// ---- rmsnorm: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps)

template <int V, typename T>
__global__ void rmsnorm_forward_kernel(T* __restrict__ out, float* __restrict__ rstd,
                                       const T* __restrict__ x, const T* __restrict__ weight,
                                       int64_t rows, int64_t c, float eps) {
  const int lane = threadIdx.x % 32;
  BRAID_FOR_ROWS(rows) {
    const T* xr = x + row * c;
    float sq = 0.0f;
    for (int64_t j = lane * V; j < c; j += 32 * V) {
      float v[V];
      load_pack<V>(xr + j, v);
#pragma unroll
      for (int k = 0; k < V; ++k) sq += v[k] * v[k];
    }
    const float rs = 1.0f / sqrtf(warp_sum(sq) / float(c) + eps);
    T* yr = out + row * c;
    for (int64_t j = lane * V; j < c; j += 32 * V) {
      float v[V], w[V];
      load_pack<V>(xr + j, v);
      load_pack<V>(weight + j, w);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = v[k] * rs * w[k];
      store_pack<V>(yr + j, v);
    }
    if (lane == 0) rstd[row] = rs;
  }
}

// dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x * rstd
template <int V, typename T>
__global__ void rmsnorm_backward_kernel(T* __restrict__ dx, const T* __restrict__ dout,
                                        const T* __restrict__ x, const T* __restrict__ weight,
                                        const float* __restrict__ rstd, int64_t rows, int64_t c) {
  const int lane = threadIdx.x % 32;
  BRAID_FOR_ROWS(rows) {
    const T* xr = x + row * c;
    const T* dyr = dout + row * c;
    const float rs = rstd[row];
    float sum_gx = 0.0f;
    for (int64_t j = lane * V; j < c; j += 32 * V) {
      float v[V], dy[V], w[V];
      load_pack<V>(xr + j, v);
      load_pack<V>(dyr + j, dy);
      load_pack<V>(weight + j, w);
#pragma unroll
      for (int k = 0; k < V; ++k) sum_gx += dy[k] * w[k] * v[k] * rs;
    }
    const float mean_gx = warp_sum(sum_gx) / float(c);
    T* dxr = dx + row * c;
    for (int64_t j = lane * V; j < c; j += 32 * V) {
      float v[V], dy[V], w[V];
      load_pack<V>(xr + j, v);
      load_pack<V>(dyr + j, dy);
      load_pack<V>(weight + j, w);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = rs * (dy[k] * w[k] - v[k] * rs * mean_gx);
      store_pack<V>(dxr + j, v);
    }
  }
}

// dweight += sum_r dy * x * rstd
template <typename T>
struct RmsnormParamGrad {
  const T* dout;
  const T* x;
  const float* rstd;
  int64_t c;
  __device__ void operator()(int64_t r, int64_t j, float (&v)[1]) const {
    v[0] = to_float(dout[r * c + j]) * to_float(x[r * c + j]) * rstd[r];
  }
};

#undef BRAID_FOR_ROWS

// Launches kernel<V or 1, T> over `rows` rows of `c` elements, V = a 16-byte pack when every
// pointer allows it.
template <typename T, typename Launch>
void launch_rows(int64_t rows, int64_t c, std::initializer_list<const void*> pointers,
                 Device device, Launch&& launch) {
  unsigned blocks = detail::grid_for(rows * 32, kNormThreads, device.index);
  if (detail::pack_width<T>(c, pointers) > 1) {
    launch(std::integral_constant<int, detail::kPack<T>>{}, blocks);
  } else {
    launch(std::integral_constant<int, 1>{}, blocks);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, const Tensor& x, const Tensor& weight,
                       const Tensor& bias, float eps, Stream stream) {
  detail::DeviceGuard guard(x.device());
  const int64_t c = x.size(-1), rows = x.numel() / c;
  cudaStream_t s = detail::cuda_stream(stream);
  detail::dispatch_activation(x.dtype(), "layernorm_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out.data());
    const T* px = static_cast<const T*>(x.data());
    const T* w = static_cast<const T*>(weight.data());
    const T* b = static_cast<const T*>(bias.data());
    launch_rows<T>(rows, c, {o, px, w, b}, x.device(), [&](auto v, unsigned blocks) {
      layernorm_forward_kernel<decltype(v)::value, T><<<blocks, kNormThreads, 0, s>>>(
          o, mean.data_ptr<float>(), rstd.data_ptr<float>(), px, w, b, rows, c, eps);
    });
  });
}

void layernorm_backward(Tensor dx, Tensor dweight, Tensor dbias, const Tensor& dout,
                        const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, Stream stream) {
  detail::DeviceGuard guard(x.device());
  const int64_t c = x.size(-1), rows = x.numel() / c;
  cudaStream_t s = detail::cuda_stream(stream);
  const float* mu = mean.data_ptr<float>();
  const float* rs = rstd.data_ptr<float>();
  detail::dispatch_activation(x.dtype(), "layernorm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* d = static_cast<T*>(dx.data());
    const T* dy = static_cast<const T*>(dout.data());
    const T* px = static_cast<const T*>(x.data());
    const T* w = static_cast<const T*>(weight.data());
    // Parameter gradients first: they read dout and x, which dx may overwrite.
    detail::column_sums_add<2>({{dweight.data_ptr<float>(), dbias.data_ptr<float>()}}, rows, c,
                               LayernormParamGrads<T>{dy, px, mu, rs, c}, x.device(), s);
    launch_rows<T>(rows, c, {d, dy, px, w}, x.device(), [&](auto v, unsigned blocks) {
      layernorm_backward_kernel<decltype(v)::value, T>
          <<<blocks, kNormThreads, 0, s>>>(d, dy, px, w, mu, rs, rows, c);
    });
  });
}

void rmsnorm_forward(Tensor out, Tensor rstd, const Tensor& x, const Tensor& weight, float eps,
                     Stream stream) {
  detail::DeviceGuard guard(x.device());
  const int64_t c = x.size(-1), rows = x.numel() / c;
  cudaStream_t s = detail::cuda_stream(stream);
  detail::dispatch_activation(x.dtype(), "rmsnorm_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out.data());
    const T* px = static_cast<const T*>(x.data());
    const T* w = static_cast<const T*>(weight.data());
    launch_rows<T>(rows, c, {o, px, w}, x.device(), [&](auto v, unsigned blocks) {
      rmsnorm_forward_kernel<decltype(v)::value, T>
          <<<blocks, kNormThreads, 0, s>>>(o, rstd.data_ptr<float>(), px, w, rows, c, eps);
    });
  });
}

void rmsnorm_backward(Tensor dx, Tensor dweight, const Tensor& dout, const Tensor& x,
                      const Tensor& weight, const Tensor& rstd, Stream stream) {
  detail::DeviceGuard guard(x.device());
  const int64_t c = x.size(-1), rows = x.numel() / c;
  cudaStream_t s = detail::cuda_stream(stream);
  const float* rs = rstd.data_ptr<float>();
  detail::dispatch_activation(x.dtype(), "rmsnorm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* d = static_cast<T*>(dx.data());
    const T* dy = static_cast<const T*>(dout.data());
    const T* px = static_cast<const T*>(x.data());
    const T* w = static_cast<const T*>(weight.data());
    detail::column_sums_add<1>({{dweight.data_ptr<float>()}}, rows, c,
                               RmsnormParamGrad<T>{dy, px, rs, c}, x.device(), s);
    launch_rows<T>(rows, c, {d, dy, px, w}, x.device(), [&](auto v, unsigned blocks) {
      rmsnorm_backward_kernel<decltype(v)::value, T>
          <<<blocks, kNormThreads, 0, s>>>(d, dy, px, w, rs, rows, c);
    });
  });
}

}  // namespace braid::ops::cuda
