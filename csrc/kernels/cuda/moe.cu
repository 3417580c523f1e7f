// Mixture of experts: top-k routing and its gradient (a warp per token), the token dispatch
// gather and the weighted combine of the experts' outputs with its weight gradient. No atomics:
// every sum runs in a fixed order, so each result is the same on every run. Row indices outside
// their tensor (the CPU rejects them) read zero rows rather than fault.

#include <algorithm>
#include <type_traits>

#include "kernels/cuda/column_reduce.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace braid::ops::cuda {
namespace {

using detail::load_pack;
using detail::store_pack;
using detail::warp_max;
using detail::warp_sum;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxExperts = 1024;  // 32 per lane: one bit each in the routing's taken mask

// Warp-per-item loop: `item` is this warp's item.
#define BRAID_FOR_WARP_ITEMS(item, count)                                              \
  for (int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; item < (count); \
       item += int64_t(gridDim.x) * kWarps)

// ---- routing

// Selection key of logit x of expert e: a larger key wins, equal logits go to the lower expert.
// Float order on the high 32 bits (-0 counts as +0, NaN as -inf, so the order is total) and
// ~e on the low bits. Every key is > 0, so 0 is "no candidate".
__device__ __forceinline__ unsigned long long route_key(float x, int e) {
  if (x != x) x = -INFINITY;
  if (x == 0.0f) x = 0.0f;
  const unsigned bits = __float_as_uint(x);
  const unsigned ordered = (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
  return (static_cast<unsigned long long>(ordered) << 32) | ~static_cast<unsigned>(e);
}

__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(detail::kFullMask, v, o);
    v = other > v ? other : v;
  }
  return v;
}

// Max and 1 / sum of exp(x - max) over a row of n logits, on every lane.
__device__ __forceinline__ float2 softmax_stats(const float* row, int64_t n, int lane) {
  float m = -INFINITY;
  for (int64_t e = lane; e < n; e += 32) m = fmaxf(m, row[e]);
  m = warp_max(m);
  float sum = 0.0f;
  for (int64_t e = lane; e < n; e += 32) sum += expf(row[e] - m);
  return make_float2(m, 1.0f / warp_sum(sum));
}

// A warp per token. k rounds of a warp argmax over the experts not yet taken (lane owns the
// experts lane + 32 i, i < 32, and marks the taken ones in a bit mask); lane j % 32 writes
// the j-th choice, and later rereads only what it wrote itself. stats[t] = (max, 1 / sum) of
// the full softmax when score sums are wanted (nullptr otherwise).
__global__ void moe_router_forward_kernel(float* __restrict__ probs, int32_t* __restrict__ experts,
                                          float2* __restrict__ stats,
                                          const float* __restrict__ logits, int64_t tokens,
                                          int64_t n, int64_t k, bool softmax_first) {
  const int lane = threadIdx.x % 32;
  BRAID_FOR_WARP_ITEMS(t, tokens) {
    const float* row = logits + t * n;
    float* p = probs + t * k;
    int32_t* chosen = experts + t * k;
    float2 full = make_float2(0.0f, 0.0f);
    if (softmax_first || stats != nullptr) full = softmax_stats(row, n, lane);
    if (stats != nullptr && lane == 0) stats[t] = full;

    unsigned taken = 0;
    for (int64_t j = 0; j < k; ++j) {
      unsigned long long best = 0;
      int i = 0;
      for (int64_t e = lane; e < n; e += 32, ++i) {
        if (((taken >> i) & 1u) != 0) continue;
        const unsigned long long key = route_key(row[e], int(e));
        best = key > best ? key : best;
      }
      best = warp_max_key(best);
      const int e = int(~static_cast<unsigned>(best));  // k <= n: some expert was still free
      if (e % 32 == lane) taken |= 1u << (e / 32);
      if (j % 32 == lane) {
        chosen[j] = e;
        p[j] = softmax_first ? expf(row[e] - full.x) * full.y : row[e];  // else: the logit
      }
    }
    if (softmax_first) continue;

    // probs = softmax over the chosen logits, which p holds (each lane reads its own writes).
    float m = -INFINITY;
    for (int64_t j = lane; j < k; j += 32) m = fmaxf(m, p[j]);
    m = warp_max(m);
    float sum = 0.0f;
    for (int64_t j = lane; j < k; j += 32) sum += expf(p[j] - m);
    const float inv = 1.0f / warp_sum(sum);
    for (int64_t j = lane; j < k; j += 32) p[j] = expf(p[j] - m) * inv;
  }
}

// The full-softmax score of token r at expert c, from the routing's stats: the column sums
// over the tokens are score_sums.
struct RouterScores {
  const float* logits;
  const float2* stats;
  int64_t n;

