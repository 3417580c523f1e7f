// Column copies (multi-latent attention's [no-rope | rope] heads): a block of columns from one
// [R, C] tensor into another, one [R, W] tensor into the same channels of every head of an
// [R, H, D] tensor, and the sum over heads that is its backward. One grid-stride kernel each,
// a thread per element written.

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace braid::ops::cuda {
namespace {

constexpr int kThreads = 256;

// dst[r, j] = src[r, j] for j < width; dst and src point at their first copied column and step
// cd and cs between rows.
template <typename T>
__global__ void copy_columns_kernel(T* __restrict__ dst, const T* __restrict__ src, int64_t rows,
                                    int64_t width, int64_t cd, int64_t cs) {
  const int64_t n = rows * width, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / width, j = i % width;
    dst[r * cd + j] = src[r * cs + j];
  }
}

// out[r, h, j] = x[r, j] for j < w; out points at the first written channel of [R, H, D].
template <typename T>
__global__ void broadcast_heads_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t rows,
                                       int64_t h, int64_t d, int64_t w) {
  const int64_t n = rows * h * w, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t row_head = i / w, j = i % w;
    out[row_head * d + j] = x[(row_head / h) * w + j];
  }
}

// dx[r, j] = sum over heads of dout[r, h, j], in f32 in head order (as the CPU sums);
// dout points at the first summed channel of [R, H, D].
template <typename T>
__global__ void sum_heads_kernel(T* __restrict__ dx, const T* __restrict__ dout, int64_t rows,
                                 int64_t h, int64_t d, int64_t w) {
  const int64_t n = rows * w, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / w, j = i % w;
    float sum = 0.0f;
    for (int64_t head = 0; head < h; ++head) sum += detail::to_float(dout[(r * h + head) * d + j]);
    dx[i] = detail::from_float<T>(sum);
  }
}

}  // namespace

void copy_columns(Tensor dst, int64_t dst_column, const Tensor& src, int64_t src_column,
                  int64_t width, Stream stream) {
  detail::DeviceGuard guard(dst.device());
  const int64_t rows = src.size(0);
  detail::dispatch_activation(src.dtype(), "copy_columns", [&](auto tag) {
    using T = typename decltype(tag)::type;
    copy_columns_kernel<T><<<detail::grid_for(rows * width, kThreads, dst.device().index), kThreads,
                             0, detail::cuda_stream(stream)>>>(
        static_cast<T*>(dst.data()) + dst_column, static_cast<const T*>(src.data()) + src_column,
        rows, width, dst.size(1), src.size(1));
    CUDA_CHECK_LAUNCH();
  });
}

void broadcast_heads(Tensor out, int64_t column, const Tensor& x, Stream stream) {
  detail::DeviceGuard guard(out.device());
  const int64_t rows = out.size(0), h = out.size(1), d = out.size(2), w = x.size(1);
  detail::dispatch_activation(x.dtype(), "broadcast_heads", [&](auto tag) {
    using T = typename decltype(tag)::type;
    broadcast_heads_kernel<T><<<detail::grid_for(rows * h * w, kThreads, out.device().index),
                                kThreads, 0, detail::cuda_stream(stream)>>>(
        static_cast<T*>(out.data()) + column, static_cast<const T*>(x.data()), rows, h, d, w);
    CUDA_CHECK_LAUNCH();
  });
}

void sum_heads(Tensor dx, const Tensor& dout, int64_t column, Stream stream) {
  detail::DeviceGuard guard(dx.device());
  const int64_t rows = dx.size(0), h = dout.size(1), d = dout.size(2), w = dx.size(1);
  detail::dispatch_activation(dx.dtype(), "sum_heads", [&](auto tag) {
    using T = typename decltype(tag)::type;
    // With no heads dout may hold no memory; the kernel then reads nothing.
    const T* first = h > 0 ? static_cast<const T*>(dout.data()) + column : nullptr;
    sum_heads_kernel<T>
        <<<detail::grid_for(rows * w, kThreads, dx.device().index), kThreads, 0,
           detail::cuda_stream(stream)>>>(static_cast<T*>(dx.data()), first, rows, h, d, w);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace braid::ops::cuda
