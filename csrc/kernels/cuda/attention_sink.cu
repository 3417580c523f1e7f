// Attention sinks: the extra softmax logit per head joined to attention_forward's out and lse
// (forward), and the sinks' gradient (backward). f32 arithmetic throughout.
//
// Forward: one warp per softmax row (batch, head, query), as lse lays them out; the lanes rescale
// the row's D output columns, then lane 0 writes the new lse.
// Backward: dsinks[h] -= sum over (batch, query) of exp(sink - lse) dot(dout, out), in two
// passes with no atomics: blocks (head, chunk) each sum a fixed, strided share of the head's
// rows into a partial, then one warp per head adds its partials in chunk order. The chunk count
// depends on the shape only, so the result is the same on every run and device.

#include <algorithm>

#include "braid/core/error.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace braid::ops::cuda {
namespace {

using detail::from_float;
using detail::to_float;
using detail::warp_sum;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxChunks = 128;    // partial sums per head
constexpr int64_t kRowsPerChunk = 64;  // rows below which one more chunk is not worth it

struct SinkDims {
  int64_t b, sq, hq, d;
  // out's row of the softmax row r = (batch * Hq + head) * Sq + i.
  __device__ int64_t out_at(int64_t r) const {
    const int64_t i = r % sq, head = (r / sq) % hq, batch = r / (sq * hq);
    return ((batch * sq + i) * hq + head) * d;
  }
};

// log(exp(a) + exp(b)) without overflow; -inf when both are.
__device__ __forceinline__ float log_add_exp(float a, float b) {
  const float m = fmaxf(a, b);
  if (m == -INFINITY) return m;
  return m + log1pf(expf(-fabsf(a - b)));
}

template <typename T>
__global__ void attention_sink_forward_kernel(T* __restrict__ out, float* __restrict__ lse,
                                              const T* __restrict__ sinks, SinkDims m) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = m.b * m.hq * m.sq, warps = int64_t(gridDim.x) * kWarps;
  for (int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; r < rows; r += warps) {
    const float before = lse[r];
    const float after = log_add_exp(before, to_float(sinks[(r / m.sq) % m.hq]));
    const float factor = expf(before - after);
    T* row = out + m.out_at(r);
    for (int64_t dd = lane; dd < m.d; dd += 32) row[dd] = from_float<T>(factor * to_float(row[dd]));
    __syncwarp();  // every lane has read lse[r] before it changes
    if (lane == 0) lse[r] = after;
  }
}

// grid (Hq, chunks): block (h, c) sums head h's rows t = c * kWarps + warp + k * chunks * kWarps
// (t = batch * Sq + i), one warp per row, into partial[h * chunks + c].
template <typename T>
__global__ void attention_sink_partial_kernel(float* __restrict__ partial,
                                              const T* __restrict__ dout, const T* __restrict__ out,
                                              const float* __restrict__ lse,
                                              const T* __restrict__ sinks, SinkDims m) {
  __shared__ float shared[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t head = blockIdx.x, chunks = gridDim.y, per_head = m.b * m.sq;
  const float sink = to_float(sinks[head]);
  float sum = 0.0f;  // the same in every lane of the warp
  for (int64_t t = int64_t(blockIdx.y) * kWarps + warp; t < per_head; t += chunks * kWarps) {
    const int64_t batch = t / m.sq, i = t % m.sq, r = (batch * m.hq + head) * m.sq + i;
    const int64_t at = m.out_at(r);
    float dot = 0.0f;
    for (int64_t dd = lane; dd < m.d; dd += 32)
      dot += to_float(dout[at + dd]) * to_float(out[at + dd]);
    sum += expf(sink - lse[r]) * warp_sum(dot);
  }
  // Each warp's sum once (lane 0's), the other lanes' zero.
  const float total = detail::block_sum(lane == 0 ? sum : 0.0f, shared);
  if (threadIdx.x == 0) partial[head * chunks + blockIdx.y] = total;
}

// One warp per head: dsinks[h] -= the sum of its chunks' partials.
__global__ void attention_sink_reduce_kernel(float* __restrict__ dsinks,
                                             const float* __restrict__ partial, int64_t hq,
                                             int64_t chunks) {
  const int lane = threadIdx.x % 32;
  const int64_t head = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (head >= hq) return;  // warp-uniform
  float sum = 0.0f;
  for (int64_t c = lane; c < chunks; c += 32) sum += partial[head * chunks + c];
  sum = warp_sum(sum);
  if (lane == 0) dsinks[head] -= sum;
}

SinkDims sink_dims(const Tensor& out) {
  return {out.size(0), out.size(1), out.size(2), out.size(3)};
}

}  // namespace

void attention_sink_forward(Tensor out, Tensor lse, const Tensor& sinks, Stream stream) {
  detail::DeviceGuard guard(out.device());
  cudaStream_t s = detail::cuda_stream(stream);
  const SinkDims m = sink_dims(out);
  const unsigned blocks = detail::grid_for(m.b * m.hq * m.sq * 32, kThreads, out.device().index);
  detail::dispatch_activation(out.dtype(), "attention_sink_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    attention_sink_forward_kernel<T><<<blocks, kThreads, 0, s>>>(
        static_cast<T*>(out.data()), lse.data_ptr<float>(), static_cast<const T*>(sinks.data()), m);
    CUDA_CHECK_LAUNCH();
  });
}

void attention_sink_backward(Tensor dsinks, const Tensor& dout, const Tensor& out,
                             const Tensor& lse, const Tensor& sinks, Stream stream) {
  detail::DeviceGuard guard(out.device());
  cudaStream_t s = detail::cuda_stream(stream);
  const SinkDims m = sink_dims(out);
  const int64_t chunks = std::min<int64_t>(
      kMaxChunks, std::max<int64_t>(1, detail::ceil_div(m.b * m.sq, kRowsPerChunk)));
  BRAID_CHECK(m.hq <= INT32_MAX, "attention_sink_backward: ", m.hq, " heads exceed the grid");
  float* partial = static_cast<float*>(
      detail::stream_scratch(out.device(), s, size_t(m.hq * chunks) * sizeof(float)));
  detail::dispatch_activation(out.dtype(), "attention_sink_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    attention_sink_partial_kernel<T><<<dim3(unsigned(m.hq), unsigned(chunks)), kThreads, 0, s>>>(
        partial, static_cast<const T*>(dout.data()), static_cast<const T*>(out.data()),
        lse.data_ptr<float>(), static_cast<const T*>(sinks.data()), m);
    CUDA_CHECK_LAUNCH();
  });
  attention_sink_reduce_kernel<<<unsigned(detail::ceil_div(m.hq, kWarps)), kThreads, 0, s>>>(
      dsinks.data_ptr<float>(), partial, m.hq, chunks);
  CUDA_CHECK_LAUNCH();
}

}  // namespace braid::ops::cuda
