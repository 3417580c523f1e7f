#pragma once
// Internal: deterministic column sums, out[k][c] += sum over rows r of value_k(r, c), for the
// parameter gradients of bias, layernorm and rmsnorm. Two kernels and no atomics: blocks of
// 32 columns x one split of rows write partial sums, then one thread per column adds the
// splits in order. The split count depends on the row count only, so the result is the same
// on every run and every device.

#include <algorithm>

#include "kernels/cuda/common.cuh"

namespace braid::ops::cuda::detail {

constexpr int kColumnTile = 32;  // columns per block (threadIdx.x)
constexpr int kColumnRows = 8;   // rows in flight per block (threadIdx.y)

template <int kOuts>
struct ColumnOutputs {
  float* out[kOuts];
};

// Source: a functor with __device__ void operator()(int64_t r, int64_t c, float (&v)[kOuts]).
template <int kOuts, typename Source>
__global__ void column_partials_kernel(float* __restrict__ partials, int64_t rows, int64_t cols,
                                       int64_t rows_per_split, Source source) {
  __shared__ float acc[kOuts][kColumnRows][kColumnTile + 1];
  const int64_t c = int64_t(blockIdx.x) * kColumnTile + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_split;
  const int64_t r1 = r0 + rows_per_split < rows ? r0 + rows_per_split : rows;
  float sum[kOuts];
#pragma unroll
  for (int k = 0; k < kOuts; ++k) sum[k] = 0.0f;
  if (c < cols) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColumnRows) {
      float v[kOuts];
      source(r, c, v);
#pragma unroll
      for (int k = 0; k < kOuts; ++k) sum[k] += v[k];
    }
  }
#pragma unroll
  for (int k = 0; k < kOuts; ++k) acc[k][threadIdx.y][threadIdx.x] = sum[k];
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    const int64_t splits = gridDim.y;
#pragma unroll
    for (int k = 0; k < kOuts; ++k) {
      float s = 0.0f;
      for (int y = 0; y < kColumnRows; ++y) s += acc[k][y][threadIdx.x];
      partials[(k * splits + blockIdx.y) * cols + c] = s;
    }
  }
}

template <int kOuts>
__global__ void column_finish_kernel(ColumnOutputs<kOuts> outputs,
                                     const float* __restrict__ partials, int64_t splits,
                                     int64_t cols) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
#pragma unroll
  for (int k = 0; k < kOuts; ++k) {
    float s = 0.0f;
    for (int64_t i = 0; i < splits; ++i) s += partials[(k * splits + i) * cols + c];
    outputs.out[k][c] += s;
  }
}

// Adds the column sums of `source` over [rows, cols] into outputs.out[k][0..cols).
template <int kOuts, typename Source>
void column_sums_add(ColumnOutputs<kOuts> outputs, int64_t rows, int64_t cols, Source source,
                     Device device, cudaStream_t stream) {
  const int64_t splits = std::clamp<int64_t>(ceil_div(rows, 256), 1, 128);
  const int64_t rows_per_split = ceil_div(rows, splits);
  float* partials = static_cast<float*>(
      stream_scratch(device, stream, size_t(kOuts) * size_t(splits) * size_t(cols) * 4));
  dim3 grid(unsigned(ceil_div(cols, kColumnTile)), unsigned(splits));
  dim3 block(kColumnTile, kColumnRows);
  column_partials_kernel<kOuts>
      <<<grid, block, 0, stream>>>(partials, rows, cols, rows_per_split, source);
  CUDA_CHECK_LAUNCH();
  constexpr int kThreads = 256;
  column_finish_kernel<kOuts><<<unsigned(ceil_div(cols, kThreads)), kThreads, 0, stream>>>(
      outputs, partials, splits, cols);
  CUDA_CHECK_LAUNCH();
}

}  // namespace braid::ops::cuda::detail
