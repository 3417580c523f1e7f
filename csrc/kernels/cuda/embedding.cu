// Token embedding (vocab-parallel: ids outside [vocab_offset, vocab_offset + V_local) read
// zero rows and add nothing) and its gradient. The gradient is deterministic without
// atomics: tokens are stably sorted by row (cub radix sort), then one block sums each run of
// equal rows in token order and adds the sum into dweight.

#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace braid::ops::cuda {
namespace {

using detail::load_pack;
using detail::store_pack;

constexpr int kThreads = 256;

template <int V, typename T>
__global__ void embedding_forward_kernel(T* __restrict__ out, const int32_t* __restrict__ ids,
                                         const T* __restrict__ weight, int64_t tokens, int64_t c,
                                         int64_t v_local, int64_t vocab_offset) {
  const int64_t n = tokens * c;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * V;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n; i += stride) {
    const int64_t t = i / c, j = i % c;
    const int64_t row = int64_t(ids[t]) - vocab_offset;
    float v[V];
    if (row >= 0 && row < v_local) {
      load_pack<V>(weight + row * c + j, v);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = 0.0f;
    }
    store_pack<V>(out + i, v);
  }
}

// keys[t] = this rank's row of token t, or v_local (sorts last, skipped) when another rank
// owns it; values[t] = t.
__global__ void embedding_keys_kernel(uint32_t* __restrict__ keys, int32_t* __restrict__ values,
                                      const int32_t* __restrict__ ids, int64_t tokens,
                                      int64_t v_local, int64_t vocab_offset) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < tokens; t += stride) {
    const int64_t row = int64_t(ids[t]) - vocab_offset;
    keys[t] = uint32_t(row >= 0 && row < v_local ? row : v_local);
    values[t] = int32_t(t);
  }
}

// A block per run start p of the sorted keys: sums dout over the run's tokens (in token
// order, the sort is stable) column by column, then adds the sums into dweight's row.
template <typename T>
__global__ void embedding_backward_kernel(float* __restrict__ dweight, const T* __restrict__ dout,
                                          const uint32_t* __restrict__ keys,
                                          const int32_t* __restrict__ tokens_of, int64_t tokens,
                                          int64_t c, uint32_t v_local) {
  for (int64_t p = blockIdx.x; p < tokens; p += gridDim.x) {
    const uint32_t key = keys[p];
    if (key >= v_local || (p > 0 && keys[p - 1] == key)) continue;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      float sum = 0.0f;
      for (int64_t q = p; q < tokens && keys[q] == key; ++q) {
        sum += detail::to_float(dout[int64_t(tokens_of[q]) * c + j]);
      }
      dweight[int64_t(key) * c + j] += sum;
    }
  }
}

int bits_for(uint64_t value) {
  int bits = 1;
  while (bits < 32 && (value >> bits) != 0) ++bits;
  return bits;
}

}  // namespace

void embedding_forward(Tensor out, const Tensor& ids, const Tensor& weight, int64_t vocab_offset,
                       Stream stream) {
  detail::DeviceGuard guard(out.device());
  const int64_t tokens = ids.numel(), v_local = weight.size(0), c = weight.size(1);
  cudaStream_t s = detail::cuda_stream(stream);
  const int device = out.device().index;
  detail::dispatch_activation(weight.dtype(), "embedding_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out.data());
    const T* w = static_cast<const T*>(weight.data());
    const int32_t* id = ids.data_ptr<int32_t>();
    if (detail::pack_width<T>(c, {o, w}) > 1) {
      constexpr int V = detail::kPack<T>;
      embedding_forward_kernel<V, T>
          <<<detail::grid_for(tokens * c / V, kThreads, device), kThreads, 0, s>>>(
              o, id, w, tokens, c, v_local, vocab_offset);
    } else {
      embedding_forward_kernel<1, T>
          <<<detail::grid_for(tokens * c, kThreads, device), kThreads, 0, s>>>(
              o, id, w, tokens, c, v_local, vocab_offset);
    }
    CUDA_CHECK_LAUNCH();
  });
}

void embedding_backward(Tensor dweight, const Tensor& dout, const Tensor& ids, int64_t vocab_offset,
                        Stream stream) {
  detail::DeviceGuard guard(dweight.device());
  const int64_t tokens = ids.numel(), v_local = dweight.size(0), c = dweight.size(1);
  BRAID_CHECK(tokens <= INT32_MAX && v_local < INT32_MAX, "embedding_backward: ", tokens,
              " tokens and ", v_local, " rows exceed the 32-bit sort keys");
  cudaStream_t s = detail::cuda_stream(stream);
  const int device = dweight.device().index;
  const int end_bit = bits_for(uint64_t(v_local));  // keys are in [0, v_local]
  const int n = int(tokens);

  size_t sort_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, (const uint32_t*)nullptr,
                                             (uint32_t*)nullptr, (const int32_t*)nullptr,
                                             (int32_t*)nullptr, n, 0, end_bit, s));
  detail::ScratchLayout layout;
  size_t keys_in = layout.reserve<uint32_t>(tokens), keys_out = layout.reserve<uint32_t>(tokens);
  size_t vals_in = layout.reserve<int32_t>(tokens), vals_out = layout.reserve<int32_t>(tokens);
  size_t temp = layout.reserve<char>(int64_t(sort_bytes));
  void* base = detail::stream_scratch(dweight.device(), s, layout.bytes());

  embedding_keys_kernel<<<detail::grid_for(tokens, kThreads, device), kThreads, 0, s>>>(
      detail::at_offset<uint32_t>(base, keys_in), detail::at_offset<int32_t>(base, vals_in),
      ids.data_ptr<int32_t>(), tokens, v_local, vocab_offset);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      detail::at_offset<void>(base, temp), sort_bytes, detail::at_offset<uint32_t>(base, keys_in),
      detail::at_offset<uint32_t>(base, keys_out), detail::at_offset<int32_t>(base, vals_in),
      detail::at_offset<int32_t>(base, vals_out), n, 0, end_bit, s));

  unsigned blocks = unsigned(std::min<int64_t>(tokens, int64_t(detail::sm_count(device)) * 32));
  detail::dispatch_activation(dout.dtype(), "embedding_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    embedding_backward_kernel<T><<<blocks, kThreads, 0, s>>>(
        dweight.data_ptr<float>(), static_cast<const T*>(dout.data()),
        detail::at_offset<uint32_t>(base, keys_out), detail::at_offset<int32_t>(base, vals_out),
        tokens, c, uint32_t(v_local));
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace braid::ops::cuda
