// Causal grouped-query attention, with or without a sliding window or document masking
// (key_start). bf16/f16 go to cuDNN's SDPA (attention_cudnn.cu) when it supports the
// configuration; f32, fewer queries than keys (context parallelism's chunks: query row i sits at
// position Sk - Sq + i), document masking and anything cuDNN declines run the flash-attention
// style kernels below: correctness first, f32 arithmetic throughout. With a window or documents
// each block visits only the key (or query) tiles its rows' windows and documents reach.
//
// Forward: a block owns 16 query rows (4 warps x 4 rows) of one (batch, head) and streams the
// causally visible keys through shared memory 32 at a time (one key per lane), keeping an
// online softmax per row; it writes out and lse (natural log of the scaled scores' sum).
// Backward: delta = rowsum(dO * O); dQ by query blocks (like the forward, P recomputed from
// lse); dK and dV by key blocks, each looping over the query heads of its kv head and over
// the queries that see its keys. Every gradient element has one writer: no atomics, and the
// result does not depend on scheduling.
// Attention dropout (cuDNN's own draws another mask, so these kernels run it): each visible
// probability is multiplied by the mask of attention_dropout.h (one Philox call per element)
// where it weighs V (forward, dV) and where dP meets it (dS = P o (dP o mask - delta)); the
// row sums and lse stay the undropped softmax's.

#include "braid/core/error.h"
#include "kernels/attention_dropout.h"
#include "kernels/cuda/attention_cudnn.h"
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
constexpr int kRowsPerWarp = 4;
constexpr int kBlockRows = kWarps * kRowsPerWarp;  // query (or key) rows a block owns
constexpr int kTile = 32;                          // keys (or queries) streamed: one per lane
constexpr int kMaxHeadDim = 256;

// Attention dropout's multiplier of query row i's probability of key j within one (batch,
// head): 1 without dropout.
struct HeadMask {
  ops::detail::HeadDropout drop;
  bool on;
  int64_t offset;  // Sk - Sq
  __device__ float keep(int64_t i, int64_t j) const { return on ? drop.at(offset, i, j) : 1.0f; }
};

// q [B, Sq, Hq, D], k, v [B, Sk, Hkv, D], Sq <= Sk: query row i of sequence b sits at position
// offset + i and sees keys first_key(b, i) .. offset + i (window -1 and no key_start: from 0).
// key_start: nullptr or [B][key_ld], non-decreasing along each row with key_start[p] <= p
// (ops::attention_forward's): so a block's first row has its smallest first key, and every row
// sees at least its own key.
struct Dims {
  int64_t b, sq, sk, hq, hkv, window;
  int d;
  float scale;
  const int32_t* key_start;
  int64_t key_ld;
  AttentionDropout dropout;
  __host__ __device__ int64_t offset() const { return sk - sq; }
  // The dropout mask of (batch, head), built once per block (or per head of a kv group).
  __device__ HeadMask head_mask(int64_t batch, int64_t head) const {
    return {ops::detail::HeadDropout::of(dropout, batch, head), dropout.p > 0.0f, offset()};
  }
  __device__ int64_t first_key(int64_t batch, int64_t i) const {
    const int64_t p = offset() + i;
    const int64_t first = window < 0 || p < window ? 0 : p - window;
    if (key_start == nullptr) return first;
    const int64_t doc = key_start[batch * key_ld + p];
    return doc > first ? doc : first;
  }
  __device__ bool sees(int64_t batch, int64_t i, int64_t j) const {
    return j <= offset() + i && j >= first_key(batch, i);
  }
  // Past the last query row of sequence `batch` that sees some key before key_end: within the
  // window, and (key_start) before the first position whose document starts at or after
  // key_end (found by bisection: key_start never decreases along a row).
  __device__ int64_t query_end(int64_t batch, int64_t key_end) const {
    int64_t end = sq;
    if (window >= 0 && key_end + window - offset() < end) end = key_end + window - offset();
    if (key_start != nullptr) {
      const int32_t* row = key_start + batch * key_ld;
      int64_t lo = key_end < sk ? key_end : sk, hi = sk;  // positions before key_end see it
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (row[mid] < key_end) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      if (lo - offset() < end) end = lo - offset();
    }
    return end;
  }
};

