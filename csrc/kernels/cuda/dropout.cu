// Inverted dropout. The mask is the CPU's (csrc/kernels/cpu/dropout.cpp): element e (of the
// larger tensor: first_element + i) is kept iff uniform_from_word(word e % 4 of
// random_words(seed, offset, e / 4)) > p, and kept elements are multiplied by 1 / (1 - p). One
// thread per group of four, so each Philox call serves four elements, as on the CPU.

#include "braid/core/philox.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/elementwise.cuh"

namespace braid::ops::cuda {
namespace {

using detail::from_float;
using detail::to_float;

__device__ __forceinline__ float dropout_element(float x, uint32_t word, float p, float scale) {
  return philox::uniform_from_word(word) > p ? x * scale : 0.0f;
}

// Group g holds elements [4g - lead, 4g - lead + 4) of x (lead: first_element % 4). kPacked:
// lead is 0 and x and out are aligned to four elements, so full groups move as one pack.
template <bool kPacked, typename T>
__global__ void dropout_kernel(T* out, const T* x, int64_t n, float p, float scale, uint64_t seed,
                               uint64_t offset, uint64_t first_group, int lead) {
  int64_t groups = (lead + n + 3) / 4;
  int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
    philox::Words4 w = philox::random_words(seed, offset, first_group + uint64_t(g));
    int64_t i0 = 4 * g - lead;
    if (kPacked && i0 + 4 <= n) {
      float v[4];
      detail::load_pack<4>(x + i0, v);
#pragma unroll
      for (int l = 0; l < 4; ++l) v[l] = dropout_element(v[l], w.x[l], p, scale);
      detail::store_pack<4>(out + i0, v);
    } else {
      for (int l = 0; l < 4 && i0 + l < n; ++l) {
        if (i0 + l < 0) continue;
        out[i0 + l] = from_float<T>(dropout_element(to_float(x[i0 + l]), w.x[l], p, scale));
      }
    }
  }
}

void dropout(const Tensor& out, const Tensor& x, float p, uint64_t seed, uint64_t offset,
             int64_t first_element, Stream stream, const char* op) {
  const uint64_t first_group = uint64_t(first_element / 4);
  const int lead = int(first_element % 4);
  detail::DeviceGuard guard(out.device());
  const float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  const int64_t n = out.numel();
  cudaStream_t s = detail::cuda_stream(stream);
  unsigned blocks = detail::grid_for((lead + n + 3) / 4, detail::kMapThreads, out.device().index);
  detail::dispatch_activation(x.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out.data());
    const T* in = static_cast<const T*>(x.data());
    if (lead == 0 && detail::aligned_to(o, 4 * sizeof(T)) &&
        detail::aligned_to(in, 4 * sizeof(T))) {
      dropout_kernel<true><<<blocks, detail::kMapThreads, 0, s>>>(o, in, n, p, scale, seed, offset,
                                                                  first_group, lead);
    } else {
      dropout_kernel<false><<<blocks, detail::kMapThreads, 0, s>>>(o, in, n, p, scale, seed, offset,
                                                                   first_group, lead);
    }
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void dropout_forward(Tensor out, const Tensor& x, float p, uint64_t seed, uint64_t offset,
                     int64_t first_element, Stream stream) {
  dropout(out, x, p, seed, offset, first_element, stream, "dropout_forward");
}

void dropout_backward(Tensor dx, const Tensor& dout, float p, uint64_t seed, uint64_t offset,
                      int64_t first_element, Stream stream) {
  // d out / d x is the same mask and scale.
  dropout(dx, dout, p, seed, offset, first_element, stream, "dropout_backward");
}

}  // namespace braid::ops::cuda
