// Mixture of experts: top-k routing (softmax or sigmoid scores, expert bias, group-limited) and
// its gradient, a warp per token; the token dispatch gather and the weighted combine of the
// experts' outputs with its weight gradient. No atomics: every sum runs in a fixed order, so
// each result is the same on every run. Row indices outside their tensor (the CPU rejects them)
// read zero rows rather than fault.

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

// Selection key of score x of expert e: a larger key wins, equal scores go to the lower expert.
// Float order on the high 32 bits (-0 counts as +0, NaN as -inf, so the order is total) and
// ~e on the low bits. Every key is > 0, so 0 is "no candidate", and < ~0ull.
__device__ __forceinline__ unsigned long long route_key(float x, int e) {
  if (x != x) x = -INFINITY;
  if (x == 0.0f) x = 0.0f;
  const unsigned bits = __float_as_uint(x);
  const unsigned ordered = (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
  return (static_cast<unsigned long long>(ordered) << 32) | ~static_cast<unsigned>(e);
}

// The score a key ranks: x of route_key, with NaN as -inf and -0 as +0.
__device__ __forceinline__ float key_score(unsigned long long key) {
  const unsigned ordered = static_cast<unsigned>(key >> 32);
  return __uint_as_float((ordered & 0x80000000u) != 0 ? ordered & 0x7fffffffu : ~ordered);
}

// The largest key over each aligned segment of `width` lanes (a power of two), on every lane.
__device__ __forceinline__ unsigned long long segment_max_key(unsigned long long v, int width) {
  for (int o = width / 2; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(detail::kFullMask, v, o);
    v = other > v ? other : v;
  }
  return v;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Max and sum of exp(x - max) over a row of n logits, on every lane.
__device__ __forceinline__ float2 softmax_stats(const float* row, int64_t n, int lane) {
  float m = -INFINITY;
  for (int64_t e = lane; e < n; e += 32) m = fmaxf(m, row[e]);
  m = warp_max(m);
  float sum = 0.0f;
  for (int64_t e = lane; e < n; e += 32) sum += expf(row[e] - m);
  return make_float2(m, warp_sum(sum));
}

// Group-limited routing (ops.h): the mask of this lane's experts (bit i: expert lane + 32 i)
// outside the group_topk best of the spec's groups, by the choice scores `choice` [n] of the
// token; group_score [num_groups] is the warp's scratch. Every selection takes, round by round,
// the largest key below the last round's. A group's score, the sum of its k / group_topk largest
// choice scores in descending order (as on the CPU), comes from a segment of `width` lanes: the
// largest power of two with width * num_groups <= 32, so that a pass covers 32 / width groups.
__device__ unsigned outside_chosen_groups(const float* choice, float* group_score, int64_t n,
                                          int64_t k, const MoeRouterSpec& spec, int lane) {
  const int64_t groups = spec.num_groups, size = n / groups, best = k / spec.group_topk;
  int width = 32;
  while (width > 1 && width * groups > 32) width /= 2;
  for (int64_t first = 0; first < groups; first += 32 / width) {
    const int64_t g = first + lane / width;  // the same on the whole segment
    unsigned long long last = ~0ull;
    float sum = 0.0f;
    for (int64_t j = 0; j < best; ++j) {
      unsigned long long top = 0;
      for (int64_t e = lane % width; g < groups && e < size; e += width) {
        const unsigned long long key = route_key(choice[g * size + e], int(e));
        if (key < last && key > top) top = key;
      }
      last = segment_max_key(top, width);
      sum += key_score(last);
    }
    if (g < groups && lane % width == 0) group_score[g] = sum;
  }
  __syncwarp();

  unsigned long long threshold = ~0ull;  // ends as the key of the last group chosen
  for (int64_t j = 0; j < spec.group_topk; ++j) {
    unsigned long long top = 0;
    for (int64_t g = lane; g < groups; g += 32) {
      const unsigned long long key = route_key(group_score[g], int(g));
      if (key < threshold && key > top) top = key;
    }
    threshold = segment_max_key(top, 32);
  }
  unsigned outside = 0;
  int i = 0;
  for (int64_t e = lane; e < n; e += 32, ++i) {
    const int64_t g = e / size;
    if (route_key(group_score[g], int(g)) < threshold) outside |= 1u << i;
  }
  return outside;
}

// A warp per token, with n + num_groups floats of dynamic shared memory per warp: the choice
// scores (the logits, s = softmax(logits), or s = sigmoid(logits) + expert_bias) and the group
// scores. k rounds of a warp argmax over the experts not yet taken (lane owns the experts
// lane + 32 i, i < 32, and marks the taken ones, and those outside the chosen groups, in a bit
// mask); lane j % 32 writes the j-th choice, and later rereads only what it wrote itself.
// stats[t], when the score sums are wanted (nullptr otherwise): (max, 1 / sum of exp) of the
// softmax, or (0, sum of s + 1e-20) for sigmoid.
__global__ void moe_router_forward_kernel(float* __restrict__ probs, int32_t* __restrict__ experts,
                                          float2* __restrict__ stats, float* __restrict__ lse,
                                          const float* __restrict__ logits,
                                          const float* __restrict__ expert_bias, int64_t tokens,
                                          int64_t n, int64_t k, MoeRouterSpec spec) {
  extern __shared__ float router_scratch[];
  const int lane = threadIdx.x % 32;
  float* choice = router_scratch + (threadIdx.x / 32) * (n + spec.num_groups);
  float* group_score = choice + n;
  const bool need_softmax =
      lse != nullptr || (!spec.sigmoid && (spec.softmax_first || stats != nullptr));
  BRAID_FOR_WARP_ITEMS(t, tokens) {
    const float* row = logits + t * n;
    float* p = probs + t * k;
    int32_t* chosen = experts + t * k;
    float2 full = make_float2(0.0f, 1.0f);
    if (need_softmax) full = softmax_stats(row, n, lane);
    const float inv = 1.0f / full.y;
    float s_sum = 0.0f;
    for (int64_t e = lane; e < n; e += 32) {
      float c = row[e];
      if (spec.sigmoid) {
        const float s = sigmoid(c);
        s_sum += s;
        c = expert_bias != nullptr ? s + expert_bias[e] : s;
      } else if (spec.softmax_first) {
        c = expf(c - full.x) * inv;
      }
      choice[e] = c;
    }
    if (spec.sigmoid && stats != nullptr) s_sum = warp_sum(s_sum);
    if (lane == 0) {
      if (lse != nullptr) lse[t] = full.x + logf(full.y);
      if (stats != nullptr)
        stats[t] = spec.sigmoid ? make_float2(0.0f, s_sum + 1e-20f) : make_float2(full.x, inv);
    }
    __syncwarp();

    unsigned taken = 0;
    if (spec.num_groups > 0) taken = outside_chosen_groups(choice, group_score, n, k, spec, lane);
    for (int64_t j = 0; j < k; ++j) {
      unsigned long long best = 0;
      int i = 0;
      for (int64_t e = lane; e < n; e += 32, ++i) {
        if (((taken >> i) & 1u) != 0) continue;
        const unsigned long long key = route_key(choice[e], int(e));
        best = key > best ? key : best;
      }
      best = segment_max_key(best, 32);
      const int e = int(~static_cast<unsigned>(best));  // k experts are in the chosen groups
      if (e % 32 == lane) taken |= 1u << (e / 32);
      if (j % 32 == lane) {
        chosen[j] = e;
        p[j] = spec.sigmoid ? sigmoid(row[e]) : choice[e];  // s, or the logit (softmax)
      }
    }

    // p holds each choice's s, or its logit (each lane reads its own writes). softmax: probs =
    // the softmax over the chosen logits; sigmoid, k > 1: s over their sum + 1e-20.
    if (!spec.sigmoid && !spec.softmax_first) {
      float m = -INFINITY;
      for (int64_t j = lane; j < k; j += 32) m = fmaxf(m, p[j]);
      m = warp_max(m);
      float sum = 0.0f;
      for (int64_t j = lane; j < k; j += 32) sum += expf(p[j] - m);
      const float inv_top = 1.0f / warp_sum(sum);
      for (int64_t j = lane; j < k; j += 32) p[j] = expf(p[j] - m) * inv_top;
    } else if (spec.sigmoid && k > 1) {
      float sum = 0.0f;
      for (int64_t j = lane; j < k; j += 32) sum += p[j];
      const float denominator = warp_sum(sum) + 1e-20f;
      for (int64_t j = lane; j < k; j += 32) p[j] /= denominator;
    }
    for (int64_t j = lane; j < k; j += 32) p[j] *= spec.scaling_factor;
    __syncwarp();  // the next token's choice writes land in entries other lanes read here
  }
}

// The load-balancing score (ops.h's score_sums) of token r of a group of per_group tokens at
// column c of the [per_group, G n] view whose columns are (group, expert): the column sums of
// that view are score_sums [G, n].
struct RouterScores {
  const float* logits;
  const float2* stats;
  int64_t n, per_group;
  bool use_sigmoid;

  __device__ void operator()(int64_t r, int64_t c, float (&v)[1]) const {
    const int64_t t = (c / n) * per_group + r;
    const float x = logits[t * n + c % n];
    const float2 s = stats[t];
    v[0] = use_sigmoid ? sigmoid(x) / s.y : expf(x - s.x) * s.y;
  }
};

// A warp per token. slot[e] = the j with experts[t, j] == e, or -1, so that the lane owning e
// computes dlogits[t, e] whole and writes it once. aux_grad's row for token t is t / per_group.
__global__ void moe_router_backward_kernel(
    float* __restrict__ dlogits, const float* __restrict__ dprobs, const float* __restrict__ logits,
    const int32_t* __restrict__ experts, const float* __restrict__ aux_grad, int64_t per_group,
    float z_grad, int64_t tokens, int64_t n, int64_t k, MoeRouterSpec spec) {
  __shared__ int16_t slots[kWarps][kMaxExperts];
  const int lane = threadIdx.x % 32;
  int16_t* slot = slots[threadIdx.x / 32];
  const float scale = spec.scaling_factor;
  const bool need_softmax =
      z_grad != 0.0f || (!spec.sigmoid && (spec.softmax_first || aux_grad != nullptr));
  BRAID_FOR_WARP_ITEMS(t, tokens) {
    const float* row = logits + t * n;
    const float* g = dprobs + t * k;
    const int32_t* chosen = experts + t * k;
    const float* aux = aux_grad != nullptr ? aux_grad + (t / per_group) * n : nullptr;
    float* out = dlogits + t * n;

    for (int64_t e = lane; e < n; e += 32) slot[e] = -1;
    __syncwarp();
    for (int64_t j = lane; j < k; j += 32) {
      const int32_t e = chosen[j];
      if (e >= 0 && e < n) slot[e] = int16_t(j);
    }
    __syncwarp();

    float2 full = make_float2(0.0f, 1.0f);
    if (need_softmax) full = softmax_stats(row, n, lane);
    const float inv = 1.0f / full.y;

    // With p the probs before scaling and G_j = scale * dprobs[t, j]:
    //   sigmoid: p_j = s_j / denominator (k > 1) with dot = sum_j G_j s_j / denominator;
    //   softmax_first: p_j = s[chosen j], dot = sum_j p_j G_j;
    //   softmax: p = softmax over the chosen logits (max m, 1 / sum top_inv), dot = sum p_j G_j.
    float m = -INFINITY, top_inv = 0.0f, denominator = 1.0f, dot = 0.0f;
    if (spec.sigmoid) {
      float sum = 0.0f;
      for (int64_t j = lane; j < k; j += 32) {
        const int32_t e = chosen[j];
        if (e >= 0 && e < n) sum += sigmoid(row[e]);
      }
      denominator = warp_sum(sum) + 1e-20f;
      if (k > 1) {
        for (int64_t j = lane; j < k; j += 32) {
          const int32_t e = chosen[j];
          if (e >= 0 && e < n) dot += scale * g[j] * sigmoid(row[e]) / denominator;
        }
        dot = warp_sum(dot);
      }
    } else if (spec.softmax_first) {
      for (int64_t j = lane; j < k; j += 32) {
        const int32_t e = chosen[j];
        if (e >= 0 && e < n) dot += expf(row[e] - full.x) * inv * (scale * g[j]);
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
      top_inv = 1.0f / warp_sum(sum);
      for (int64_t j = lane; j < k; j += 32) {
        const int32_t e = chosen[j];
        if (e >= 0 && e < n) dot += expf(row[e] - m) * top_inv * (scale * g[j]);
      }
      dot = warp_sum(dot);
    }
    // The load-balancing scores: a = softmax(logits), aux_dot = sum_e a_e aux_e; or (sigmoid)
    // a = s / aux_denominator (s over all experts), aux_dot = sum_e a_e aux_e.
    float aux_dot = 0.0f, aux_denominator = 1.0f;
    if (aux != nullptr && spec.sigmoid) {
      float sum = 0.0f;
      for (int64_t e = lane; e < n; e += 32) sum += sigmoid(row[e]);
      aux_denominator = warp_sum(sum) + 1e-20f;
      for (int64_t e = lane; e < n; e += 32) aux_dot += aux[e] * sigmoid(row[e]) / aux_denominator;
      aux_dot = warp_sum(aux_dot);
    } else if (aux != nullptr) {
      for (int64_t e = lane; e < n; e += 32) aux_dot += expf(row[e] - full.x) * inv * aux[e];
      aux_dot = warp_sum(aux_dot);
    }
    // The z-loss: d(z_grad / 2 lse^2) = z_grad lse softmax(logits).
    const float z_scale = z_grad != 0.0f ? z_grad * (full.x + logf(full.y)) : 0.0f;

    for (int64_t e = lane; e < n; e += 32) {
      const int j = slot[e];
      const float x = row[e];
      const float s = need_softmax ? expf(x - full.x) * inv : 0.0f;
      const float sg = spec.sigmoid ? sigmoid(x) : 0.0f;
      float v = 0.0f;
      if (spec.sigmoid) {
        if (j >= 0) {
          const float gj = scale * g[j];
          v = (k > 1 ? (gj - dot) / denominator : gj) * sg * (1.0f - sg);
        }
      } else if (spec.softmax_first) {
        v = -s * dot;
        if (j >= 0) v += s * (scale * g[j]);
      } else if (j >= 0) {
        v = expf(x - m) * top_inv * (scale * g[j] - dot);
      }
      if (aux != nullptr) {
        v += spec.sigmoid ? (aux[e] - aux_dot) / aux_denominator * sg * (1.0f - sg)
                          : s * (aux[e] - aux_dot);
      }
      if (z_grad != 0.0f) v += z_scale * s;
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

void moe_router_forward(Tensor probs, Tensor experts, Tensor score_sums, Tensor lse,
                        const Tensor& logits, const Tensor& expert_bias, const MoeRouterSpec& spec,
                        Stream stream) {
  detail::DeviceGuard guard(logits.device());
  const int64_t tokens = logits.size(0), n = logits.size(1), k = experts.size(1);
  BRAID_CHECK(n <= kMaxExperts && k <= n && spec.num_groups <= n, "moe_router_forward: ", n,
              " experts, k = ", k, " and ", spec.num_groups, " groups (at most ", kMaxExperts,
              " experts, k and the groups at most the experts)");
  cudaStream_t s = detail::cuda_stream(stream);
  const int device = logits.device().index;
  const bool sums = score_sums.defined();
  const int64_t sum_groups = sums ? score_sums.size(0) : 1, cols = sum_groups * n;
  if (sums) CUDA_CHECK(cudaMemsetAsync(score_sums.data(), 0, size_t(cols) * sizeof(float), s));
  if (tokens == 0) return;

  // Scratch: the per-token score stats, then the column partials of the score sums.
  const int64_t per_group = tokens / sum_groups;
  const int64_t splits = std::clamp<int64_t>(detail::ceil_div(per_group, 256), 1, 128);
  detail::ScratchLayout layout;
  const size_t stats_at = layout.reserve<float2>(sums ? tokens : 0);
  const size_t partials_at = layout.reserve<float>(sums ? splits * cols : 0);
  float2* stats = nullptr;
  float* partials = nullptr;
  if (sums) {
    void* base = detail::stream_scratch(logits.device(), s, layout.bytes());
    stats = detail::at_offset<float2>(base, stats_at);
    partials = detail::at_offset<float>(base, partials_at);
  }

  const float* l = logits.data_ptr<float>();
  const size_t shared = size_t(kWarps) * size_t(n + spec.num_groups) * sizeof(float);
  if (shared > 48 * 1024) {  // past the default limit of dynamic shared memory: opt in
    CUDA_CHECK(cudaFuncSetAttribute(moe_router_forward_kernel,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)));
  }
  moe_router_forward_kernel<<<detail::grid_for(tokens, kWarps, device), kThreads, shared, s>>>(
      probs.data_ptr<float>(), experts.data_ptr<int32_t>(), stats,
      lse.defined() ? lse.data_ptr<float>() : nullptr, l,
      expert_bias.defined() ? expert_bias.data_ptr<float>() : nullptr, tokens, n, k, spec);
  CUDA_CHECK_LAUNCH();
  if (!sums) return;

  // score_sums (zeroed above) += the column sums of the scores' [per_group, G n] view, in a
  // fixed order.
  dim3 grid(unsigned(detail::ceil_div(cols, detail::kColumnTile)), unsigned(splits));
  dim3 block(detail::kColumnTile, detail::kColumnRows);
  detail::column_partials_kernel<1>
      <<<grid, block, 0, s>>>(partials, per_group, cols, detail::ceil_div(per_group, splits),
                              RouterScores{l, stats, n, per_group, spec.sigmoid});
  CUDA_CHECK_LAUNCH();
  detail::column_finish_kernel<1><<<unsigned(detail::ceil_div(cols, kThreads)), kThreads, 0, s>>>(
      detail::ColumnOutputs<1>{{score_sums.data_ptr<float>()}}, partials, splits, cols);
  CUDA_CHECK_LAUNCH();
}

void moe_router_backward(Tensor dlogits, const Tensor& dprobs, const Tensor& logits,
                         const Tensor& experts, const MoeRouterSpec& spec, const Tensor& aux_grad,
                         float z_grad, Stream stream) {
  detail::DeviceGuard guard(logits.device());
  const int64_t tokens = logits.size(0), n = logits.size(1), k = experts.size(1);
  BRAID_CHECK(n <= kMaxExperts && k <= n, "moe_router_backward: ", n, " experts and k = ", k,
              " (at most ", kMaxExperts, " experts, k <= experts)");
  if (tokens == 0) return;
  const bool aux = aux_grad.defined();
  moe_router_backward_kernel<<<detail::grid_for(tokens, kWarps, logits.device().index), kThreads, 0,
                               detail::cuda_stream(stream)>>>(
      dlogits.data_ptr<float>(), dprobs.data_ptr<float>(), logits.data_ptr<float>(),
      experts.data_ptr<int32_t>(), aux ? aux_grad.data_ptr<float>() : nullptr,
      aux ? tokens / aux_grad.size(0) : 1, z_grad, tokens, n, k, spec);
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