  __device__ void operator()(int64_t r, int64_t c, float (&v)[1]) const {
    const float2 s = stats[r];
    v[0] = expf(logits[r * n + c] - s.x) * s.y;
  }
};

// A warp per token. slot[e] = the j with experts[t, j] == e, or -1, so that the lane owning e
// computes dlogits[t, e] whole and writes it once.
__global__ void moe_router_backward_kernel(float* __restrict__ dlogits,
                                           const float* __restrict__ dprobs,
                                           const float* __restrict__ logits,
                                           const int32_t* __restrict__ experts,
                                           const float* __restrict__ aux_grad, int64_t tokens,
                                           int64_t n, int64_t k, bool softmax_first) {
  __shared__ int16_t slots[kWarps][kMaxExperts];
  const int lane = threadIdx.x % 32;
  int16_t* slot = slots[threadIdx.x / 32];
  BRAID_FOR_WARP_ITEMS(t, tokens) {
    const float* row = logits + t * n;
    const float* g = dprobs + t * k;
    const int32_t* chosen = experts + t * k;
    float* out = dlogits + t * n;

    for (int64_t e = lane; e < n; e += 32) slot[e] = -1;
    __syncwarp();
    for (int64_t j = lane; j < k; j += 32) {
      const int32_t e = chosen[j];
      if (e >= 0 && e < n) slot[e] = int16_t(j);
    }
    __syncwarp();

    const bool need_full = softmax_first || aux_grad != nullptr;
    float2 full = make_float2(0.0f, 0.0f);
    if (need_full) full = softmax_stats(row, n, lane);

    // softmax_first: dot = sum_j s[chosen j] g_j. Otherwise p = softmax over the chosen
    // logits (max m, 1 / sum inv) and dot = sum_j p_j g_j.
    float m = -INFINITY, inv = 0.0f, dot = 0.0f;
    if (softmax_first) {
      for (int64_t j = lane; j < k; j += 32) {
        const int32_t e = chosen[j];
        if (e >= 0 && e < n) dot += expf(row[e] - full.x) * full.y * g[j];
      }
      dot = warp_sum(dot);
    } else {
      for (int64_t j = lane; j < k; j += 32) {
        const int32_t e = chosen[j];
        if (e >= 0 && e < n) m = fmaxf(m, row[e]);
      }
      m = warp_max(m);
      float sum = 0.0f;
      for (int64_t j = lane; j < k; j += 32) {
        const int32_t e = chosen[j];
        if (e >= 0 && e < n) sum += expf(row[e] - m);
      }
      inv = 1.0f / warp_sum(sum);
      for (int64_t j = lane; j < k; j += 32) {
        const int32_t e = chosen[j];
        if (e >= 0 && e < n) dot += expf(row[e] - m) * inv * g[j];
      }
      dot = warp_sum(dot);
    }
    float aux_dot = 0.0f;  // sum_e s_e aux_e
    if (aux_grad != nullptr) {
      for (int64_t e = lane; e < n; e += 32)
        aux_dot += expf(row[e] - full.x) * full.y * aux_grad[e];
      aux_dot = warp_sum(aux_dot);
    }

    for (int64_t e = lane; e < n; e += 32) {
      const int j = slot[e];
      const float s = need_full ? expf(row[e] - full.x) * full.y : 0.0f;
      float v = 0.0f;
      if (softmax_first) {
        v = -s * dot;
        if (j >= 0) v += s * g[j];
      } else if (j >= 0) {
        v = expf(row[e] - m) * inv * (g[j] - dot);
      }
      if (aux_grad != nullptr) v += s * (aux_grad[e] - aux_dot);
      out[e] = v;
    }
    __syncwarp();  // the next token's slot writes may land in entries other lanes read here
  }
}

// ---- dispatch and combine (V-element packs; a row of c elements is c / V packs)

template <int V, typename T>
__global__ void gather_rows_kernel(T* __restrict__ out, const T* __restrict__ x,
                                   const int32_t* __restrict__ index,
                                   const float* __restrict__ scale, int64_t rows, int64_t c,
                                   int64_t x_rows) {
  const int64_t total = rows * c;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * V;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < total; i += stride) {
    const int64_t r = i / c, col = i % c;
    const int64_t src = index[r];
    float v[V];
    if (src >= 0 && src < x_rows) {
      load_pack<V>(x + src * c + col, v);
    } else {
#pragma unroll
      for (int q = 0; q < V; ++q) v[q] = 0.0f;
    }
    if (scale != nullptr) {
      const float f = scale[r];
#pragma unroll
      for (int q = 0; q < V; ++q) v[q] = f * v[q];
    }
    store_pack<V>(out + i, v);
  }
}

