// Vocab-parallel cross-entropy: per-row partials (max, sum of exp, target logit) in one online
// softmax pass, the loss from combined partials, and the logits gradient. One block per row.

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace braid::ops::cuda {
namespace {

using detail::load_pack;
using detail::store_pack;
using detail::to_float;

constexpr int kRowThreads = 512;

// Running (max, sum of exp(x - max)) of a softmax row. -inf logits contribute nothing; NaN
// logits make the sum NaN, as on the CPU. A NaN never becomes the max, so while max is -inf
// the sum is 0 or NaN: it is then carried as it is (never multiplied by exp(-inf - m) = 0,
// which would drop a NaN seen before the first finite logit).
struct OnlineSoftmax {
  float max = -INFINITY;
  float sum = 0.0f;

  __device__ void add(float x) {
    if (x > max) {
      sum = (max == -INFINITY ? sum : sum * expf(max - x)) + 1.0f;
      max = x;
    } else if (max != -INFINITY || x != x) {
      sum += expf(x - max);
    }
  }

  __device__ void merge(float other_max, float other_sum) {
    float m = fmaxf(max, other_max);
    float a = max == -INFINITY ? sum : sum * expf(max - m);
    float b = other_max == -INFINITY ? other_sum : other_sum * expf(other_max - m);
    max = m;
    sum = a + b;
  }
};

template <int V, typename T>
__global__ void cross_entropy_partials_kernel(float* __restrict__ max_out,
                                              float* __restrict__ sumexp_out,
                                              float* __restrict__ target_logit,
                                              const T* __restrict__ logits,
                                              const int32_t* __restrict__ targets, int64_t tokens,
                                              int64_t v_local, int64_t vocab_offset) {
  __shared__ float shared_max[32], shared_sum[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const T* row = logits + t * v_local;
    OnlineSoftmax acc;
    for (int64_t j = int64_t(threadIdx.x) * V; j < v_local; j += int64_t(blockDim.x) * V) {
      float v[V];
      load_pack<V>(row + j, v);
#pragma unroll
      for (int k = 0; k < V; ++k) acc.add(v[k]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      float m = __shfl_xor_sync(detail::kFullMask, acc.max, o);
      float s = __shfl_xor_sync(detail::kFullMask, acc.sum, o);
      acc.merge(m, s);
    }
    if (lane == 0) {
      shared_max[warp] = acc.max;
      shared_sum[warp] = acc.sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      OnlineSoftmax total;
      for (int w = 0; w < warps; ++w) total.merge(shared_max[w], shared_sum[w]);
      max_out[t] = total.max;
      sumexp_out[t] = total.sum;
      const int64_t target = targets[t];
      const int64_t local = target - vocab_offset;
      target_logit[t] = target >= 0 && local >= 0 && local < v_local ? to_float(row[local]) : 0.0f;
    }
    __syncthreads();  // shared_* are reused by the next row
  }
}

__global__ void cross_entropy_rescale_kernel(float* __restrict__ sumexp,
                                             const float* __restrict__ max,
                                             const float* __restrict__ global_max, int64_t tokens) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < tokens; t += stride) {
    const float se = sumexp[t];
    sumexp[t] = se == 0.0f ? 0.0f : se * expf(max[t] - global_max[t]);  // empty slice: -inf max
  }
}

__global__ void cross_entropy_loss_kernel(float* __restrict__ loss, const float* __restrict__ max,
                                          const float* __restrict__ sumexp,
                                          const float* __restrict__ target_logit,
                                          const int32_t* __restrict__ targets, int64_t tokens) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < tokens; t += stride) {
    loss[t] = targets[t] < 0 ? 0.0f : logf(sumexp[t]) + max[t] - target_logit[t];
  }
}

