#pragma once
// The attention tests' double-precision reference: causal grouped-query attention, one softmax
// row at a time, with the variations the kernels take (a first key per query: sliding windows
// and documents; a sink logit per head; a multiplier per probability: dropout).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace braid::testing {

// q [B, Sq, Hq, D], k, v [B, Sk, Hkv, D]: query row i sits at position Sk - Sq + i and sees the
// keys from first_key(b, position) to its own.
struct AttentionReference {
  AttentionReference(int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hkv, int64_t d)
      : b(b), sq(sq), sk(sk), hq(hq), hkv(hkv), d(d) {}

  int64_t b, sq, sk, hq, hkv, d;
  std::function<int64_t(int64_t b, int64_t position)> first_key = [](int64_t, int64_t) {
    return int64_t(0);
  };
  std::function<double(int64_t h)> sink;  // a logit that weighs no value; empty: none
  // What weighs value j after the softmax (dropout's mask times 1 / (1 - p)); empty: 1.
  std::function<double(int64_t b, int64_t h, int64_t position, int64_t key)> multiplier;

  // out [B, Sq, Hq, D] and lse [B, Hq, Sq] (the log-sum-exp of the scaled scores and the sink).
  std::pair<std::vector<double>, std::vector<double>> operator()(
      const std::vector<double>& q, const std::vector<double>& k,
      const std::vector<double>& v) const {
    std::vector<double> out(size_t(b * sq * hq * d)), lse(size_t(b * hq * sq));
    const double scale = 1.0 / std::sqrt(double(d));
    auto q_at = [&](int64_t bb, int64_t i, int64_t h) { return ((bb * sq + i) * hq + h) * d; };
    auto kv_at = [&](int64_t bb, int64_t j, int64_t h) { return ((bb * sk + j) * hkv + h) * d; };
    for (int64_t bb = 0; bb < b; ++bb) {
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t kvh = h / (hq / hkv);
        for (int64_t i = 0; i < sq; ++i) {
          const int64_t last = sk - sq + i, first = first_key(bb, last);
          std::vector<double> score(size_t(last + 1));
          double mx = sink ? sink(h) : -1e300;
          for (int64_t j = first; j <= last; ++j) {
            double dot = 0;
            for (int64_t dd = 0; dd < d; ++dd) {
              dot += q[size_t(q_at(bb, i, h) + dd)] * k[size_t(kv_at(bb, j, kvh) + dd)];
            }
            score[size_t(j)] = dot * scale;
            mx = std::max(mx, score[size_t(j)]);
          }
          double sum = sink ? std::exp(sink(h) - mx) : 0.0;
          for (int64_t j = first; j <= last; ++j) sum += std::exp(score[size_t(j)] - mx);
          const double l = mx + std::log(sum);
          lse[size_t((bb * hq + h) * sq + i)] = l;
          for (int64_t j = first; j <= last; ++j) {
            const double weight =
                std::exp(score[size_t(j)] - l) * (multiplier ? multiplier(bb, h, last, j) : 1.0);
            for (int64_t dd = 0; dd < d; ++dd) {
              out[size_t(q_at(bb, i, h) + dd)] += weight * v[size_t(kv_at(bb, j, kvh) + dd)];
            }
          }
        }
      }
    }
    return {out, lse};
  }
};

}  // namespace braid::testing
