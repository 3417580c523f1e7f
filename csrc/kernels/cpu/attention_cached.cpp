// Attention of a few new queries over a KV cache (inference): one softmax row per (batch, query,
// head), keys read in place from the cache, with the head's sink logit in the denominator when
// there are sinks. Decoding has one query per sequence, so the work is
// split over all rows rather than blocked as the training kernel (attention.cpp) is.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {
namespace {

BRAID_CPU_MULTIVERSION float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

// acc[j] += w * x[j], j < n.
BRAID_CPU_MULTIVERSION void add_scaled(float* __restrict acc, const float* __restrict x, int64_t n,
                                       float w) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) acc[j] += w * x[j];
}

}  // namespace

void attention_cached_forward(Tensor out, const Tensor& q, const Tensor& k_cache,
                              const Tensor& v_cache, int64_t length, int64_t window,
                              const Tensor& sinks, Stream) {
  const int64_t b = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t cap = k_cache.size(1), hkv = k_cache.size(2), group = hq / hkv;
  const float scale = 1.0f / std::sqrt(float(d));
  float* o = out.data_ptr<float>();
  const float* pq = q.data_ptr<float>();
  const float* pk = k_cache.data_ptr<float>();
  const float* pv = v_cache.data_ptr<float>();
  const float* sink = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  const int64_t rows = b * sq * hq;  // row r = (batch * Sq + i) * Hq + head, as q is laid out
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, length * d));
  parallel_for(rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> p(static_cast<size_t>(length)), acc(static_cast<size_t>(d));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t head = r % hq, i = (r / hq) % sq, batch = r / (hq * sq);
      const int64_t kvh = head / group, seen = length - sq + i + 1;  // keys [first, seen)
      const int64_t first = window < 0 ? 0 : std::max<int64_t>(0, seen - 1 - window);
      const float* qr = pq + r * d;
      const float* kb = pk + (batch * cap * hkv + kvh) * d;  // key j at kb + j * hkv * d
      const float* vb = pv + (batch * cap * hkv + kvh) * d;
      float mx = -INFINITY;
      for (int64_t j = first; j < seen; ++j) {
        p[size_t(j)] = scale * dot(qr, kb + j * hkv * d, d);
        mx = std::max(mx, p[size_t(j)]);
      }
      // A sink joins the denominator only, shifted by the same (safe) maximum.
      if (sink != nullptr) mx = std::max(mx, sink[head]);
      float sum = sink != nullptr ? std::exp(sink[head] - mx) : 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = first; j < seen; ++j) {
        const float e = std::exp(p[size_t(j)] - mx);
        sum += e;
        add_scaled(acc.data(), vb + j * hkv * d, d, e);
      }
      const float inv = 1.0f / sum;
      for (int64_t dd = 0; dd < d; ++dd) o[r * d + dd] = acc[size_t(dd)] * inv;
    }
  });
}

}  // namespace braid::ops::cpu