// dlogits may alias logits: each element is read, then written, by the same thread.
template <int V, typename T>
__global__ void cross_entropy_backward_kernel(T* dlogits, const T* logits,
                                              const int32_t* __restrict__ targets,
                                              const float* __restrict__ max,
                                              const float* __restrict__ sumexp,
                                              const float* __restrict__ dloss, int64_t tokens,
                                              int64_t v_local, int64_t vocab_offset) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t target = targets[t];
    const T* row = logits + t * v_local;
    T* drow = dlogits + t * v_local;
    const float m = max[t], se = sumexp[t];
    const float dl = target < 0 ? 0.0f : dloss[t];
    const int64_t local = target < 0 ? -1 : target - vocab_offset;
    for (int64_t j = int64_t(threadIdx.x) * V; j < v_local; j += int64_t(blockDim.x) * V) {
      float v[V];
      load_pack<V>(row + j, v);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float p = expf(v[k] - m) / se;
        v[k] = target < 0 ? 0.0f : dl * (p - (j + k == local ? 1.0f : 0.0f));
      }
      store_pack<V>(drow + j, v);
    }
  }
}

unsigned row_blocks(int64_t tokens, int device) {
  return unsigned(std::min<int64_t>(tokens, int64_t(detail::sm_count(device)) * 8));
}

}  // namespace

void cross_entropy_partials(Tensor max, Tensor sumexp, Tensor target_logit, const Tensor& logits,
                            const Tensor& targets, int64_t vocab_offset, Stream stream) {
  detail::DeviceGuard guard(logits.device());
  const int64_t tokens = logits.size(0), v_local = logits.size(1);
  cudaStream_t s = detail::cuda_stream(stream);
  const unsigned blocks = row_blocks(tokens, logits.device().index);
  detail::dispatch_activation(logits.dtype(), "cross_entropy_partials", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* l = static_cast<const T*>(logits.data());
    auto launch = [&](auto v) {
      cross_entropy_partials_kernel<decltype(v)::value, T><<<blocks, kRowThreads, 0, s>>>(
          max.data_ptr<float>(), sumexp.data_ptr<float>(), target_logit.data_ptr<float>(), l,
          targets.data_ptr<int32_t>(), tokens, v_local, vocab_offset);
    };
    if (detail::pack_width<T>(v_local, {l}) > 1) {
      launch(std::integral_constant<int, detail::kPack<T>>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
    CUDA_CHECK_LAUNCH();
  });
}

void cross_entropy_rescale(Tensor sumexp, const Tensor& max, const Tensor& global_max,
                           Stream stream) {
  detail::DeviceGuard guard(sumexp.device());
  const int64_t tokens = sumexp.numel();
  constexpr int kThreads = 256;
  cross_entropy_rescale_kernel<<<detail::grid_for(tokens, kThreads, sumexp.device().index),
                                 kThreads, 0, detail::cuda_stream(stream)>>>(
      sumexp.data_ptr<float>(), max.data_ptr<float>(), global_max.data_ptr<float>(), tokens);
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_loss(Tensor loss, const Tensor& max, const Tensor& sumexp,
                        const Tensor& target_logit, const Tensor& targets, Stream stream) {
  detail::DeviceGuard guard(loss.device());
  const int64_t tokens = targets.numel();
  constexpr int kThreads = 256;
  cross_entropy_loss_kernel<<<detail::grid_for(tokens, kThreads, loss.device().index), kThreads, 0,
                              detail::cuda_stream(stream)>>>(
      loss.data_ptr<float>(), max.data_ptr<float>(), sumexp.data_ptr<float>(),
      target_logit.data_ptr<float>(), targets.data_ptr<int32_t>(), tokens);
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_backward(Tensor dlogits, const Tensor& logits, const Tensor& targets,
                            const Tensor& max, const Tensor& sumexp, const Tensor& dloss,
                            int64_t vocab_offset, Stream stream) {
  detail::DeviceGuard guard(logits.device());
  const int64_t tokens = logits.size(0), v_local = logits.size(1);
  cudaStream_t s = detail::cuda_stream(stream);
  const unsigned blocks = row_blocks(tokens, logits.device().index);
  detail::dispatch_activation(logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* d = static_cast<T*>(dlogits.data());
    const T* l = static_cast<const T*>(logits.data());
    auto launch = [&](auto v) {
      cross_entropy_backward_kernel<decltype(v)::value, T><<<blocks, kRowThreads, 0, s>>>(
          d, l, targets.data_ptr<int32_t>(), max.data_ptr<float>(), sumexp.data_ptr<float>(),
          dloss.data_ptr<float>(), tokens, v_local, vocab_offset);
    };
    if (detail::pack_width<T>(v_local, {d, l}) > 1) {
      launch(std::integral_constant<int, detail::kPack<T>>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace braid::ops::cuda
