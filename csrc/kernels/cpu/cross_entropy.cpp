// Cross-entropy on the CPU with vocab-parallel partials: one online-softmax pass per row (rows
// in parallel) gives max and sum of exp; the loss and the gradient follow from them.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {
namespace {

BRAID_CPU_MULTIVERSION float chunk_sum_exp(const float* x, int64_t n, float shift) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += exp_f32(x[j] - shift);
  return sum;
}

// The row is read once from memory: each chunk (small enough for L1) is scanned for its
// max, then summed against the running max; the running sum is rescaled when the max grows.
void row_partials(const float* x, int64_t v, float* max_out, float* sum_out) {
  constexpr int64_t kChunk = 2048;
  float m = -__builtin_inff();
  double sum = 0.0;
  for (int64_t c0 = 0; c0 < v; c0 += kChunk) {
    const int64_t n = std::min(kChunk, v - c0);
    float cm = max_of(x + c0, n);
    if (cm > m) {
      sum *= std::exp(double(m) - double(cm));
      m = cm;
    }
    sum += chunk_sum_exp(x + c0, n, m);
  }
  *max_out = m;
  *sum_out = float(sum);
}

// d[j] = scale * exp(x[j] - shift); d may alias x.
BRAID_CPU_MULTIVERSION void scaled_exp(float* d, const float* x, int64_t n, float shift,
                                       float scale) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) d[j] = scale * exp_f32(x[j] - shift);
}

}  // namespace

void cross_entropy_partials(Tensor max, Tensor sumexp, Tensor target_logit, const Tensor& logits,
                            const Tensor& targets, int64_t vocab_offset, Stream) {
  const int64_t t_len = logits.size(0), v = logits.size(1);
  const float* x = logits.data_ptr<float>();
  const int32_t* tg = targets.data_ptr<int32_t>();
  float* mx = max.data_ptr<float>();
  float* se = sumexp.data_ptr<float>();
  float* tl = target_logit.data_ptr<float>();
  parallel_for(t_len, std::max<int64_t>(1, 16384 / std::max<int64_t>(v, 1)),
               [&](int64_t r0, int64_t r1) {
                 for (int64_t r = r0; r < r1; ++r) {
                   const float* row = x + r * v;
                   row_partials(row, v, mx + r, se + r);
                   int64_t j = int64_t(tg[r]) - vocab_offset;
                   tl[r] = tg[r] >= 0 && j >= 0 && j < v ? row[j] : 0.0f;
                 }
               });
}

void cross_entropy_rescale(Tensor sumexp, const Tensor& max, const Tensor& global_max, Stream) {
  float* se = sumexp.data_ptr<float>();
  const float* mx = max.data_ptr<float>();
  const float* gm = global_max.data_ptr<float>();
  for (int64_t r = 0, n = sumexp.numel(); r < n; ++r) {
    se[r] = se[r] == 0.0f ? 0.0f : se[r] * std::exp(mx[r] - gm[r]);  // empty slice: max = -inf
  }
}

void cross_entropy_loss(Tensor loss, const Tensor& max, const Tensor& sumexp,
                        const Tensor& target_logit, const Tensor& targets, Stream) {
  const int64_t t_len = targets.numel();
  const int32_t* tg = targets.data_ptr<int32_t>();
  const float* mx = max.data_ptr<float>();
  const float* se = sumexp.data_ptr<float>();
  const float* tl = target_logit.data_ptr<float>();
  float* l = loss.data_ptr<float>();
  for (int64_t r = 0; r < t_len; ++r) {
    l[r] = tg[r] < 0 ? 0.0f : std::log(se[r]) + mx[r] - tl[r];
  }
}

void cross_entropy_backward(Tensor dlogits, const Tensor& logits, const Tensor& targets,
                            const Tensor& max, const Tensor& sumexp, const Tensor& dloss,
                            int64_t vocab_offset, Stream) {
  const int64_t t_len = logits.size(0), v = logits.size(1);
  const float* x = logits.data_ptr<float>();
  const int32_t* tg = targets.data_ptr<int32_t>();
  const float* mx = max.data_ptr<float>();
  const float* se = sumexp.data_ptr<float>();
  const float* dl = dloss.data_ptr<float>();
  float* d = dlogits.data_ptr<float>();
  parallel_for(t_len, std::max<int64_t>(1, 16384 / std::max<int64_t>(v, 1)),
               [&](int64_t r0, int64_t r1) {
                 for (int64_t r = r0; r < r1; ++r) {
                   float* drow = d + r * v;
                   if (tg[r] < 0) {
                     std::fill(drow, drow + v, 0.0f);
                     continue;
                   }
                   scaled_exp(drow, x + r * v, v, mx[r], dl[r] / se[r]);
                   int64_t j = int64_t(tg[r]) - vocab_offset;
                   if (j >= 0 && j < v) drow[j] -= dl[r];
                 }
               });
}

}  // namespace braid::ops::cpu
