// sum_of_squares: the squared global norm of many tensors in two deterministic passes. One
// block per fixed chunk of one tensor writes the chunk's sum (a fixed-order tree), then one
// block adds the chunk sums in order. Squares of f32/bf16/f16 values are exact in double and
// are summed in double, as on the CPU: the reduction's rounding stays far below f32's, and the
// launch configuration does not change the result. count_zeros runs the same passes on the
// count of zero elements (exact in double far beyond any tensor's size).

#include <cstring>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace braid::ops::cuda {
namespace {

constexpr int64_t kChunk = 1 << 16;
constexpr int kThreads = 512;
constexpr int kFinishThreads = 1024;

enum Kind : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct SquaresChunk {
  const void* data;
  int64_t start;
  int64_t end;
  int32_t kind;
  int32_t unused = 0;
};

__device__ __forceinline__ double warp_sum_double(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(detail::kFullMask, v, o);
  return v;
}

// Sum over the block, valid in thread 0. `shared` holds >= 32 doubles.
__device__ double block_sum_double(double v, double* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_sum_double(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = 0.0;
  if (warp == 0) {
    v = lane < int(blockDim.x / 32) ? shared[lane] : 0.0;
    v = warp_sum_double(v);
  }
  return v;
}

// What is summed: each element's square, or 1 for each zero element.
enum class Statistic { squares, zeros };

template <Statistic S, typename T>
__device__ double chunk_statistic(const T* x, int64_t start, int64_t end) {
  double sum = 0.0;
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    const double v = detail::to_float(x[i]);
    sum += S == Statistic::squares ? v * v : double(v == 0.0);
  }
  return sum;
}

template <Statistic S>
__global__ void partials_kernel(double* __restrict__ partials,
                                const SquaresChunk* __restrict__ chunks) {
  __shared__ double shared[32];
  const SquaresChunk c = chunks[blockIdx.x];
  double sum;
  switch (c.kind) {
    case kBF16:
      sum = chunk_statistic<S>(static_cast<const detail::bf16*>(c.data), c.start, c.end);
      break;
    case kF16:
      sum = chunk_statistic<S>(static_cast<const detail::f16*>(c.data), c.start, c.end);
      break;
    default:
      sum = chunk_statistic<S>(static_cast<const float*>(c.data), c.start, c.end);
      break;
  }
  sum = block_sum_double(sum, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

template <typename Out>
__global__ void finish_kernel(Out* __restrict__ out, const double* __restrict__ partials,
                              int64_t n) {
  __shared__ double shared[32];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += partials[i];
  sum = block_sum_double(sum, shared);
  if (threadIdx.x == 0) out[0] = Out(sum);
}

// The statistic S of all of `tensors` into out [1] of type Out.
template <Statistic S, typename Out>
void tensor_statistic(const char* op, Tensor out, std::span<const Tensor> tensors, Stream stream) {
  detail::DeviceGuard guard(out.device());
  cudaStream_t s = detail::cuda_stream(stream);
  std::vector<SquaresChunk> chunks;
  for (const Tensor& t : tensors) {
    const int64_t n = t.numel();
    if (n == 0) continue;
    int32_t kind = t.dtype() == DType::bf16 ? kBF16 : t.dtype() == DType::f16 ? kF16 : kF32;
    BRAID_CHECK(is_floating(t.dtype()), op, ": ", dtype_name(t.dtype()), " tensor");
    for (int64_t start = 0; start < n; start += kChunk) {
      chunks.push_back({t.data(), start, std::min(n, start + kChunk), kind});
    }
  }
  if (chunks.empty()) {
    CUDA_CHECK(cudaMemsetAsync(out.data(), 0, sizeof(Out), s));
    return;
  }
  BRAID_CHECK(chunks.size() <= size_t(INT32_MAX), op, ": ", chunks.size(),
              " chunks exceed the grid");
  detail::ScratchLayout layout;
  const size_t table_at = layout.reserve<SquaresChunk>(int64_t(chunks.size()));
  const size_t partials_at = layout.reserve<double>(int64_t(chunks.size()));
  void* base = detail::stream_scratch(out.device(), s, layout.bytes());
  // `chunks` is gone when this returns, long before the stream reaches the copy: it is staged.
  detail::copy_to_device_async(out.device(), s, detail::at_offset<SquaresChunk>(base, table_at),
                               chunks.data(), chunks.size() * sizeof(SquaresChunk));
  double* partials = detail::at_offset<double>(base, partials_at);
  partials_kernel<S><<<unsigned(chunks.size()), kThreads, 0, s>>>(
      partials, detail::at_offset<SquaresChunk>(base, table_at));
  CUDA_CHECK_LAUNCH();
  finish_kernel<Out>
      <<<1, kFinishThreads, 0, s>>>(out.data_ptr<Out>(), partials, int64_t(chunks.size()));
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void sum_of_squares(Tensor out, std::span<const Tensor> tensors, Stream stream) {
  tensor_statistic<Statistic::squares, float>("sum_of_squares", out, tensors, stream);
}

void count_zeros(Tensor out, std::span<const Tensor> tensors, Stream stream) {
  tensor_statistic<Statistic::zeros, int64_t>("count_zeros", out, tensors, stream);
}

}  // namespace braid::ops::cuda