// Rows [row0, row0 + rows) of head `head` of a [B, seq, heads, D] tensor into dst (row stride
// ld), times alpha; rows past the tensor's `seq` are zero.
template <typename T>
__device__ void load_rows(float* dst, int ld, const T* src, const Dims& m, int64_t seq, int64_t b,
                          int64_t row0, int rows, int64_t head, int64_t heads, float alpha) {
  for (int idx = threadIdx.x; idx < rows * m.d; idx += blockDim.x) {
    const int r = idx / m.d, dd = idx % m.d;
    const int64_t row = row0 + r;
    dst[r * ld + dd] =
        row < seq ? alpha * to_float(src[((b * seq + row) * heads + head) * m.d + dd]) : 0.0f;
  }
}

__device__ __forceinline__ float dot(const float* a, const float* b, int d) {
  float s = 0.0f;
  for (int dd = 0; dd < d; ++dd) s += a[dd] * b[dd];
  return s;
}

// acc[c] += sum over the 32 lanes' weights w (one per row of `rows`, row stride ld) of
// w * rows[lane'][lane + 32 c]: the lane owns columns lane, lane + 32, ...
template <int kChunks>
__device__ __forceinline__ void add_weighted_rows(float (&acc)[kChunks], float w, const float* rows,
                                                  int ld, int d) {
  const int lane = threadIdx.x % 32;
  for (int jj = 0; jj < kTile; ++jj) {
    const float wj = __shfl_sync(kFullMask, w, jj);
    const float* row = rows + jj * ld;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int dd = lane + 32 * c;
      if (dd < d) acc[c] += wj * row[dd];
    }
  }
}

// grid (B * Hq, query blocks); shared: q [16][d], k [32][d + 1], v [32][d].
template <int kChunks, typename T>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(T* __restrict__ out, float* __restrict__ lse, const T* __restrict__ q,
                             const T* __restrict__ k, const T* __restrict__ v, Dims m) {
  extern __shared__ float smem[];
  const int d = m.d;
  float* q_s = smem;
  float* k_s = q_s + kBlockRows * d;
  float* v_s = k_s + kTile * (d + 1);
  const int64_t b = blockIdx.x / m.hq, h = blockIdx.x % m.hq, kvh = h / (m.hq / m.hkv);
  const HeadMask mask = m.head_mask(b, h);
  const int64_t row0 = int64_t(gridDim.y - 1 - blockIdx.y) * kBlockRows;  // longest first
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  load_rows(q_s, d, q, m, m.sq, b, row0, kBlockRows, h, m.hq, m.scale);

  float mx[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kChunks];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    mx[rr] = -INFINITY;
    l[rr] = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) acc[rr][c] = 0.0f;
  }
  const int64_t last = m.offset() + row0 + kBlockRows;  // past the block's last visible key
  const int64_t kv_end = last < m.sk ? last : m.sk;
  for (int64_t j0 = m.first_key(b, row0); j0 < kv_end; j0 += kTile) {
    __syncthreads();  // the previous tile is consumed
    load_rows(k_s, d + 1, k, m, m.sk, b, j0, kTile, kvh, m.hkv, 1.0f);
    load_rows(v_s, d, v, m, m.sk, b, j0, kTile, kvh, m.hkv, 1.0f);
    __syncthreads();
    const int64_t j = j0 + lane;
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp * kRowsPerWarp + rr;
      const int64_t i = row0 + r;
      const bool visible = i < m.sq && m.sees(b, i, j);
      const float s = visible ? dot(q_s + r * d, k_s + lane * (d + 1), d) : -INFINITY;
      const float m_new = fmaxf(mx[rr], warp_max(s));
      if (m_new == -INFINITY) continue;  // warp-uniform: no visible key yet
      const float p = visible ? expf(s - m_new) : 0.0f;
      const float correction = expf(mx[rr] - m_new);  // 0 on the first visible tile
      l[rr] = l[rr] * correction + warp_sum(p);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) acc[rr][c] *= correction;
      add_weighted_rows(acc[rr], visible ? p * mask.keep(i, j) : 0.0f, v_s, d, d);
      mx[rr] = m_new;
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t i = row0 + warp * kRowsPerWarp + rr;
    if (i >= m.sq) continue;
    const float inv = 1.0f / l[rr];
    T* o = out + ((b * m.sq + i) * m.hq + h) * d;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int dd = lane + 32 * c;
      if (dd < d) o[dd] = from_float<T>(acc[rr][c] * inv);
    }
    if (lane == 0) lse[(b * m.hq + h) * m.sq + i] = mx[rr] + logf(l[rr]);
  }
}

