// layernorm and rmsnorm on the CPU: rows in parallel; the weight/bias gradients are reduced
// per block of columns (row after row), so they do not depend on the number of threads.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {
namespace {

constexpr int64_t kRowGrain = 1 << 14;  // elements per thread below which rows stay serial
constexpr int64_t kColumnBlock = 64;

int64_t row_grain(int64_t c) { return std::max<int64_t>(1, kRowGrain / std::max<int64_t>(c, 1)); }

// ---- layernorm: y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var + eps), biased var ----

BRAID_CPU_MULTIVERSION void layernorm_row(float* __restrict y, float* mean_out, float* rstd_out,
                                          const float* __restrict x, const float* __restrict w,
                                          const float* __restrict b, int64_t c, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < c; ++j) sum += x[j];
  const float mean = sum / float(c);
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t j = 0; j < c; ++j) sq += (x[j] - mean) * (x[j] - mean);
  const float rstd = 1.0f / std::sqrt(sq / float(c) + eps);
#pragma omp simd
  for (int64_t j = 0; j < c; ++j) y[j] = (x[j] - mean) * rstd * w[j] + b[j];
  *mean_out = mean;
  *rstd_out = rstd;
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w, xhat = (x - mean) * rstd
BRAID_CPU_MULTIVERSION void layernorm_backward_row(float* __restrict dx, const float* __restrict dy,
                                                   const float* __restrict x,
                                                   const float* __restrict w, float mean,
                                                   float rstd, int64_t c) {
  float sum_g = 0.0f, sum_gx = 0.0f;
#pragma omp simd reduction(+ : sum_g, sum_gx)
  for (int64_t j = 0; j < c; ++j) {
    float g = dy[j] * w[j];
    sum_g += g;
    sum_gx += g * (x[j] - mean) * rstd;
  }
  const float mean_g = sum_g / float(c), mean_gx = sum_gx / float(c);
#pragma omp simd
  for (int64_t j = 0; j < c; ++j) {
    float xhat = (x[j] - mean) * rstd;
    dx[j] = rstd * (dy[j] * w[j] - mean_g - xhat * mean_gx);
  }
}

// dw[j] += dy[j] * xhat[j], db[j] += dy[j] for one row's columns [0, n) of a block.
BRAID_CPU_MULTIVERSION void layernorm_param_grad_row(float* __restrict dw, float* __restrict db,
                                                     const float* __restrict dy,
                                                     const float* __restrict x, float mean,
                                                     float rstd, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    dw[j] += dy[j] * (x[j] - mean) * rstd;
    db[j] += dy[j];
  }
}

// ---- rmsnorm: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) ----

BRAID_CPU_MULTIVERSION void rmsnorm_row(float* __restrict y, float* rstd_out,
                                        const float* __restrict x, const float* __restrict w,
                                        int64_t c, float eps) {
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t j = 0; j < c; ++j) sq += x[j] * x[j];
  const float rstd = 1.0f / std::sqrt(sq / float(c) + eps);
#pragma omp simd
  for (int64_t j = 0; j < c; ++j) y[j] = x[j] * rstd * w[j];
  *rstd_out = rstd;
}

// dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x * rstd
BRAID_CPU_MULTIVERSION void rmsnorm_backward_row(float* __restrict dx, const float* __restrict dy,
                                                 const float* __restrict x,
                                                 const float* __restrict w, float rstd, int64_t c) {
  float sum_gx = 0.0f;
#pragma omp simd reduction(+ : sum_gx)
  for (int64_t j = 0; j < c; ++j) sum_gx += dy[j] * w[j] * x[j] * rstd;
  const float mean_gx = sum_gx / float(c);
#pragma omp simd
  for (int64_t j = 0; j < c; ++j) dx[j] = rstd * (dy[j] * w[j] - x[j] * rstd * mean_gx);
}

BRAID_CPU_MULTIVERSION void rmsnorm_param_grad_row(float* __restrict dw, const float* __restrict dy,
                                                   const float* __restrict x, float rstd,
                                                   int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dw[j] += dy[j] * x[j] * rstd;
}

// Runs f(c0, width) over blocks of columns of [0, c) in parallel.
template <typename F>
void for_column_blocks(int64_t c, int64_t rows, F&& f) {
  const int64_t blocks = (c + kColumnBlock - 1) / kColumnBlock;
  parallel_for(blocks, rows >= 64 ? 1 : blocks, [&](int64_t b0, int64_t b1) {
    int64_t c0 = b0 * kColumnBlock;
    f(c0, std::min(c, b1 * kColumnBlock) - c0);
  });
}

}  // namespace

void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, const Tensor& x, const Tensor& weight,
                       const Tensor& bias, float eps, Stream) {
  const int64_t c = x.size(-1), rows = x.numel() / c;
  float* y = out.data_ptr<float>();
  float* mu = mean.data_ptr<float>();
  float* rs = rstd.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  parallel_for(rows, row_grain(c), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      layernorm_row(y + r * c, mu + r, rs + r, px + r * c, w, b, c, eps);
  });
}

void layernorm_backward(Tensor dx, Tensor dweight, Tensor dbias, const Tensor& dout,
                        const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, Stream) {
  const int64_t c = x.size(-1), rows = x.numel() / c;
  float* pdx = dx.data_ptr<float>();
  float* dw = dweight.data_ptr<float>();
  float* db = dbias.data_ptr<float>();
  const float* dy = dout.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* mu = mean.data_ptr<float>();
  const float* rs = rstd.data_ptr<float>();
  parallel_for(rows, row_grain(c), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      layernorm_backward_row(pdx + r * c, dy + r * c, px + r * c, w, mu[r], rs[r], c);
    }
  });
  for_column_blocks(c, rows, [&](int64_t c0, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
      layernorm_param_grad_row(dw + c0, db + c0, dy + r * c + c0, px + r * c + c0, mu[r], rs[r], n);
    }
  });
}

void rmsnorm_forward(Tensor out, Tensor rstd, const Tensor& x, const Tensor& weight, float eps,
                     Stream) {
  const int64_t c = x.size(-1), rows = x.numel() / c;
  float* y = out.data_ptr<float>();
  float* rs = rstd.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  parallel_for(rows, row_grain(c), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rmsnorm_row(y + r * c, rs + r, px + r * c, w, c, eps);
  });
}

void rmsnorm_backward(Tensor dx, Tensor dweight, const Tensor& dout, const Tensor& x,
                      const Tensor& weight, const Tensor& rstd, Stream) {
  const int64_t c = x.size(-1), rows = x.numel() / c;
  float* pdx = dx.data_ptr<float>();
  float* dw = dweight.data_ptr<float>();
  const float* dy = dout.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* rs = rstd.data_ptr<float>();
  parallel_for(rows, row_grain(c), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      rmsnorm_backward_row(pdx + r * c, dy + r * c, px + r * c, w, rs[r], c);
    }
  });
  for_column_blocks(c, rows, [&](int64_t c0, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
      rmsnorm_param_grad_row(dw + c0, dy + r * c + c0, px + r * c + c0, rs[r], n);
    }
  });
}

}  // namespace braid::ops::cpu