// out[t] = sum over j of weight[t, j] * y[rows[t, j]], added in j order, each product and sum
// rounded separately (no fused multiply-add), as on the CPU.
template <int V, typename T>
__global__ void combine_rows_kernel(T* __restrict__ out, const T* __restrict__ y,
                                    const int32_t* __restrict__ rows,
                                    const float* __restrict__ weight, int64_t tokens, int64_t k,
                                    int64_t c, int64_t y_rows) {
  const int64_t total = tokens * c;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * V;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < total; i += stride) {
    const int64_t t = i / c, col = i % c;
    float acc[V];
#pragma unroll
    for (int q = 0; q < V; ++q) acc[q] = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = rows[t * k + j];
      if (r < 0 || r >= y_rows) continue;
      const float f = weight != nullptr ? weight[t * k + j] : 1.0f;
      float v[V];
      load_pack<V>(y + r * c + col, v);
#pragma unroll
      for (int q = 0; q < V; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(f, v[q]));
    }
    store_pack<V>(out + i, acc);
  }
}

// A warp per (t, j): dweight[t, j] = dot(dout[t], y[rows[t, j]]), lane partials then a warp sum.
template <int V, typename T>
__global__ void combine_rows_weight_grad_kernel(float* __restrict__ dweight,
                                                const T* __restrict__ dout, const T* __restrict__ y,
                                                const int32_t* __restrict__ rows, int64_t tokens,
                                                int64_t k, int64_t c, int64_t y_rows) {
  const int lane = threadIdx.x % 32;
  BRAID_FOR_WARP_ITEMS(pair, tokens * k) {
    const int64_t t = pair / k, r = rows[pair];
    float dot = 0.0f;
    if (r >= 0 && r < y_rows) {
      const T* a = dout + t * c;
      const T* b = y + r * c;
      for (int64_t col = int64_t(lane) * V; col < c; col += 32 * V) {
        float va[V], vb[V];
        load_pack<V>(a + col, va);
        load_pack<V>(b + col, vb);
#pragma unroll
        for (int q = 0; q < V; ++q) dot += va[q] * vb[q];
      }
    }
    dot = warp_sum(dot);
    if (lane == 0) dweight[pair] = dot;
  }
}

#undef BRAID_FOR_WARP_ITEMS