// delta[b, h, i] = sum_d dO * O, one warp per row of the [B, S, Hq, D] tensors.
template <typename T>
__global__ void attention_delta_kernel(float* __restrict__ delta, const T* __restrict__ dout,
                                       const T* __restrict__ out, Dims m) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = m.b * m.sq * m.hq, warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; row < rows;
       row += warps) {
    float sum = 0.0f;
    for (int dd = lane; dd < m.d; dd += 32) {
      sum += to_float(dout[row * m.d + dd]) * to_float(out[row * m.d + dd]);
    }
    sum = warp_sum(sum);
    const int64_t h = row % m.hq, i = (row / m.hq) % m.sq, b = row / (m.hq * m.sq);
    if (lane == 0) delta[(b * m.hq + h) * m.sq + i] = sum;
  }
}

// dQ = scale * dS K, dS = P o (dO V^T - delta). grid (B * Hq, query blocks); shared:
// q [16][d] (scaled), dO [16][d], k [32][d + 1], v [32][d + 1].
template <int kChunks, typename T>
__global__ void __launch_bounds__(kThreads)
    attention_dq_kernel(T* __restrict__ dq, const T* __restrict__ dout, const T* __restrict__ q,
                        const T* __restrict__ k, const T* __restrict__ v,
                        const float* __restrict__ lse, const float* __restrict__ delta, Dims m) {
  extern __shared__ float smem[];
  const int d = m.d;
  float* q_s = smem;
  float* do_s = q_s + kBlockRows * d;
  float* k_s = do_s + kBlockRows * d;
  float* v_s = k_s + kTile * (d + 1);
  const int64_t b = blockIdx.x / m.hq, h = blockIdx.x % m.hq, kvh = h / (m.hq / m.hkv);
  const HeadMask mask = m.head_mask(b, h);
  const int64_t row0 = int64_t(gridDim.y - 1 - blockIdx.y) * kBlockRows;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  load_rows(q_s, d, q, m, m.sq, b, row0, kBlockRows, h, m.hq, m.scale);
  load_rows(do_s, d, dout, m, m.sq, b, row0, kBlockRows, h, m.hq, 1.0f);

  float row_lse[kRowsPerWarp], row_delta[kRowsPerWarp], acc[kRowsPerWarp][kChunks];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t i = row0 + warp * kRowsPerWarp + rr;
    row_lse[rr] = i < m.sq ? lse[(b * m.hq + h) * m.sq + i] : 0.0f;
    row_delta[rr] = i < m.sq ? delta[(b * m.hq + h) * m.sq + i] : 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) acc[rr][c] = 0.0f;
  }
  const int64_t last = m.offset() + row0 + kBlockRows;
  const int64_t kv_end = last < m.sk ? last : m.sk;
  for (int64_t j0 = m.first_key(b, row0); j0 < kv_end; j0 += kTile) {
    __syncthreads();
    load_rows(k_s, d + 1, k, m, m.sk, b, j0, kTile, kvh, m.hkv, 1.0f);
    load_rows(v_s, d + 1, v, m, m.sk, b, j0, kTile, kvh, m.hkv, 1.0f);
    __syncthreads();
    const int64_t j = j0 + lane;
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp * kRowsPerWarp + rr;
      const int64_t i = row0 + r;
      if (i >= m.sq) continue;  // warp-uniform
      const bool visible = m.sees(b, i, j);
      float ds = 0.0f;
      if (visible) {
        const float p = expf(dot(q_s + r * d, k_s + lane * (d + 1), d) - row_lse[rr]);
        const float dp = dot(do_s + r * d, v_s + lane * (d + 1), d) * mask.keep(i, j);
        ds = p * (dp - row_delta[rr]);
      }
      add_weighted_rows(acc[rr], ds, k_s, d + 1, d);
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t i = row0 + warp * kRowsPerWarp + rr;
    if (i >= m.sq) continue;
    T* g = dq + ((b * m.sq + i) * m.hq + h) * d;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int dd = lane + 32 * c;
      if (dd < d) g[dd] = from_float<T>(m.scale * acc[rr][c]);
    }
  }
}

