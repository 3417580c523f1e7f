// matmul and bias_backward on the CPU.
//
// Threading: OpenBLAS runs single-threaded here and braid's OpenMP threads split each GEMM
// into blocks of output rows (or columns), one cblas_sgemm per thread, so all CPU work shares one
// thread pool. With OpenBLAS's own (pthread) pool instead, a GEMM that follows an OpenMP loop
// competes with the OpenMP workers, which spin-wait after each loop before they sleep (measured:
// a GEMM right after a layernorm took up to three times as long).
#include <climits>
#include <cstring>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"
#include "kernels/cpu/openblas.h"

namespace braid::ops::cpu {
namespace {

int64_t rows_of(const Tensor& t) { return t.numel() / t.size(-1); }

// out[M, N] (row stride N) = alpha * op(a) op(b) + beta * out, row-major, as cblas sees it.
struct GemmArgs {
  bool trans_a, trans_b;
  int64_t m, n, k;
  float alpha, beta;
  const float* a;
  int64_t lda;
  const float* b;
  int64_t ldb;
  float* c;
  const float* bias;  // [N] or null: written (beta == 0) or added into out before the product
};

// The block rows [r0, r1) x columns [c0, c1) of out, on the calling thread.
void gemm_block(const GemmArgs& g, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  float* c = g.c + r0 * g.n + c0;
  float beta = g.beta;
  if (g.bias != nullptr) {
    for (int64_t r = 0; r < r1 - r0; ++r) {
      if (beta != 0.0f) {
        add_into(c + r * g.n, g.bias + c0, c1 - c0);
      } else {
        std::memcpy(c + r * g.n, g.bias + c0, size_t(c1 - c0) * sizeof(float));
      }
    }
    beta = 1.0f;
  }
  if (g.k == 0) {
    if (beta == 0.0f) {
      for (int64_t r = 0; r < r1 - r0; ++r) std::fill(c + r * g.n, c + r * g.n + (c1 - c0), 0.0f);
    }
    return;
  }
  const float* a = g.trans_a ? g.a + r0 : g.a + r0 * g.lda;
  const float* b = g.trans_b ? g.b + c0 * g.ldb : g.b + c0;
  openblas().sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                   g.trans_b ? CblasTrans : CblasNoTrans, int(r1 - r0), int(c1 - c0), int(g.k),
                   g.alpha, a, int(g.lda), b, int(g.ldb), beta, c, int(g.n));
}

// Splits the longer side of out into blocks of 16 (whole cache lines of a row), contiguous
// ranges of them per thread; small products stay on one thread.
void gemm(const GemmArgs& g) {
  // A pthreads OpenBLAS is told to stay on the calling thread; an OpenMP one does that by
  // itself inside a parallel region (and its set_num_threads would resize braid's pool).
  static const bool blas_on_caller = [] {
    if (openblas().get_parallel() == 1) openblas().set_num_threads(1);
    return true;
  }();
  (void)blas_on_caller;
  constexpr int64_t kAlign = 16;
  constexpr int64_t kMinFlopsPerThread = int64_t(1) << 22;
  const bool split_rows = g.m >= g.n;
  const int64_t along = split_rows ? g.m : g.n, across = split_rows ? g.n : g.m;
  const int64_t blocks = (along + kAlign - 1) / kAlign;
  const int64_t block_flops = 2 * kAlign * across * std::max<int64_t>(g.k, 1);
  parallel_for(blocks, std::max<int64_t>(1, kMinFlopsPerThread / block_flops),
               [&](int64_t b0, int64_t b1) {
                 int64_t lo = b0 * kAlign, hi = std::min(along, b1 * kAlign);
                 if (split_rows) {
                   gemm_block(g, lo, hi, 0, g.n);
                 } else {
                   gemm_block(g, 0, g.m, lo, hi);
                 }
               });
}

}  // namespace

void matmul(Tensor out, const Tensor& a, const Tensor& b, const Tensor& bias, bool trans_a,
            bool trans_b, float alpha, bool accumulate, Stream) {
  // Operands as row-major matrices [numel / last dim, last dim]; out.numel() > 0 here.
  const int64_t n = out.size(-1), m = rows_of(out);
  const int64_t lda = a.size(-1), ldb = b.size(-1);
  const int64_t k = trans_a ? (lda == 0 ? 0 : a.numel() / lda) : lda;
  BRAID_CHECK(
      m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && a.numel() <= INT_MAX && b.numel() <= INT_MAX,
      "matmul: [", m, ", ", k, "] x [", k, ", ", n, "] exceeds the 32-bit BLAS interface");
  gemm({trans_a, trans_b, m, n, k, alpha, accumulate ? 1.0f : 0.0f, a.data_ptr<float>(),
        std::max<int64_t>(lda, 1), b.data_ptr<float>(), std::max<int64_t>(ldb, 1),
        out.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr});
}

void bias_backward(Tensor dbias, const Tensor& dout, Stream) {
  // Columns are split across threads in fixed blocks, so the sum order (row by row) and thus
  // the result do not depend on the number of threads.
  const int64_t n = dout.size(-1), rows = rows_of(dout);
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const float* g = dout.data_ptr<float>();
  float* db = dbias.data_ptr<float>();
  parallel_for(blocks, rows >= 64 ? 1 : blocks, [&](int64_t b0, int64_t b1) {
    int64_t c0 = b0 * kBlock, width = std::min(n, b1 * kBlock) - c0;
    for (int64_t r = 0; r < rows; ++r) add_into(db + c0, g + r * n + c0, width);
  });
}

}  // namespace braid::ops::cpu
