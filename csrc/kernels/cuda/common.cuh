#pragma once
// Internal helpers shared by the CUDA op files: stream and device handling, dtype dispatch,
// element conversions, vector packs, warp and block reductions, launch sizing, and the
// per-stream scratch buffer that ops with temporary memory draw from.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "braid/core/cuda_check.h"
#include "braid/core/stream.h"
#include "braid/core/tensor.h"

namespace braid::ops::cuda::detail {

using bf16 = __nv_bfloat16;
using f16 = __half;

inline cudaStream_t cuda_stream(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

// Makes `device` current for the scope (kernels launch on the current device), then
// restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(Device device) {
    CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device.index) CUDA_CHECK(cudaSetDevice(device.index));
    current_ = device.index;
  }
  ~DeviceGuard() {
    if (previous_ != current_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  int current_ = 0;
};

// ---- dtype dispatch: f(Tag<T>{}) with the C++ element type of `dtype`.
template <typename T>
struct Tag {
  using type = T;
};

// Activations: f32 or bf16 (what csrc/kernels/ops.cpp admits on CUDA).
template <typename F>
void dispatch_activation(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::f32:
      f(Tag<float>{});
      return;
    case DType::bf16:
      f(Tag<bf16>{});
      return;
    default:
      BRAID_FAIL(op, ": activations are f32 or bf16 on cuda, got ", dtype_name(dtype));
  }
}

// Any floating dtype: f32, bf16, f16.
template <typename F>
void dispatch_floating(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::f32:
      f(Tag<float>{});
      return;
    case DType::bf16:
      f(Tag<bf16>{});
      return;
    case DType::f16:
      f(Tag<f16>{});
      return;
    default:
      BRAID_FAIL(op, ": expected f32, bf16 or f16, got ", dtype_name(dtype));
  }
}

// ---- element conversions (f32 arithmetic everywhere; stores round to nearest even)
// Stores give the bits of the host's braid::float_to_bf16 / float_to_f16 (include/braid/core/
// dtype.h): the hardware conversions round the same way but turn every NaN into the canonical
// 0x7fff, dropping its sign and payload, so NaNs are converted as the host does.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(f16 x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float x) {
  if (x != x) return __ushort_as_bfloat16(uint16_t((__float_as_uint(x) >> 16) | 0x40u));
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ f16 from_float<f16>(float x) {
  if (x != x) return __ushort_as_half(uint16_t(((__float_as_uint(x) >> 16) & 0x8000u) | 0x7e00u));
  return __float2half_rn(x);
}

// ---- 16-byte vector packs
template <typename T>
constexpr int kPack = int(16 / sizeof(T));

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ void load_pack(const T* p, float (&out)[N]) {
  Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(pack.v[i]);
}

template <int N, typename T>
__device__ __forceinline__ void store_pack(T* p, const float (&in)[N]) {
  Pack<T, N> pack;
#pragma unroll
  for (int i = 0; i < N; ++i) pack.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, N>*>(p) = pack;
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Vector width for `n`-element rows of T at these pointers: kPack<T> when every pointer is
// 16-byte aligned and n is a multiple of it (so every row starts aligned), else 1.
template <typename T>
int pack_width(int64_t n, std::initializer_list<const void*> pointers) {
  if (n % kPack<T> != 0) return 1;
  for (const void* p : pointers)
    if (!aligned16(p)) return 1;
  return kPack<T>;
}

// ---- reductions
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Sum over the block, returned to every thread. `shared` holds >= 32 floats; blockDim.x is
// a multiple of 32. The order of additions is fixed, so the result is deterministic.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : 0.0f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* shared) {
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : -INFINITY;
  return warp_max(v);
}

// ---- launch sizing
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int sm_count(int device);

// Blocks for a grid-stride loop over `items` with `threads` per block: enough to fill the
// device a few times over, never more than the work needs.
inline unsigned grid_for(int64_t items, int threads, int device) {
  int64_t wanted = ceil_div(items, threads);
  int64_t cap = int64_t(sm_count(device)) * 16;
  int64_t blocks = wanted < cap ? wanted : cap;
  return unsigned(blocks < 1 ? 1 : blocks);
}

// ---- scratch memory
// A buffer owned by (device, stream) from the device's caching allocator, at least `nbytes`
// long, valid until the next stream_scratch call for the same stream. Work queued on that
// stream is ordered, so an op may use it freely; growing synchronises the stream before the
// old buffer goes back to the allocator (no other stream can then be handed memory that a
// queued kernel still uses).
void* stream_scratch(Device device, cudaStream_t stream, size_t nbytes);

// Queues a copy of `nbytes` of host memory at `src` into device memory `dst` on `stream`,
// through pinned staging memory of `device`: the copy is truly asynchronous, and `src` may be
// reused or freed as soon as this returns. (A cudaMemcpyAsync straight from pageable memory
// is only documented to "possibly" be synchronous, so the caller's buffer could otherwise be
// read after it is gone.) A staging buffer is reused only once its previous copy has
// completed (an event recorded after it), so the host never waits for earlier work.
void copy_to_device_async(Device device, cudaStream_t stream, void* dst, const void* src,
                          size_t nbytes);

// Carves consecutive 256-byte-aligned pieces out of one scratch request.
class ScratchLayout {
 public:
  // Reserves `count` elements of T; returns the byte offset of the piece.
  template <typename T>
  size_t reserve(int64_t count) {
    size_t offset = total_;
    total_ += (size_t(count) * sizeof(T) + 255) / 256 * 256;
    return offset;
  }
  size_t bytes() const { return total_; }

 private:
  size_t total_ = 0;
};

template <typename T>
T* at_offset(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

}  // namespace braid::ops::cuda::detail
