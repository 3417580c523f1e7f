// Mixture-of-experts routing and token dispatch on the CPU: top-k routing with its gradient,
// row gathers and the weighted combine of the experts' outputs. Every sum runs in a fixed order.
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {
namespace {

// softmax(x[0, n)) into out, in double for the sum.
void softmax(float* out, const float* x, int64_t n) {
  const float m = max_of(x, n);
  double sum = 0;
  for (int64_t e = 0; e < n; ++e) {
    out[e] = std::exp(x[e] - m);
    sum += out[e];
  }
  const float inv = float(1.0 / sum);
  for (int64_t e = 0; e < n; ++e) out[e] *= inv;
}

// The k largest of x[0, n) in descending order, ties to the lower index, NaN ranked as -inf:
// selection by k passes, which is what the CUDA kernel does too (k is small).
void top_k(int32_t* chosen, const float* x, int64_t n, int64_t k) {
  auto rank = [&](int64_t e) { return std::isnan(x[e]) ? -INFINITY : x[e]; };
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < n; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j && !taken; ++i) taken = chosen[i] == e;
      if (!taken && (best < 0 || rank(e) > rank(best))) best = e;
    }
    chosen[j] = int32_t(best);
  }
}

}  // namespace

void moe_router_forward(Tensor probs, Tensor experts, Tensor score_sums, const Tensor& logits,
                        bool softmax_first, Stream) {
  const int64_t t_count = logits.size(0), n = logits.size(1), k = experts.size(1);
  const float* l = logits.data_ptr<float>();
  float* p = probs.data_ptr<float>();
  int32_t* ex = experts.data_ptr<int32_t>();
  const bool sums = score_sums.defined();
  std::vector<float> scores(static_cast<size_t>(sums ? t_count * n : 0));
  parallel_for(t_count, std::max<int64_t>(1, 4096 / n), [&](int64_t t0, int64_t t1) {
    std::vector<float> s(static_cast<size_t>(n)), top(static_cast<size_t>(k));
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = l + t * n;
      int32_t* chosen = ex + t * k;
      top_k(chosen, row, n, k);
      if (softmax_first || sums) softmax(s.data(), row, n);
      if (sums) std::memcpy(scores.data() + t * n, s.data(), size_t(n) * sizeof(float));
      if (softmax_first) {
        for (int64_t j = 0; j < k; ++j) p[t * k + j] = s[size_t(chosen[j])];
      } else {
        for (int64_t j = 0; j < k; ++j) top[size_t(j)] = row[chosen[j]];
        softmax(p + t * k, top.data(), k);
      }
    }
  });
  if (!sums) return;
  float* out = score_sums.data_ptr<float>();
  for (int64_t e = 0; e < n; ++e) {
    double sum = 0;
    for (int64_t t = 0; t < t_count; ++t) sum += scores[size_t(t * n + e)];
    out[e] = float(sum);
  }
}

void moe_router_backward(Tensor dlogits, const Tensor& dprobs, const Tensor& logits,
                         const Tensor& experts, bool softmax_first, const Tensor& aux_grad,
                         Stream) {
  const int64_t t_count = logits.size(0), n = logits.size(1), k = experts.size(1);
  const float* l = logits.data_ptr<float>();
  const float* dp = dprobs.data_ptr<float>();
  const int32_t* ex = experts.data_ptr<int32_t>();
  const float* aux = aux_grad.defined() ? aux_grad.data_ptr<float>() : nullptr;
  float* dl = dlogits.data_ptr<float>();
  parallel_for(t_count, std::max<int64_t>(1, 4096 / n), [&](int64_t t0, int64_t t1) {
    std::vector<float> s(static_cast<size_t>(n)), top(static_cast<size_t>(k)),
        p(static_cast<size_t>(k));
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = l + t * n;
      const float* g = dp + t * k;
      const int32_t* chosen = ex + t * k;
      float* out = dl + t * n;
      std::memset(out, 0, size_t(n) * sizeof(float));
      if (softmax_first || aux != nullptr) softmax(s.data(), row, n);
      if (softmax_first) {  // probs are s at the chosen experts
        double dot = 0;
        for (int64_t j = 0; j < k; ++j) dot += double(s[size_t(chosen[j])]) * g[j];
        for (int64_t e = 0; e < n; ++e) out[e] = -s[size_t(e)] * float(dot);
        for (int64_t j = 0; j < k; ++j) out[chosen[j]] += s[size_t(chosen[j])] * g[j];
      } else {  // probs are the softmax over the chosen logits
        for (int64_t j = 0; j < k; ++j) top[size_t(j)] = row[chosen[j]];
        softmax(p.data(), top.data(), k);
        double dot = 0;
        for (int64_t j = 0; j < k; ++j) dot += double(p[size_t(j)]) * g[j];
        for (int64_t j = 0; j < k; ++j) out[chosen[j]] = p[size_t(j)] * (g[j] - float(dot));
      }
      if (aux != nullptr) {
        double dot = 0;
        for (int64_t e = 0; e < n; ++e) dot += double(s[size_t(e)]) * aux[e];
        for (int64_t e = 0; e < n; ++e) out[e] += s[size_t(e)] * (aux[e] - float(dot));
      }
    }
  });
}

