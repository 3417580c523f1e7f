// Rotary position embedding on channels [F, F + R) of each head (F = first_channel, R = 2 x
// the frequencies): as HF Llama computes it (rotate_half: channel F + i pairs with F + i + R/2),
// or interleaved (GPT-J, DeepSeek: F + 2i pairs with F + 2i + 1); either pair turns by angle
// pos * inv_freq[i], and the other channels pass through. The arithmetic follows the CPU
// reference (csrc/kernels/cpu/rope.cpp): inv_freq from the host (ops::RotaryFrequencies, f32),
// angle = float(pos) * inv_freq in f32, cos and sin of that angle in double, rounded, times
// attention_factor (YaRN's) in f32: exact at 1, which leaves the kernel's results unchanged.
#include <algorithm>
#include <map>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace braid::ops::cuda {
namespace {

using detail::from_float;
using detail::to_float;

constexpr int kRopeThreads = 256;

// One block per (row s, batch stride): the block's cos/sin table for row s's position sits in
// shared memory; threads cover (head, i) pairs, the y dimension of the grid covers batches. The
// position is position_offset + s, or with `positions` (i32 [B, S]) position_offset +
// positions[b][s]: then the table is refilled for each batch row.
// Pair i of a head is channels (first + i, first + i + half), or (first + 2i, first + 2i + 1)
// when interleaved. sign = 1 rotates by +angle (forward), -1 by -angle (backward); cos and sin
// are scaled by `factor`. out may alias x.
template <typename T>
__global__ void rope_kernel(T* out, const T* x, const float* __restrict__ inv_freq, int64_t b_len,
                            int64_t s_len, int64_t h_len, int64_t d, int64_t half, int64_t first,
                            bool interleaved, int64_t position_offset,
                            const int32_t* __restrict__ positions, float factor, float sign) {
  extern __shared__ float table[];  // cos [half], then sin [half]
  const int64_t s = blockIdx.x;
  const int64_t pairs = h_len * half;
  const int64_t partner = interleaved ? 1 : half;  // channel distance within a pair
  for (int64_t b = blockIdx.y; b < b_len; b += gridDim.y) {
    if (positions != nullptr || b == blockIdx.y) {  // block-uniform
      const float pos =
          float(position_offset + (positions != nullptr ? positions[b * s_len + s] : s));
      __syncthreads();  // the previous row is done with the table
      for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
        const float angle = pos * inv_freq[i];
        table[i] = float(cos(double(angle))) * factor;
        table[half + i] = sign * (float(sin(double(angle))) * factor);
      }
      __syncthreads();
    }
    const int64_t base = (b * s_len + s) * h_len * d;
    for (int64_t t = threadIdx.x; t < pairs; t += blockDim.x) {
      const int64_t head = t / half, i = t % half;
      const int64_t at = base + head * d + first + (interleaved ? 2 * i : i);
      const float x1 = to_float(x[at]), x2 = to_float(x[at + partner]);
      const float c = table[i], sn = table[half + i];
      out[at] = from_float<T>(x1 * c - x2 * sn);
      out[at + partner] = from_float<T>(x2 * c + x1 * sn);
    }
    if (out != x) {  // the channels outside [first, first + 2 * half) pass through
      const int64_t rest = d - 2 * half, kept = h_len * rest;
      for (int64_t t = threadIdx.x; t < kept; t += blockDim.x) {
        const int64_t j = t % rest;
        const int64_t at = base + (t / rest) * d + (j < first ? j : j + 2 * half);
        out[at] = x[at];
      }
    }
  }
}

// The frequencies on `device`: uploaded once per distinct table (a model has one or two) and
// kept for the life of the process. Uploaded on the caller's stream, which is then
// synchronised: a cudaMemcpy from pageable memory runs on the legacy default stream, which
// does not order with non-blocking streams, and it may return before the data has landed.
const float* inv_freq_table(Device device, cudaStream_t stream, std::span<const float> inv_freq) {
  static std::mutex mutex;
  static auto* tables = new std::map<std::pair<int, std::vector<float>>, const float*>();
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_pair(device.index, std::vector<float>(inv_freq.begin(), inv_freq.end()));
  auto it = tables->find(key);
  if (it != tables->end()) return it->second;
  std::vector<float> host(inv_freq.begin(), inv_freq.end());
  host.resize(std::max<size_t>(host.size(), 1));
  size_t nbytes = host.size() * sizeof(float);
  void* dev = allocator_for(device).allocate(nbytes);
  CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), nbytes, cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));  // other streams may use the table next
  const float* table = static_cast<const float*>(dev);
  tables->emplace(key, table);
  return table;
}

void rope(const Tensor& out, const Tensor& x, std::span<const float> inv_freq_host, int64_t first,
          bool interleaved, int64_t position_offset, const Tensor& positions, float factor,
          float sign, Stream stream, const char* op) {
  detail::DeviceGuard guard(x.device());
  const int64_t b = x.size(0), s = x.size(1), h = x.size(2), d = x.size(3);
  const auto half = int64_t(inv_freq_host.size());
  if (d == 0) return;
  BRAID_CHECK(s <= INT32_MAX, op, ": sequence length ", s, " exceeds the grid");
  dim3 grid(unsigned(s), unsigned(std::min<int64_t>(b, 1024)));
  size_t smem = size_t(std::max<int64_t>(2 * half, 1)) * sizeof(float);
  BRAID_CHECK(smem <= 48 * 1024, op, ": head dim ", d, " is too large for the rope kernel");
  cudaStream_t cs = detail::cuda_stream(stream);
  const float* inv_freq = inv_freq_table(x.device(), cs, inv_freq_host);
  detail::dispatch_activation(x.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    rope_kernel<T><<<grid, kRopeThreads, smem, cs>>>(
        static_cast<T*>(out.data()), static_cast<const T*>(x.data()), inv_freq, b, s, h, d, half,
        first, interleaved, position_offset,
        positions.defined() ? positions.data_ptr<int32_t>() : nullptr, factor, sign);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void rope_forward(Tensor out, const Tensor& x, std::span<const float> inv_freq,
                  int64_t first_channel, bool interleaved, int64_t position_offset,
                  const Tensor& positions, float attention_factor, Stream stream) {
  rope(out, x, inv_freq, first_channel, interleaved, position_offset, positions, attention_factor,
       1.0f, stream, "rope_forward");
}

void rope_backward(Tensor dx, const Tensor& dout, std::span<const float> inv_freq,
                   int64_t first_channel, bool interleaved, int64_t position_offset,
                   const Tensor& positions, float attention_factor, Stream stream) {
  // The rotation is orthogonal: its transpose turns by the opposite angle (the factor stays).
  rope(dx, dout, inv_freq, first_channel, interleaved, position_offset, positions, attention_factor,
       -1.0f, stream, "rope_backward");
}

}  // namespace braid::ops::cuda
