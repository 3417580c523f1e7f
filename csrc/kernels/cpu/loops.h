#pragma once
// Internal helpers shared by the CPU kernels: a chunked OpenMP loop, function multiversioning
// for the hot inner loops, and vectorisable float math (exp, tanh, sigmoid).

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cstdint>

// The project compiles for baseline x86-64 (SSE2). A function marked BRAID_CPU_MULTIVERSION is
// compiled three times (AVX-512, AVX2 + FMA, baseline) and the dynamic loader picks the best
// one this CPU runs, so one binary runs on any x86-64 and still uses wide vectors.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BRAID_CPU_MULTIVERSION \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define BRAID_CPU_MULTIVERSION
#endif

namespace braid::ops::cpu {

// Runs f(begin, end) over [0, n) split into one contiguous chunk per OpenMP thread; runs
// inline when n <= grain (an OpenMP region costs microseconds) or when already in parallel.
// f must not throw.
template <typename F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  int64_t threads =
      std::min<int64_t>(omp_get_max_threads(), (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (threads <= 1 || omp_in_parallel()) {
    f(int64_t(0), n);
    return;
  }
#pragma omp parallel num_threads(int(threads))
  {
    int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t begin = n * t / nt, end = n * (t + 1) / nt;
    if (begin < end) f(begin, end);
  }
}

// exp(x) in f32 written without branches so that loops calling it vectorise (Cephes' expf:
// x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial; error <= 1.5 ulp for x in
// [-87.3, 88.7]). Below that range it returns 0, above it +inf; NaN stays NaN.
inline float exp_f32(float x) {
  constexpr float kHi = 88.72283905206835f, kLo = -87.33654475055310f;
  float xc = x > kHi ? kHi : (x < kLo ? kLo : x);
  // Round x / ln2 to the nearest integer n by adding 1.5 * 2^23: n lands in t's low bits.
  float t = xc * 1.44269504088896341f + 12582912.0f;
  float n = t - 12582912.0f;
  float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n as two factors so that n in [-126, 128] never overflows the exponent field.
  int32_t k = int32_t(std::bit_cast<uint32_t>(t) - 0x4B400000u);
  int32_t k1 = k >> 1;
  float y = p * std::bit_cast<float>(uint32_t(k1 + 127) << 23) *
            std::bit_cast<float>(uint32_t(k - k1 + 127) << 23);
  y = x < kLo ? 0.0f : y;
  return x > kHi ? __builtin_inff() : y;
}

// Defined in elementwise.cpp, vectorised:
// out[0, n) += x[0, n)
void add_into(float* out, const float* x, int64_t n);
// max of x[0, n) (-inf for n = 0; NaNs are skipped, callers see them through their sums).
float max_of(const float* x, int64_t n);

// 1 / (1 + exp(-x)).
inline float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

// tanh(x) = 1 - 2 / (exp(2x) + 1); absolute error ~1e-7 (relative error grows near 0, where
// the callers add it to 1).
inline float tanh_f32(float x) { return 1.0f - 2.0f / (exp_f32(2.0f * x) + 1.0f); }

}  // namespace braid::ops::cpu
