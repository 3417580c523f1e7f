// add, scale, cast: elementwise maps in f32 (kernels in elementwise.cuh).

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/elementwise.cuh"

namespace braid::ops::cuda {
namespace {

struct AddOp {
  __device__ float operator()(float a, float b, int64_t) const { return a + b; }
};

struct ScaleOp {
  float alpha, beta;
  __device__ float operator()(float x, int64_t) const { return alpha * x + beta; }
};

struct IdentityOp {
  __device__ float operator()(float x, int64_t) const { return x; }
};

}  // namespace

void add(Tensor out, const Tensor& a, const Tensor& b, Stream stream) {
  detail::DeviceGuard guard(out.device());
  detail::dispatch_activation(out.dtype(), "add", [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::launch_map2(static_cast<T*>(out.data()), static_cast<const T*>(a.data()),
                        static_cast<const T*>(b.data()), out.numel(), AddOp{},
                        detail::cuda_stream(stream), out.device().index);
  });
}

void scale(Tensor out, const Tensor& x, float alpha, float beta, Stream stream) {
  detail::DeviceGuard guard(out.device());
  detail::dispatch_activation(out.dtype(), "scale", [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::launch_map1(static_cast<T*>(out.data()), static_cast<const T*>(x.data()), out.numel(),
                        ScaleOp{alpha, beta}, detail::cuda_stream(stream), out.device().index);
  });
}

void cast(Tensor out, const Tensor& x, Stream stream) {
  detail::DeviceGuard guard(out.device());
  cudaStream_t s = detail::cuda_stream(stream);
  if (out.dtype() == x.dtype()) {
    if (out.data() != x.data())
      CUDA_CHECK(cudaMemcpyAsync(out.data(), x.data(), out.nbytes(), cudaMemcpyDeviceToDevice, s));
    return;
  }
  detail::dispatch_floating(out.dtype(), "cast", [&](auto out_tag) {
    using TOut = typename decltype(out_tag)::type;
    detail::dispatch_floating(x.dtype(), "cast", [&](auto in_tag) {
      using TIn = typename decltype(in_tag)::type;
      detail::launch_map1(static_cast<TOut*>(out.data()), static_cast<const TIn*>(x.data()),
                          out.numel(), IdentityOp{}, s, out.device().index);
    });
  });
}

}  // namespace braid::ops::cuda
