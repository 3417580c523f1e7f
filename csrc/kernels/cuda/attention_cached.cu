// Attention of a few new queries over a KV cache (inference). One warp per softmax row
// (batch, query, head): the lanes take 32 keys at a time straight from the cache (one key per
// lane), keep an online softmax, and own the output columns lane, lane + 32, ...; a head's sink
// (when there are sinks) joins the softmax's denominator as a last step. f32 arithmetic
// throughout; correctness first - decoding reads each key once per row.

#include <type_traits>

#include "braid/core/error.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace braid::ops::cuda {
namespace {

using detail::from_float;
using detail::kFullMask;
using detail::to_float;
using detail::warp_max;
using detail::warp_sum;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxHeadDim = 256;

struct CachedDims {
  int64_t b, sq, hq, hkv, capacity, length, window;  // window: -1 or >= 0
  int d;
  float scale;
};

// grid: ceil(rows / kWarps) blocks; warp w of block x owns row x * kWarps + w, where row
// (batch * Sq + i) * Hq + head indexes q and out as [rows, D].
template <int kChunks, typename T>
__global__ void __launch_bounds__(kThreads)
    attention_cached_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k,
                            const T* __restrict__ v, const T* __restrict__ sinks, CachedDims m) {
  __shared__ float q_shared[kWarps][kMaxHeadDim];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row = int64_t(blockIdx.x) * kWarps + warp;
  if (row >= m.b * m.sq * m.hq) return;  // warp-uniform; the kernel has no block barrier
  const int64_t head = row % m.hq, i = (row / m.hq) % m.sq, batch = row / (m.hq * m.sq);
  const int64_t kvh = head / (m.hq / m.hkv);
  const int64_t last = m.length - m.sq + i;  // keys [first, last] are visible
  const int64_t first = m.window < 0 || last < m.window ? 0 : last - m.window;
  const int d = m.d;
  float* q_s = q_shared[warp];
  for (int dd = lane; dd < d; dd += 32) q_s[dd] = m.scale * to_float(q[row * d + dd]);
  __syncwarp();

  const int64_t key_stride = m.hkv * d;
  const T* k_base = k + (batch * m.capacity * m.hkv + kvh) * d;
  const T* v_base = v + (batch * m.capacity * m.hkv + kvh) * d;
  float mx = -INFINITY, l = 0.0f, acc[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) acc[c] = 0.0f;
  for (int64_t j0 = first; j0 <= last; j0 += 32) {
    const int64_t j = j0 + lane;
    const bool visible = j <= last;
    float s = -INFINITY;
    if (visible) {
      const T* key = k_base + j * key_stride;
      s = 0.0f;
      for (int dd = 0; dd < d; ++dd) s += q_s[dd] * to_float(key[dd]);
    }
    const float m_new = fmaxf(mx, warp_max(s));  // finite: key `first` is visible
    const float p = visible ? expf(s - m_new) : 0.0f;
    const float correction = expf(mx - m_new);  // 0 on the first tile
    l = l * correction + warp_sum(p);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) acc[c] *= correction;
    const int n = last - j0 + 1 < 32 ? int(last - j0 + 1) : 32;  // warp-uniform
    for (int jj = 0; jj < n; ++jj) {
      const float w = __shfl_sync(kFullMask, p, jj);
      const T* value = v_base + (j0 + jj) * key_stride;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int dd = lane + 32 * c;
        if (dd < d) acc[c] += w * to_float(value[dd]);
      }
    }
    mx = m_new;
  }
  if (sinks != nullptr) {  // one more logit in the denominator, weighing no value
    const float sink = to_float(sinks[head]);
    const float m_new = fmaxf(mx, sink);
    const float correction = expf(mx - m_new);
    l = l * correction + expf(sink - m_new);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) acc[c] *= correction;
  }
  const float inv = 1.0f / l;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int dd = lane + 32 * c;
    if (dd < d) out[row * d + dd] = from_float<T>(acc[c] * inv);
  }
}

template <typename F>
void dispatch_chunks(int d, F&& f) {
  if (d <= 32) {
    f(std::integral_constant<int, 1>{});
  } else if (d <= 64) {
    f(std::integral_constant<int, 2>{});
  } else if (d <= 128) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

}  // namespace

void attention_cached_forward(Tensor out, const Tensor& q, const Tensor& k_cache,
                              const Tensor& v_cache, int64_t length, int64_t window,
                              const Tensor& sinks, Stream stream) {
  detail::DeviceGuard guard(q.device());
  cudaStream_t s = detail::cuda_stream(stream);
  const CachedDims m{q.size(0),       q.size(1),       q.size(2),
                     k_cache.size(2), k_cache.size(1), length,
                     window,          int(q.size(3)),  1.0f / sqrtf(float(q.size(3)))};
  BRAID_CHECK(m.d <= kMaxHeadDim, "attention_cached_forward: head dim ", m.d, " exceeds ",
              kMaxHeadDim);
  const int64_t blocks = detail::ceil_div(m.b * m.sq * m.hq, kWarps);
  BRAID_CHECK(blocks <= INT32_MAX, "attention_cached_forward: ", m.b * m.sq * m.hq,
              " rows exceed the grid");
  detail::dispatch_activation(q.dtype(), "attention_cached_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_chunks(m.d, [&](auto chunks) {
      attention_cached_kernel<decltype(chunks)::value, T><<<unsigned(blocks), kThreads, 0, s>>>(
          static_cast<T*>(out.data()), static_cast<const T*>(q.data()),
          static_cast<const T*>(k_cache.data()), static_cast<const T*>(v_cache.data()),
          sinks.defined() ? static_cast<const T*>(sinks.data()) : nullptr, m);
      CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace braid::ops::cuda
