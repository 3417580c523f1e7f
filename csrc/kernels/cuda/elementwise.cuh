#pragma once
// Internal: elementwise map kernels. out[i] = op(x[i], i) or op(a[i], b[i], i), in f32,
// with 16-byte vector packs when the sizes and pointers allow. `op` is a functor with a
// __device__ operator(); out may alias an input (each element is read, then written, by one
// thread).

#include <algorithm>

#include "kernels/cuda/common.cuh"

namespace braid::ops::cuda::detail {

constexpr int kMapThreads = 256;

template <int V, typename TOut, typename TIn, typename Op>
__global__ void map1_kernel(TOut* out, const TIn* x, int64_t n, Op op) {
  int64_t stride = int64_t(gridDim.x) * blockDim.x * V;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n; i += stride) {
    if (i + V <= n) {
      float in[V], res[V];
      load_pack<V>(x + i, in);
#pragma unroll
      for (int k = 0; k < V; ++k) res[k] = op(in[k], i + k);
      store_pack<V>(out + i, res);
    } else {
      for (int64_t j = i; j < n; ++j) out[j] = from_float<TOut>(op(to_float(x[j]), j));
    }
  }
}

template <int V, typename T, typename Op>
__global__ void map2_kernel(T* out, const T* a, const T* b, int64_t n, Op op) {
  int64_t stride = int64_t(gridDim.x) * blockDim.x * V;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n; i += stride) {
    if (i + V <= n) {
      float va[V], vb[V], res[V];
      load_pack<V>(a + i, va);
      load_pack<V>(b + i, vb);
#pragma unroll
      for (int k = 0; k < V; ++k) res[k] = op(va[k], vb[k], i + k);
      store_pack<V>(out + i, res);
    } else {
      for (int64_t j = i; j < n; ++j) out[j] = from_float<T>(op(to_float(a[j]), to_float(b[j]), j));
    }
  }
}

inline bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

template <typename TOut, typename TIn, typename Op>
void launch_map1(TOut* out, const TIn* x, int64_t n, Op op, cudaStream_t stream, int device) {
  constexpr int V = std::min(kPack<TOut>, kPack<TIn>);
  if (n % V == 0 && aligned_to(out, V * sizeof(TOut)) && aligned_to(x, V * sizeof(TIn))) {
    map1_kernel<V><<<grid_for(n / V, kMapThreads, device), kMapThreads, 0, stream>>>(out, x, n, op);
  } else {
    map1_kernel<1><<<grid_for(n, kMapThreads, device), kMapThreads, 0, stream>>>(out, x, n, op);
  }
  CUDA_CHECK_LAUNCH();
}

template <typename T, typename Op>
void launch_map2(T* out, const T* a, const T* b, int64_t n, Op op, cudaStream_t stream,
                 int device) {
  constexpr int V = kPack<T>;
  if (n % V == 0 && aligned16(out) && aligned16(a) && aligned16(b)) {
    map2_kernel<V>
        <<<grid_for(n / V, kMapThreads, device), kMapThreads, 0, stream>>>(out, a, b, n, op);
  } else {
    map2_kernel<1><<<grid_for(n, kMapThreads, device), kMapThreads, 0, stream>>>(out, a, b, n, op);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace braid::ops::cuda::detail