// Calls launch(V) with V = a 16-byte pack of T when c and every pointer allow it, else 1.
template <typename T, typename Launch>
void with_pack_width(int64_t c, std::initializer_list<const void*> pointers, Launch&& launch) {
  if (detail::pack_width<T>(c, pointers) > 1) {
    launch(std::integral_constant<int, detail::kPack<T>>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void moe_router_forward(Tensor probs, Tensor experts, Tensor score_sums, const Tensor& logits,
                        bool softmax_first, Stream stream) {
  detail::DeviceGuard guard(logits.device());
  const int64_t tokens = logits.size(0), n = logits.size(1), k = experts.size(1);
  BRAID_CHECK(n <= kMaxExperts && k <= n, "moe_router_forward: ", n, " experts and k = ", k,
              " (at most ", kMaxExperts, " experts, k <= experts)");
  cudaStream_t s = detail::cuda_stream(stream);
  const int device = logits.device().index;
  const bool sums = score_sums.defined();
  if (sums) CUDA_CHECK(cudaMemsetAsync(score_sums.data(), 0, size_t(n) * sizeof(float), s));
  if (tokens == 0) return;

  // Scratch: the per-token softmax stats, then the column partials of the score sums.
  const int64_t splits = std::clamp<int64_t>(detail::ceil_div(tokens, 256), 1, 128);
  detail::ScratchLayout layout;
  const size_t stats_at = layout.reserve<float2>(sums ? tokens : 0);
  const size_t partials_at = layout.reserve<float>(sums ? splits * n : 0);
  float2* stats = nullptr;
  float* partials = nullptr;
  if (sums) {
    void* base = detail::stream_scratch(logits.device(), s, layout.bytes());
    stats = detail::at_offset<float2>(base, stats_at);
    partials = detail::at_offset<float>(base, partials_at);
  }

  const float* l = logits.data_ptr<float>();
  moe_router_forward_kernel<<<detail::grid_for(tokens, kWarps, device), kThreads, 0, s>>>(
      probs.data_ptr<float>(), experts.data_ptr<int32_t>(), stats, l, tokens, n, k, softmax_first);
  CUDA_CHECK_LAUNCH();
  if (!sums) return;

  // score_sums (zeroed above) += the column sums of the scores, in a fixed order.
  dim3 grid(unsigned(detail::ceil_div(n, detail::kColumnTile)), unsigned(splits));
  dim3 block(detail::kColumnTile, detail::kColumnRows);
  detail::column_partials_kernel<1><<<grid, block, 0, s>>>(
      partials, tokens, n, detail::ceil_div(tokens, splits), RouterScores{l, stats, n});
  CUDA_CHECK_LAUNCH();
  detail::column_finish_kernel<1><<<unsigned(detail::ceil_div(n, kThreads)), kThreads, 0, s>>>(
      detail::ColumnOutputs<1>{{score_sums.data_ptr<float>()}}, partials, splits, n);
  CUDA_CHECK_LAUNCH();
}

void moe_router_backward(Tensor dlogits, const Tensor& dprobs, const Tensor& logits,
                         const Tensor& experts, bool softmax_first, const Tensor& aux_grad,
                         Stream stream) {
  detail::DeviceGuard guard(logits.device());
  const int64_t tokens = logits.size(0), n = logits.size(1), k = experts.size(1);
  BRAID_CHECK(n <= kMaxExperts && k <= n, "moe_router_backward: ", n, " experts and k = ", k,
              " (at most ", kMaxExperts, " experts, k <= experts)");
  if (tokens == 0) return;
  moe_router_backward_kernel<<<detail::grid_for(tokens, kWarps, logits.device().index), kThreads, 0,
                               detail::cuda_stream(stream)>>>(
      dlogits.data_ptr<float>(), dprobs.data_ptr<float>(), logits.data_ptr<float>(),
      experts.data_ptr<int32_t>(), aux_grad.defined() ? aux_grad.data_ptr<float>() : nullptr,
      tokens, n, k, softmax_first);
  CUDA_CHECK_LAUNCH();
}

void gather_rows(Tensor out, const Tensor& x, const Tensor& index, const Tensor& scale,
                 Stream stream) {
  detail::DeviceGuard guard(out.device());
  const int64_t rows = index.size(0), c = x.size(1), x_rows = x.size(0);
  if (rows * c == 0) return;
  cudaStream_t s = detail::cuda_stream(stream);
  const int device = out.device().index;
  const float* sc = scale.defined() ? scale.data_ptr<float>() : nullptr;
  detail::dispatch_activation(x.dtype(), "gather_rows", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out.data());
    const T* px = static_cast<const T*>(x.data());
    with_pack_width<T>(c, {o, px}, [&](auto v) {
      constexpr int V = decltype(v)::value;
      gather_rows_kernel<V, T>
          <<<detail::grid_for(rows * c / V, kThreads, device), kThreads, 0, s>>>(
              o, px, index.data_ptr<int32_t>(), sc, rows, c, x_rows);
    });
  });
}

void combine_rows(Tensor out, const Tensor& y, const Tensor& rows, const Tensor& weight,
                  Stream stream) {
  detail::DeviceGuard guard(out.device());
  const int64_t tokens = rows.size(0), k = rows.size(1), c = y.size(1), y_rows = y.size(0);
  if (tokens * c == 0) return;
  cudaStream_t s = detail::cuda_stream(stream);
  const int device = out.device().index;
  const float* w = weight.defined() ? weight.data_ptr<float>() : nullptr;
  detail::dispatch_activation(y.dtype(), "combine_rows", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out.data());
    const T* py = static_cast<const T*>(y.data());
    with_pack_width<T>(c, {o, py}, [&](auto v) {
      constexpr int V = decltype(v)::value;
      combine_rows_kernel<V, T>
          <<<detail::grid_for(tokens * c / V, kThreads, device), kThreads, 0, s>>>(
              o, py, rows.data_ptr<int32_t>(), w, tokens, k, c, y_rows);
    });
  });
}

void combine_rows_weight_grad(Tensor dweight, const Tensor& dout, const Tensor& y,
                              const Tensor& rows, Stream stream) {
  detail::DeviceGuard guard(dweight.device());
  const int64_t tokens = rows.size(0), k = rows.size(1), c = y.size(1), y_rows = y.size(0);
  if (tokens * k == 0) return;
  cudaStream_t s = detail::cuda_stream(stream);
  const int device = dweight.device().index;
  detail::dispatch_activation(y.dtype(), "combine_rows_weight_grad", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* dy = static_cast<const T*>(dout.data());
    const T* py = static_cast<const T*>(y.data());
    with_pack_width<T>(c, {dy, py}, [&](auto v) {
      constexpr int V = decltype(v)::value;
      combine_rows_weight_grad_kernel<V, T>
          <<<detail::grid_for(tokens * k, kWarps, device), kThreads, 0, s>>>(
              dweight.data_ptr<float>(), dy, py, rows.data_ptr<int32_t>(), tokens, k, c, y_rows);
    });
  });
}

}  // namespace braid::ops::cuda
