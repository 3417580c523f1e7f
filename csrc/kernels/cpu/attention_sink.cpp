// Attention sinks on the CPU: the extra softmax logit per head joined to attention_forward's out
// and lse (forward), and the sinks' gradient (backward). Rows are (batch, head, query) as lse
// lays them out; out's row of that softmax is at ((batch * Sq + query) * Hq + head) * D.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {
namespace {

// log(exp(a) + exp(b)) without overflow; -inf when both are.
double log_add_exp(double a, double b) {
  const double m = std::max(a, b);
  if (m == -INFINITY) return m;
  return m + std::log1p(std::exp(-std::fabs(a - b)));
}

struct SinkDims {
  int64_t b, sq, hq, d;
  int64_t out_at(int64_t batch, int64_t head, int64_t i) const {
    return ((batch * sq + i) * hq + head) * d;
  }
};

SinkDims sink_dims(const Tensor& out) {
  return {out.size(0), out.size(1), out.size(2), out.size(3)};
}

}  // namespace

void attention_sink_forward(Tensor out, Tensor lse, const Tensor& sinks, Stream) {
  const SinkDims m = sink_dims(out);
  float* o = out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  const float* sink = sinks.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, m.d));
  parallel_for(m.b * m.hq * m.sq, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {  // r = (batch * Hq + head) * Sq + i
      const int64_t i = r % m.sq, head = (r / m.sq) % m.hq, batch = r / (m.sq * m.hq);
      const double before = l[r];
      const double after = log_add_exp(before, double(sink[head]));
      const auto factor = float(std::exp(before - after));
      float* row = o + m.out_at(batch, head, i);
      for (int64_t dd = 0; dd < m.d; ++dd) row[dd] *= factor;
      l[r] = float(after);
    }
  });
}

void attention_sink_backward(Tensor dsinks, const Tensor& dout, const Tensor& out,
                             const Tensor& lse, const Tensor& sinks, Stream) {
  const SinkDims m = sink_dims(out);
  float* ds = dsinks.data_ptr<float>();
  const float* g = dout.data_ptr<float>();
  const float* o = out.data_ptr<float>();
  const float* l = lse.data_ptr<float>();
  const float* sink = sinks.data_ptr<float>();
  // By heads: each dsinks element has one writer, summed in (batch, query) order.
  const int64_t grain =
      std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, m.b * m.sq * m.d));
  parallel_for(m.hq, grain, [&](int64_t h0, int64_t h1) {
    for (int64_t head = h0; head < h1; ++head) {
      float sum = 0.0f;
      for (int64_t batch = 0; batch < m.b; ++batch) {
        for (int64_t i = 0; i < m.sq; ++i) {
          const float p = std::exp(sink[head] - l[(batch * m.hq + head) * m.sq + i]);
          const int64_t at = m.out_at(batch, head, i);
          float dot = 0.0f;
          for (int64_t dd = 0; dd < m.d; ++dd) dot += g[at + dd] * o[at + dd];
          sum += p * dot;
        }
      }
      ds[head] -= sum;
    }
  });
}

}  // namespace braid::ops::cpu
