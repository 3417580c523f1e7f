// matmul and bias_backward on the CPU: OpenBLAS's cblas_sgemm (which runs its own threads, so
// it is called from outside any OpenMP region) plus OpenMP loops for the bias.
#include <cblas.h>

#include <climits>
#include <cstring>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {
namespace {

int64_t rows_of(const Tensor& t) { return t.numel() / t.size(-1); }

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
  float* c = out.data_ptr<float>();
  float beta = accumulate ? 1.0f : 0.0f;
  if (bias.defined()) {
    const float* bias_p = bias.data_ptr<float>();
    parallel_for(m, std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        if (accumulate) {
          add_into(c + r * n, bias_p, n);
        } else {
          std::memcpy(c + r * n, bias_p, size_t(n) * sizeof(float));
        }
      }
    });
    beta = 1.0f;
  }
  if (k == 0) {
    if (beta == 0.0f) out.zero_();
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, int(m), int(n), int(k), alpha,
              a.data_ptr<float>(), int(lda), b.data_ptr<float>(), int(ldb), beta, c, int(n));
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
