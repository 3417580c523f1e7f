// sum_of_squares on the CPU: the squared global norm of many tensors, accumulated in double
// over fixed chunks (summed in order), so the result does not depend on the thread count; and
// count_zeros, the number of zero elements, alike.
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {
namespace {

constexpr int64_t kChunk = 1 << 16;

BRAID_CPU_MULTIVERSION double sum_sq_f32(const float* x, int64_t n) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += double(x[i]) * double(x[i]);
  return sum;
}

double sum_sq_16bit(const uint16_t* x, int64_t n, DType dtype) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    double v = dtype == DType::bf16 ? bf16_to_float(x[i]) : f16_to_float(x[i]);
    sum += v * v;
  }
  return sum;
}

int64_t zeros_f32(const float* x, int64_t n) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += x[i] == 0.0f;
  return count;
}

int64_t zeros_16bit(const uint16_t* x, int64_t n) {
  int64_t count = 0;  // bf16 and f16 zeros alike: every bit but the sign clear
  for (int64_t i = 0; i < n; ++i) count += (x[i] & 0x7fff) == 0;
  return count;
}

// `chunk_value(data, dtype, begin, length)` of every fixed chunk of every tensor, summed in
// order.
template <typename T, typename ChunkValue>
T sum_over_chunks(std::span<const Tensor> tensors, ChunkValue chunk_value) {
  T total = 0;
  for (const Tensor& t : tensors) {
    const int64_t n = t.numel(), chunks = (n + kChunk - 1) / kChunk;
    if (n == 0) continue;
    std::vector<T> partial(static_cast<size_t>(chunks));
    const void* data = t.data();
    const DType dtype = t.dtype();
    parallel_for(chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        int64_t begin = c * kChunk, len = std::min(kChunk, n - begin);
        partial[size_t(c)] = chunk_value(data, dtype, begin, len);
      }
    });
    for (T p : partial) total += p;
  }
  return total;
}

}  // namespace

void sum_of_squares(Tensor out, std::span<const Tensor> tensors, Stream) {
  out.data_ptr<float>()[0] = float(sum_over_chunks<double>(
      tensors, [](const void* data, DType dtype, int64_t begin, int64_t len) {
        return dtype == DType::f32
                   ? sum_sq_f32(static_cast<const float*>(data) + begin, len)
                   : sum_sq_16bit(static_cast<const uint16_t*>(data) + begin, len, dtype);
      }));
}

void count_zeros(Tensor out, std::span<const Tensor> tensors, Stream) {
  out.data_ptr<int64_t>()[0] = sum_over_chunks<int64_t>(
      tensors, [](const void* data, DType dtype, int64_t begin, int64_t len) {
        return dtype == DType::f32 ? zeros_f32(static_cast<const float*>(data) + begin, len)
                                   : zeros_16bit(static_cast<const uint16_t*>(data) + begin, len);
      });
}

}  // namespace braid::ops::cpu