void gather_rows(Tensor out, const Tensor& x, const Tensor& index, const Tensor& scale, Stream) {
  const int64_t rows = index.size(0), c = x.size(1), t_count = x.size(0);
  const float* src = x.data_ptr<float>();
  const int32_t* idx = index.data_ptr<int32_t>();
  const float* sc = scale.defined() ? scale.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < rows; ++i)
    BRAID_CHECK(idx[i] >= 0 && idx[i] < t_count, "gather_rows: index[", i, "] = ", idx[i],
                " is not a row of x (", t_count, " rows)");
  parallel_for(rows, std::max<int64_t>(1, 16384 / c), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* from = src + int64_t(idx[i]) * c;
      float* to = o + i * c;
      if (sc == nullptr) {
        std::memcpy(to, from, size_t(c) * sizeof(float));
      } else {
        const float f = sc[i];
        for (int64_t j = 0; j < c; ++j) to[j] = f * from[j];
      }
    }
  });
}

void combine_rows(Tensor out, const Tensor& y, const Tensor& rows, const Tensor& weight, Stream) {
  const int64_t t_count = rows.size(0), k = rows.size(1), c = y.size(1), n = y.size(0);
  const float* src = y.data_ptr<float>();
  const int32_t* r = rows.data_ptr<int32_t>();
  const float* w = weight.defined() ? weight.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < t_count * k; ++i)
    BRAID_CHECK(r[i] >= 0 && r[i] < n, "combine_rows: rows[", i / k, ", ", i % k, "] = ", r[i],
                " is not a row of y (", n, " rows)");
  parallel_for(t_count, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, c * k)),
               [&](int64_t t0, int64_t t1) {
                 for (int64_t t = t0; t < t1; ++t) {
                   float* to = o + t * c;
                   std::memset(to, 0, size_t(c) * sizeof(float));
                   for (int64_t j = 0; j < k; ++j) {
                     const float f = w != nullptr ? w[t * k + j] : 1.0f;
                     const float* from = src + int64_t(r[t * k + j]) * c;
                     for (int64_t i = 0; i < c; ++i) to[i] += f * from[i];
                   }
                 }
               });
}

void combine_rows_weight_grad(Tensor dweight, const Tensor& dout, const Tensor& y,
                              const Tensor& rows, Stream) {
  const int64_t t_count = rows.size(0), k = rows.size(1), c = y.size(1), n = y.size(0);
  const float* src = y.data_ptr<float>();
  const float* g = dout.data_ptr<float>();
  const int32_t* r = rows.data_ptr<int32_t>();
  float* dw = dweight.data_ptr<float>();
  for (int64_t i = 0; i < t_count * k; ++i)
    BRAID_CHECK(r[i] >= 0 && r[i] < n, "combine_rows_weight_grad: rows[", i / k, ", ", i % k,
                "] = ", r[i], " is not a row of y (", n, " rows)");
  parallel_for(t_count, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, c * k)),
               [&](int64_t t0, int64_t t1) {
                 for (int64_t t = t0; t < t1; ++t) {
                   for (int64_t j = 0; j < k; ++j) {
                     const float* from = src + int64_t(r[t * k + j]) * c;
                     double dot = 0;
                     for (int64_t i = 0; i < c; ++i) dot += double(g[t * c + i]) * from[i];
                     dw[t * k + j] = float(dot);
                   }
                 }
               });
}

}  // namespace braid::ops::cpu