// dV = P^T dO, dK = dS^T (scale Q), summed over the query heads sharing the kv head.
// grid (B * Hkv, key blocks); shared: k [16][d], v [16][d], q [32][d + 1] (scaled),
// dO [32][d + 1], lse [32], delta [32].
template <int kChunks, typename T>
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(T* __restrict__ dk, T* __restrict__ dv, const T* __restrict__ dout,
                          const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          const float* __restrict__ lse, const float* __restrict__ delta, Dims m) {
  extern __shared__ float smem[];
  const int d = m.d;
  float* k_s = smem;
  float* v_s = k_s + kBlockRows * d;
  float* q_s = v_s + kBlockRows * d;
  float* do_s = q_s + kTile * (d + 1);
  float* lse_s = do_s + kTile * (d + 1);
  float* delta_s = lse_s + kTile;
  const int64_t b = blockIdx.x / m.hkv, kvh = blockIdx.x % m.hkv;
  const int64_t group = m.hq / m.hkv;
  const int64_t key0 = int64_t(blockIdx.y) * kBlockRows;  // early keys see the most queries
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  load_rows(k_s, d, k, m, m.sk, b, key0, kBlockRows, kvh, m.hkv, 1.0f);
  load_rows(v_s, d, v, m, m.sk, b, key0, kBlockRows, kvh, m.hkv, 1.0f);
  // The queries that see the block's keys: from the one at position key0 (row key0 - offset)
  // to the last whose window (and document) reaches key0 + kBlockRows - 1.
  const int64_t first_query = key0 > m.offset() ? key0 - m.offset() : 0;
  const int64_t query_end = m.query_end(b, key0 + kBlockRows);

  float dk_acc[kRowsPerWarp][kChunks], dv_acc[kRowsPerWarp][kChunks];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) dk_acc[rr][c] = dv_acc[rr][c] = 0.0f;
  }
  for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
    const HeadMask mask = m.head_mask(b, h);
    for (int64_t i0 = first_query; i0 < query_end; i0 += kTile) {
      __syncthreads();
      load_rows(q_s, d + 1, q, m, m.sq, b, i0, kTile, h, m.hq, m.scale);
      load_rows(do_s, d + 1, dout, m, m.sq, b, i0, kTile, h, m.hq, 1.0f);
      if (threadIdx.x < kTile) {
        const int64_t i = i0 + threadIdx.x;
        lse_s[threadIdx.x] = i < m.sq ? lse[(b * m.hq + h) * m.sq + i] : 0.0f;
        delta_s[threadIdx.x] = i < m.sq ? delta[(b * m.hq + h) * m.sq + i] : 0.0f;
      }
      __syncthreads();
      const int64_t i = i0 + lane;
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const int r = warp * kRowsPerWarp + rr;
        const int64_t j = key0 + r;
        if (j >= m.sk) continue;  // warp-uniform
        float p = 0.0f, ds = 0.0f;
        if (i < m.sq && m.sees(b, i, j)) {
          p = expf(dot(q_s + lane * (d + 1), k_s + r * d, d) - lse_s[lane]);
          const float keep = mask.keep(i, j);
          const float dp = dot(do_s + lane * (d + 1), v_s + r * d, d) * keep;
          ds = p * (dp - delta_s[lane]);
          p *= keep;  // P o mask weighs dO into dV
        }
        add_weighted_rows(dv_acc[rr], p, do_s, d + 1, d);
        add_weighted_rows(dk_acc[rr], ds, q_s, d + 1, d);
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t j = key0 + warp * kRowsPerWarp + rr;
    if (j >= m.sk) continue;
    T* gk = dk + ((b * m.sk + j) * m.hkv + kvh) * d;
    T* gv = dv + ((b * m.sk + j) * m.hkv + kvh) * d;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int dd = lane + 32 * c;
      if (dd < d) {
        gk[dd] = from_float<T>(dk_acc[rr][c]);
        gv[dd] = from_float<T>(dv_acc[rr][c]);
      }
    }
  }
}

Dims dims_of(const Tensor& q, const Tensor& k, int64_t window, const Tensor& key_start,
             const AttentionDropout& dropout) {
  return {q.size(0),
          q.size(1),
          k.size(1),
          q.size(2),
          k.size(2),
          window,
          int(q.size(3)),
          1.0f / std::sqrt(float(q.size(3))),
          key_start.defined() ? key_start.data_ptr<int32_t>() : nullptr,
          key_start.defined() ? key_start.size(1) : 0,
          dropout};
}

// Calls f(std::integral_constant<int, kChunks>) with the smallest kChunks covering d.
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

// Allows `kernel` the dynamic shared memory it needs (beyond the default 48 KiB).
template <typename Kernel>
void reserve_shared(Kernel kernel, size_t bytes, int device, const char* op) {
  if (bytes <= 48 * 1024) return;
  int optin = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  BRAID_CHECK(bytes <= size_t(optin), op, ": head dim needs ", bytes,
              " bytes of shared memory, the device allows ", optin);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

void check_dims(const Dims& m, const char* op) {
  BRAID_CHECK(m.d <= kMaxHeadDim, op, ": head dim ", m.d, " exceeds ", kMaxHeadDim);
  BRAID_CHECK(detail::ceil_div(m.sk, kBlockRows) <= 65535 && m.b * m.hq <= INT32_MAX, op,
              ": B=", m.b, " S=", m.sk, " H=", m.hq, " exceed the grid");
}

}  // namespace

