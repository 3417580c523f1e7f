// Mixture-of-experts routing and token dispatch on the CPU: top-k routing with its gradient,
// row gathers and the weighted combine of the experts' outputs. Every sum runs in a fixed order.
#include <algorithm>
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

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

float ranked(float x) { return std::isnan(x) ? -INFINITY : x; }

// The k largest of x over the experts `allowed` admits (nullptr: all n), in descending order,
// ties to the lower index, NaN ranked as -inf: selection by k passes, which is what the CUDA
// kernel does too (k is small).
void top_k(int32_t* chosen, const float* x, int64_t n, int64_t k, const uint8_t* allowed) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < n; ++e) {
      if (allowed != nullptr && !allowed[e]) continue;
      bool taken = false;
      for (int64_t i = 0; i < j && !taken; ++i) taken = chosen[i] == e;
      if (!taken && (best < 0 || ranked(x[e]) > ranked(x[best]))) best = e;
    }
    chosen[j] = int32_t(best);
  }
}

// One token's routing scratch: the scores s (softmax or sigmoid), what the top k is taken of,
// and the experts of the chosen groups.
struct RouterRow {
  std::vector<float> s, choice;
  std::vector<uint8_t> allowed;
  std::vector<int32_t> groups;
  explicit RouterRow(int64_t n) : s(size_t(n)), choice(size_t(n)), allowed(size_t(n)) {}
};

// ops.h's choice: fills chosen[0, k) for the logits `row`, leaving s (and choice) in `r`.
void choose(RouterRow& r, int32_t* chosen, const float* row, const float* bias, int64_t n,
            int64_t k, const MoeRouterSpec& spec) {
  const float* choice = row;
  if (spec.sigmoid) {
    for (int64_t e = 0; e < n; ++e) {
      r.s[size_t(e)] = sigmoid(row[e]);
      r.choice[size_t(e)] = bias != nullptr ? r.s[size_t(e)] + bias[e] : r.s[size_t(e)];
    }
    choice = r.choice.data();
  } else if (spec.softmax_first) {
    softmax(r.s.data(), row, n);
    choice = r.s.data();
  }
  const uint8_t* allowed = nullptr;
  if (spec.num_groups > 0) {
    const int64_t size = n / spec.num_groups, best = k / spec.group_topk;
    std::vector<float> group_score(size_t(spec.num_groups));
    r.groups.resize(size_t(best));
    for (int64_t g = 0; g < spec.num_groups; ++g) {
      top_k(r.groups.data(), choice + g * size, size, best, nullptr);
      float sum = 0;  // in descending order
      for (int64_t j = 0; j < best; ++j) sum += ranked(choice[g * size + r.groups[size_t(j)]]);
      group_score[size_t(g)] = sum;
    }
    r.groups.resize(size_t(spec.group_topk));
    top_k(r.groups.data(), group_score.data(), spec.num_groups, spec.group_topk, nullptr);
    std::fill(r.allowed.begin(), r.allowed.end(), uint8_t(0));
    for (const int32_t g : r.groups) std::fill_n(r.allowed.begin() + g * size, size, uint8_t(1));
    allowed = r.allowed.data();
  }
  top_k(chosen, choice, n, k, allowed);
}

// The load-balancing scores of a row into out: softmax, or sigmoid normalised by its sum.
void balance_scores(float* out, const float* row, int64_t n, const MoeRouterSpec& spec) {
  if (!spec.sigmoid) return softmax(out, row, n);
  float sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += out[e] = sigmoid(row[e]);
  const float denominator = sum + 1e-20f;
  for (int64_t e = 0; e < n; ++e) out[e] /= denominator;
}

float logsumexp(const float* x, int64_t n) {
  const float m = max_of(x, n);
  double sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += std::exp(double(x[e] - m));
  return m + float(std::log(sum));
}

}  // namespace

void moe_router_forward(Tensor probs, Tensor experts, Tensor score_sums, Tensor lse,
                        const Tensor& logits, const Tensor& expert_bias, const MoeRouterSpec& spec,
                        Stream) {
  const int64_t t_count = logits.size(0), n = logits.size(1), k = experts.size(1);
  const float* l = logits.data_ptr<float>();
  const float* bias = expert_bias.defined() ? expert_bias.data_ptr<float>() : nullptr;
  float* p = probs.data_ptr<float>();
  int32_t* ex = experts.data_ptr<int32_t>();
  float* lse_out = lse.defined() ? lse.data_ptr<float>() : nullptr;
  const bool sums = score_sums.defined();
  std::vector<float> scores(static_cast<size_t>(sums ? t_count * n : 0));
  parallel_for(t_count, std::max<int64_t>(1, 4096 / n), [&](int64_t t0, int64_t t1) {
    RouterRow r(n);
    std::vector<float> top(static_cast<size_t>(k));
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = l + t * n;
      int32_t* chosen = ex + t * k;
      float* pt = p + t * k;
      choose(r, chosen, row, bias, n, k, spec);
      if (sums) balance_scores(scores.data() + t * n, row, n, spec);
      if (lse_out != nullptr) lse_out[t] = logsumexp(row, n);
      if (spec.sigmoid) {
        float sum = 0;
        for (int64_t j = 0; j < k; ++j) sum += pt[j] = r.s[size_t(chosen[j])];
        if (k > 1)
          for (int64_t j = 0; j < k; ++j) pt[j] /= sum + 1e-20f;
      } else if (spec.softmax_first) {
        for (int64_t j = 0; j < k; ++j) pt[j] = r.s[size_t(chosen[j])];
      } else {
        for (int64_t j = 0; j < k; ++j) top[size_t(j)] = row[chosen[j]];
        softmax(pt, top.data(), k);
      }
      for (int64_t j = 0; j < k; ++j) pt[j] *= spec.scaling_factor;
    }
  });
  if (!sums) return;
  const int64_t groups = score_sums.size(0), per_group = t_count / groups;
  float* out = score_sums.data_ptr<float>();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t e = 0; e < n; ++e) {
      double sum = 0;
      for (int64_t t = g * per_group; t < (g + 1) * per_group; ++t)
        sum += scores[size_t(t * n + e)];
      out[g * n + e] = float(sum);
    }
  }
}

