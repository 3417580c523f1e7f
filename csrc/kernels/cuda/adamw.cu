// Multi-tensor AdamW: one launch updates every group. A table in device memory (copied from
// the host into the stream's scratch buffer) lists the groups and the fixed-size chunks they
// are cut into; each block updates one chunk. The arithmetic is the CPU reference's
// (csrc/kernels/cpu/adamw.cpp, itself torch.optim.AdamW's), with every rounding step spelled
// out (no fused multiply-adds), so CUDA and CPU produce the same bits.

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace braid::ops::cuda {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per block
constexpr int kThreads = 512;

enum ModelCopy : int32_t { kNoCopy = 0, kCopyF32 = 1, kCopyBF16 = 2, kCopyF16 = 3 };

struct AdamWGroupDesc {
  float* master;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* model;
  int64_t numel;
  float decay;  // 1 - lr * weight_decay, rounded to f32 as torch does
  int32_t model_copy;
  int32_t packed;  // every pointer aligned for 4-element packs
};

struct AdamWChunkDesc {
  int32_t group;
  int32_t unused = 0;
  int64_t start;
};

struct AdamWScalars {
  float one_minus_b1, beta2, one_minus_b2, step_size, bc2_sqrt, eps, grad_scale;
};

template <int N>
__device__ __forceinline__ void adamw_elements(const AdamWGroupDesc& g, int64_t i,
                                               const AdamWScalars& c) {
  using detail::Pack;
  using P = Pack<float, N>;
  P p = *reinterpret_cast<const P*>(g.master + i);
  P gr = *reinterpret_cast<const P*>(g.grad + i);
  P m = *reinterpret_cast<const P*>(g.exp_avg + i);
  P v = *reinterpret_cast<const P*>(g.exp_avg_sq + i);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float gk = __fmul_rn(gr.v[k], c.grad_scale);
    float pk = __fmul_rn(p.v[k], g.decay);
    float mk = __fadd_rn(m.v[k], __fmul_rn(c.one_minus_b1, __fsub_rn(gk, m.v[k])));
    float vk = __fadd_rn(__fmul_rn(v.v[k], c.beta2), __fmul_rn(__fmul_rn(c.one_minus_b2, gk), gk));
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vk), c.bc2_sqrt), c.eps);
    p.v[k] = __fadd_rn(pk, __fdiv_rn(__fmul_rn(-c.step_size, mk), denom));
    m.v[k] = mk;
    v.v[k] = vk;
  }
  *reinterpret_cast<P*>(g.master + i) = p;
  *reinterpret_cast<P*>(g.exp_avg + i) = m;
  *reinterpret_cast<P*>(g.exp_avg_sq + i) = v;
  switch (g.model_copy) {
    case kCopyF32:
      *reinterpret_cast<P*>(static_cast<float*>(g.model) + i) = p;
      break;
    case kCopyBF16:
      detail::store_pack<N>(static_cast<detail::bf16*>(g.model) + i, p.v);
      break;
    case kCopyF16:
      detail::store_pack<N>(static_cast<detail::f16*>(g.model) + i, p.v);
      break;
    default:
      break;
  }
}

__global__ void adamw_kernel(const AdamWGroupDesc* __restrict__ groups,
                             const AdamWChunkDesc* __restrict__ chunks, AdamWScalars c) {
  const AdamWChunkDesc chunk = chunks[blockIdx.x];
  const AdamWGroupDesc g = groups[chunk.group];
  const int64_t end = chunk.start + kChunk < g.numel ? chunk.start + kChunk : g.numel;
  int64_t i = chunk.start;
  if (g.packed) {
    const int64_t packed_end = chunk.start + (end - chunk.start) / 4 * 4;
    for (int64_t j = i + int64_t(threadIdx.x) * 4; j < packed_end; j += int64_t(blockDim.x) * 4) {
      adamw_elements<4>(g, j, c);
    }
    i = packed_end;
  }
  for (int64_t j = i + threadIdx.x; j < end; j += blockDim.x) adamw_elements<1>(g, j, c);
}

bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

void adamw_step(std::span<const AdamWGroup> groups, const AdamWHyper& hyper, Stream stream) {
  const Device device = groups.front().master.device();
  detail::DeviceGuard guard(device);
  cudaStream_t s = detail::cuda_stream(stream);

  const double bc1 = 1.0 - std::pow(double(hyper.beta1), double(hyper.step));
  const double bc2 = 1.0 - std::pow(double(hyper.beta2), double(hyper.step));
  AdamWScalars c;
  c.one_minus_b1 = float(1.0 - double(hyper.beta1));
  c.beta2 = hyper.beta2;
  c.one_minus_b2 = float(1.0 - double(hyper.beta2));
  c.step_size = float(double(hyper.lr) / bc1);
  c.bc2_sqrt = float(std::sqrt(bc2));
  c.eps = hyper.eps;
  c.grad_scale = hyper.grad_scale;

  std::vector<AdamWGroupDesc> descs;
  std::vector<AdamWChunkDesc> chunks;
  for (const AdamWGroup& g : groups) {
    AdamWGroupDesc d{};
    d.master = g.master.data_ptr<float>();
    d.grad = g.grad.data_ptr<float>();
    d.exp_avg = g.exp_avg.data_ptr<float>();
    d.exp_avg_sq = g.exp_avg_sq.data_ptr<float>();
    d.numel = g.master.numel();
    d.decay = float(1.0 - double(hyper.lr) * double(g.weight_decay));
    d.model = g.model_param.defined() ? g.model_param.data() : nullptr;
    d.model_copy = kNoCopy;
    size_t model_pack = 16;
    if (g.model_param.defined()) {
      switch (g.model_param.dtype()) {
        case DType::f32:
          d.model_copy = kCopyF32;
          break;
        case DType::bf16:
          d.model_copy = kCopyBF16;
          model_pack = 8;
          break;
        case DType::f16:
          d.model_copy = kCopyF16;
          model_pack = 8;
          break;
        default:
          BRAID_FAIL("adamw_step: model_param is ", dtype_name(g.model_param.dtype()));
      }
    }
    d.packed = detail::aligned16(d.master) && detail::aligned16(d.grad) &&
               detail::aligned16(d.exp_avg) && detail::aligned16(d.exp_avg_sq) &&
               (d.model == nullptr || aligned_to(d.model, model_pack));
    BRAID_CHECK(descs.size() < size_t(INT32_MAX), "adamw_step: too many groups");
    for (int64_t start = 0; start < d.numel; start += kChunk) {
      chunks.push_back({int32_t(descs.size()), 0, start});
    }
    descs.push_back(d);
  }
  if (chunks.empty()) return;
  BRAID_CHECK(chunks.size() <= size_t(INT32_MAX), "adamw_step: ", chunks.size(),
              " chunks exceed the grid");

  // The tables travel to the device in one copy, laid out as they are on the host.
  detail::ScratchLayout layout;
  const size_t groups_at = layout.reserve<AdamWGroupDesc>(int64_t(descs.size()));
  const size_t chunks_at = layout.reserve<AdamWChunkDesc>(int64_t(chunks.size()));
  std::vector<char> host(layout.bytes());
  std::memcpy(host.data() + groups_at, descs.data(), descs.size() * sizeof(AdamWGroupDesc));
  std::memcpy(host.data() + chunks_at, chunks.data(), chunks.size() * sizeof(AdamWChunkDesc));
  void* table = detail::stream_scratch(device, s, host.size());
  // `host` is gone when this returns, long before the stream reaches the copy: it is staged.
  detail::copy_to_device_async(device, s, table, host.data(), host.size());
  adamw_kernel<<<unsigned(chunks.size()), kThreads, 0, s>>>(
      detail::at_offset<AdamWGroupDesc>(table, groups_at),
      detail::at_offset<AdamWChunkDesc>(table, chunks_at), c);
  CUDA_CHECK_LAUNCH();
}

}  // namespace braid::ops::cuda