void attention_forward(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       int64_t window, const Tensor& key_start, const AttentionDropout& dropout,
                       Stream stream) {
  detail::DeviceGuard guard(q.device());
  cudaStream_t s = detail::cuda_stream(stream);
  if (q.size(1) == k.size(1) && !key_start.defined() && dropout.p == 0.0f &&
      detail::cudnn_attention_forward(out, lse, q, k, v, window, s)) {
    return;
  }
  const Dims m = dims_of(q, k, window, key_start, dropout);
  check_dims(m, "attention_forward");
  const int device = q.device().index;
  const dim3 grid(unsigned(m.b * m.hq), unsigned(detail::ceil_div(m.sq, kBlockRows)));
  const size_t smem = size_t(kBlockRows * m.d + kTile * (m.d + 1) + kTile * m.d) * sizeof(float);
  detail::dispatch_activation(q.dtype(), "attention_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_chunks(m.d, [&](auto chunks) {
      auto kernel = attention_forward_kernel<decltype(chunks)::value, T>;
      reserve_shared(kernel, smem, device, "attention_forward");
      kernel<<<grid, kThreads, smem, s>>>(
          static_cast<T*>(out.data()), lse.data_ptr<float>(), static_cast<const T*>(q.data()),
          static_cast<const T*>(k.data()), static_cast<const T*>(v.data()), m);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void attention_backward(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        int64_t window, const Tensor& key_start, const AttentionDropout& dropout,
                        Stream stream) {
  detail::DeviceGuard guard(q.device());
  cudaStream_t s = detail::cuda_stream(stream);
  if (q.size(1) == k.size(1) && !key_start.defined() && dropout.p == 0.0f &&
      detail::cudnn_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, window, s)) {
    return;
  }
  const Dims m = dims_of(q, k, window, key_start, dropout);
  check_dims(m, "attention_backward");
  const int device = q.device().index;
  float* delta = static_cast<float*>(
      detail::stream_scratch(q.device(), s, size_t(m.b * m.hq * m.sq) * sizeof(float)));
  const unsigned q_blocks = unsigned(detail::ceil_div(m.sq, kBlockRows));
  const unsigned key_blocks = unsigned(detail::ceil_div(m.sk, kBlockRows));
  const size_t dq_smem = size_t(2 * kBlockRows * m.d + 2 * kTile * (m.d + 1)) * sizeof(float);
  const size_t dkdv_smem = dq_smem + 2 * kTile * sizeof(float);
  detail::dispatch_activation(q.dtype(), "attention_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* pdo = static_cast<const T*>(dout.data());
    const T* pq = static_cast<const T*>(q.data());
    const T* pk = static_cast<const T*>(k.data());
    const T* pv = static_cast<const T*>(v.data());
    constexpr int kDeltaThreads = 256;
    attention_delta_kernel<T>
        <<<detail::grid_for(m.b * m.sq * m.hq * 32, kDeltaThreads, device), kDeltaThreads, 0, s>>>(
            delta, pdo, static_cast<const T*>(out.data()), m);
    CUDA_CHECK_LAUNCH();
    dispatch_chunks(m.d, [&](auto chunks) {
      constexpr int kChunks = decltype(chunks)::value;
      // Hq = 0 or Sq = 0 is valid (dq is empty, dk and dv are zeros) but a grid dimension
      // cannot be 0.
      if (m.hq > 0 && m.sq > 0) {
        auto dq_kernel = attention_dq_kernel<kChunks, T>;
        reserve_shared(dq_kernel, dq_smem, device, "attention_backward");
        dq_kernel<<<dim3(unsigned(m.b * m.hq), q_blocks), kThreads, dq_smem, s>>>(
            static_cast<T*>(dq.data()), pdo, pq, pk, pv, lse.data_ptr<float>(), delta, m);
        CUDA_CHECK_LAUNCH();
      }
      auto dkdv_kernel = attention_dkdv_kernel<kChunks, T>;
      reserve_shared(dkdv_kernel, dkdv_smem, device, "attention_backward");
      dkdv_kernel<<<dim3(unsigned(m.b * m.hkv), key_blocks), kThreads, dkdv_smem, s>>>(
          static_cast<T*>(dk.data()), static_cast<T*>(dv.data()), pdo, pq, pk, pv,
          lse.data_ptr<float>(), delta, m);
      CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace braid::ops::cuda