void moe_router_backward(Tensor dlogits, const Tensor& dprobs, const Tensor& logits,
                         const Tensor& experts, const MoeRouterSpec& spec, const Tensor& aux_grad,
                         float z_grad, Stream) {
  const int64_t t_count = logits.size(0), n = logits.size(1), k = experts.size(1);
  const float* l = logits.data_ptr<float>();
  const float* dp = dprobs.data_ptr<float>();
  const int32_t* ex = experts.data_ptr<int32_t>();
  const float* aux = aux_grad.defined() ? aux_grad.data_ptr<float>() : nullptr;
  const int64_t per_group = aux != nullptr ? t_count / aux_grad.size(0) : 1;
  float* dl = dlogits.data_ptr<float>();
  parallel_for(t_count, std::max<int64_t>(1, 4096 / n), [&](int64_t t0, int64_t t1) {
    std::vector<float> s(static_cast<size_t>(n)), top(static_cast<size_t>(k)),
        p(static_cast<size_t>(k)), g(static_cast<size_t>(k));
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = l + t * n;
      const int32_t* chosen = ex + t * k;
      float* out = dl + t * n;
      for (int64_t j = 0; j < k; ++j) g[size_t(j)] = dp[t * k + j] * spec.scaling_factor;
      std::memset(out, 0, size_t(n) * sizeof(float));
      if (spec.sigmoid) {  // probs are s at the chosen experts, normalised by their sum
        float sum = 0;
        for (int64_t j = 0; j < k; ++j) sum += p[size_t(j)] = sigmoid(row[chosen[j]]);
        const float denominator = sum + 1e-20f;
        double dot = 0;
        if (k > 1)
          for (int64_t j = 0; j < k; ++j) dot += double(g[size_t(j)]) * p[size_t(j)] / denominator;
        for (int64_t j = 0; j < k; ++j) {
          const float sj = p[size_t(j)];
          const float ds = k > 1 ? (g[size_t(j)] - float(dot)) / denominator : g[size_t(j)];
          out[chosen[j]] = ds * sj * (1.0f - sj);
        }
      } else if (spec.softmax_first) {  // probs are softmax(logits) at the chosen experts
        softmax(s.data(), row, n);
        double dot = 0;
        for (int64_t j = 0; j < k; ++j) dot += double(s[size_t(chosen[j])]) * g[size_t(j)];
        for (int64_t e = 0; e < n; ++e) out[e] = -s[size_t(e)] * float(dot);
        for (int64_t j = 0; j < k; ++j) out[chosen[j]] += s[size_t(chosen[j])] * g[size_t(j)];
      } else {  // probs are the softmax over the chosen logits
        for (int64_t j = 0; j < k; ++j) top[size_t(j)] = row[chosen[j]];
        softmax(p.data(), top.data(), k);
        double dot = 0;
        for (int64_t j = 0; j < k; ++j) dot += double(p[size_t(j)]) * g[size_t(j)];
        for (int64_t j = 0; j < k; ++j) out[chosen[j]] = p[size_t(j)] * (g[size_t(j)] - float(dot));
      }
      if (aux != nullptr) {
        const float* a = aux + (t / per_group) * n;
        if (spec.sigmoid) {  // the scores are sigmoid(logits) / (their sum + 1e-20)
          float sum = 0;
          for (int64_t e = 0; e < n; ++e) sum += s[size_t(e)] = sigmoid(row[e]);
          const float denominator = sum + 1e-20f;
          double dot = 0;
          for (int64_t e = 0; e < n; ++e) dot += double(a[e]) * s[size_t(e)] / denominator;
          for (int64_t e = 0; e < n; ++e) {
            const float se = s[size_t(e)];
            out[e] += (a[e] - float(dot)) / denominator * se * (1.0f - se);
          }
        } else {
          softmax(s.data(), row, n);
          double dot = 0;
          for (int64_t e = 0; e < n; ++e) dot += double(s[size_t(e)]) * a[e];
          for (int64_t e = 0; e < n; ++e) out[e] += s[size_t(e)] * (a[e] - float(dot));
        }
      }
      if (z_grad != 0) {
        softmax(s.data(), row, n);
        const float scale = z_grad * logsumexp(row, n);
        for (int64_t e = 0; e < n; ++e) out[e] += scale * s[size_t(e)];
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
