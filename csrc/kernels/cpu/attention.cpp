// Causal grouped-query attention on the CPU, flash-attention style: the forward keeps only the
// log-sum-exp of each softmax row; the backward recomputes the probabilities from it. With
// fewer queries than keys the queries are the last positions (query row i sits at position
// Sk - Sq + i), as flash-attention aligns them. With a sliding window a block of rows computes
// only the columns from its first row's first key (rounded down to a 16-column chunk) on, so
// the work is O(S x window), not O(S^2); so does document masking (key_start), whose first keys
// never decrease along the rows either.
//
// Work is split over (batch, head) pairs, one OpenMP loop per call. Within a pair, query rows
// are processed in blocks of four so that each pass over the keys (held transposed, [D][S],
// in a per-thread buffer) and each rank-4 update of dK/dV serves four rows.
//
// Attention dropout multiplies each row's probabilities by the mask (attention_dropout.h) after
// their sum is taken: the forward's weights of V, and in the backward both dP (before dS) and P
// (after dS, for dV); dS = P o (dP o mask - rowsum(dO o O)), O being the dropped output.
#include <cmath>
#include <vector>

#include "braid/core/error.h"
#include "kernels/attention_dropout.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {
namespace {

constexpr int kRows = 4;        // query rows per block
constexpr int64_t kLanes = 16;  // column chunk of the register-blocked loops (one AVX-512 vector)

int64_t round_up(int64_t x) { return (x + kLanes - 1) / kLanes * kLanes; }

// Shapes of one call: q [B, Sq, Hq, D], k, v [B, Sk, Hkv, D], Sq <= Sk; window -1 or >= 0;
// key_start nullptr or [B][key_ld] (ops::attention_forward's).
struct Dims {
  int64_t b, sq, sk, hq, hkv, d, window;
  const int32_t* key_start = nullptr;
  int64_t key_ld = 0;
  AttentionDropout dropout = {};
  int64_t offset() const { return sk - sq; }  // the position of query row 0
  // The first key query row i of sequence `batch` sees (its last is offset() + i). Rows past
  // the queries (a block's padding) take the last query's.
  int64_t first_key(int64_t batch, int64_t i) const {
    const int64_t p = offset() + std::min(i, sq - 1);
    const int64_t first = window < 0 ? 0 : std::max<int64_t>(0, p - window);
    return key_start == nullptr ? first : std::max<int64_t>(first, key_start[batch * key_ld + p]);
  }
  // The first column a block of rows from i0 computes: a multiple of kLanes, so that the
  // register-blocked loops stay aligned to the buffers' chunks.
  int64_t block_start(int64_t batch, int64_t i0) const {
    return first_key(batch, i0) / kLanes * kLanes;
  }
  int64_t ld() const { return round_up(sk); }   // row length of [.][Sk] buffers
  int64_t dpad() const { return round_up(d); }  // row length of [.][D] buffers
  int64_t q_at(int64_t batch, int64_t row, int64_t head) const {
    return ((batch * sq + row) * hq + head) * d;
  }
  int64_t kv_at(int64_t batch, int64_t pos, int64_t head) const {
    return ((batch * sk + pos) * hkv + head) * d;
  }
};

// out[r][j] = alpha * sum_{dd < d} x[r][dd] * t[dd][j] for the 4 rows r and j < round_up(n).
// x rows are dpad apart; t and out rows ld apart. The 4 x 16 accumulators stay in registers.
BRAID_CPU_MULTIVERSION void rows_times_transposed(float* __restrict out, const float* __restrict x,
                                                  int64_t dpad, const float* __restrict t,
                                                  int64_t ld, int64_t n, int64_t d, float alpha) {
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    float acc0[kLanes] = {}, acc1[kLanes] = {}, acc2[kLanes] = {}, acc3[kLanes] = {};
    for (int64_t dd = 0; dd < d; ++dd) {
      const float* row = t + dd * ld + j0;
      float a0 = x[dd], a1 = x[dpad + dd], a2 = x[2 * dpad + dd], a3 = x[3 * dpad + dd];
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) {
        acc0[l] += a0 * row[l];
        acc1[l] += a1 * row[l];
        acc2[l] += a2 * row[l];
        acc3[l] += a3 * row[l];
      }
    }
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      out[j0 + l] = alpha * acc0[l];
      out[ld + j0 + l] = alpha * acc1[l];
      out[2 * ld + j0 + l] = alpha * acc2[l];
      out[3 * ld + j0 + l] = alpha * acc3[l];
    }
  }
}

// acc[r][dd] = sum_{j < n} w[r][j] * y[j][dd] for the 4 rows r and dd < dpad. w rows are ld
// apart; y and acc rows dpad apart.
BRAID_CPU_MULTIVERSION void weights_times_rows(float* __restrict acc, const float* __restrict w,
                                               int64_t ld, const float* __restrict y, int64_t dpad,
                                               int64_t n) {
  for (int64_t d0 = 0; d0 < dpad; d0 += kLanes) {
    float acc0[kLanes] = {}, acc1[kLanes] = {}, acc2[kLanes] = {}, acc3[kLanes] = {};
    for (int64_t j = 0; j < n; ++j) {
      const float* row = y + j * dpad + d0;
      float w0 = w[j], w1 = w[ld + j], w2 = w[2 * ld + j], w3 = w[3 * ld + j];
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) {
        acc0[l] += w0 * row[l];
        acc1[l] += w1 * row[l];
        acc2[l] += w2 * row[l];
        acc3[l] += w3 * row[l];
      }
    }
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      acc[d0 + l] = acc0[l];
      acc[dpad + d0 + l] = acc1[l];
      acc[2 * dpad + d0 + l] = acc2[l];
      acc[3 * dpad + d0 + l] = acc3[l];
    }
  }
}

// g[j][dd] += sum_r w[r][j] * x[r][dd] for j < n, dd < dpad (a rank-4 update). w rows are ld
// apart; x and g rows dpad apart.
BRAID_CPU_MULTIVERSION void add_outer4(float* __restrict g, const float* __restrict w, int64_t ld,
                                       const float* __restrict x, int64_t dpad, int64_t n) {
  const float* x0 = x;
  const float* x1 = x + dpad;
  const float* x2 = x + 2 * dpad;
  const float* x3 = x + 3 * dpad;
  for (int64_t j = 0; j < n; ++j) {
    float w0 = w[j], w1 = w[ld + j], w2 = w[2 * ld + j], w3 = w[3 * ld + j];
    float* row = g + j * dpad;
#pragma omp simd
    for (int64_t dd = 0; dd < dpad; ++dd) {
      row[dd] += w0 * x0[dd] + w1 * x1[dd] + w2 * x2[dd] + w3 * x3[dd];
    }
  }
}

// x[j] = exp(x[j] - shift) for j < n; returns their sum.
BRAID_CPU_MULTIVERSION float exp_shifted(float* x, int64_t n, float shift) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    x[j] = exp_f32(x[j] - shift);
    sum += x[j];
  }
  return sum;
}

// ds[j] = p[j] * (ds[j] - delta): dS = P o (dP - rowsum(dO o O)), in place over dP.
BRAID_CPU_MULTIVERSION void softmax_grad(float* __restrict ds, const float* __restrict p, int64_t n,
                                         float delta) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (ds[j] - delta);
}

BRAID_CPU_MULTIVERSION float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

// Attention dropout of query row i of (batch, head): f(j, multiplier) for the keys j in
// [j0, j1), the mask's multiplier of each. One Philox call serves four keys.
template <typename F>
void for_each_multiplier(const Dims& m, int64_t batch, int64_t head, int64_t i, int64_t j0,
                         int64_t j1, F&& f) {
  const auto mask = ops::detail::HeadDropout::of(m.dropout, batch, head);
  const int64_t qp = mask.first_position + m.offset() + i;
  for (int64_t j = j0; j < j1;) {
    const int64_t kp = mask.first_position + j;
    const philox::Words4 w = mask.words(qp, kp / 4);
    for (int64_t l = kp % 4; l < 4 && j < j1; ++l, ++j) f(j, mask.multiplier(w.x[l]));
  }
}

// Per-thread buffers, zero-filled once: the padding (columns >= Sk of the [.][Sk] buffers,
// columns >= D of the [.][D] ones) is never written and stays zero.
struct Scratch {
  std::vector<float> kt, vt;   // [D][ld]: the kv head's keys / values transposed
  std::vector<float> kp, vp;   // [Sk][dpad]: the kv head's keys / values
  std::vector<float> p, dp;    // [4][ld]: probabilities, their gradient
  std::vector<float> xq, xdo;  // [4][dpad]: the block's query / output-gradient rows
  std::vector<float> acc;      // [4][dpad]
  std::vector<float> dk, dv;   // [Sk][dpad]
  Scratch(const Dims& m, bool backward)
      : kt(size_t(m.d * m.ld())),
        vp(size_t(m.sk * m.dpad())),
        p(size_t(kRows * m.ld())),
        xq(size_t(kRows * m.dpad())),
        acc(size_t(kRows * m.dpad())) {
    if (backward) {
      vt.resize(kt.size());
      kp.resize(vp.size());
      dp.resize(p.size());
      xdo.resize(xq.size());
      dk.resize(vp.size());
      dv.resize(vp.size());
    }
  }
};

// dst[i] = alpha * src[i], i < n.
BRAID_CPU_MULTIVERSION void scaled_copy(float* __restrict dst, const float* __restrict src,
                                        int64_t n, float alpha) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = alpha * src[i];
}

// One kv head's rows of k (or v) into t [D][ld] (transposed) and/or rows [S][dpad]. The
// transpose goes in blocks of 16 positions, whose source rows stay in L1 across dd.
void load_head(float* t, float* rows, const float* src, const Dims& m) {
  const int64_t stride = m.hkv * m.d;
  if (rows != nullptr) {
    for (int64_t j = 0; j < m.sk; ++j) {
      scaled_copy(rows + j * m.dpad(), src + j * stride, m.d, 1.0f);
    }
  }
  if (t == nullptr) return;
  for (int64_t j0 = 0; j0 < m.sk; j0 += kLanes) {
    const int64_t j1 = std::min(m.sk, j0 + kLanes);
    for (int64_t dd = 0; dd < m.d; ++dd) {
      for (int64_t j = j0; j < j1; ++j) t[dd * m.ld() + j] = src[j * stride + dd];
    }
  }
}

// The block's rows [i0, i0 + 4) of a q-shaped tensor into dst [4][dpad], times alpha; rows
// past the queries are zero.
void load_block(float* dst, const float* src, int64_t i0, const Dims& m, float alpha) {
  for (int r = 0; r < kRows; ++r) {
    if (i0 + r < m.sq) {
      scaled_copy(dst + r * m.dpad(), src + r * m.hq * m.d, m.d, alpha);
    } else {
      std::fill(dst + r * m.dpad(), dst + r * m.dpad() + m.d, 0.0f);
    }
  }
}

void forward_head(const Dims& m, int64_t batch, int64_t head, float* out, float* lse,
                  const float* q, const float* k, const float* v, Scratch& w) {
  const int64_t sq = m.sq, d = m.d, ld = m.ld(), dpad = m.dpad(), kvh = head / (m.hq / m.hkv);
  const float scale = 1.0f / std::sqrt(float(d));
  load_head(w.kt.data(), nullptr, k + m.kv_at(batch, 0, kvh), m);
  load_head(nullptr, w.vp.data(), v + m.kv_at(batch, 0, kvh), m);
  for (int64_t i0 = 0; i0 < sq; i0 += kRows) {
    const int64_t n = std::min(m.sk, m.offset() + i0 + kRows);  // keys the block's last row sees
    const int64_t lo = m.block_start(batch, i0);                // columns [lo, n) are computed
    load_block(w.xq.data(), q + m.q_at(batch, i0, head), i0, m, scale);
    rows_times_transposed(w.p.data() + lo, w.xq.data(), dpad, w.kt.data() + lo, ld, n - lo, d,
                          1.0f);
    float inv_sum[kRows];
    for (int r = 0; r < kRows; ++r) {
      float* p = w.p.data() + r * ld;
      // row i sees keys [first_key(i), offset + i]
      const int64_t seen = std::min(m.offset() + i0 + r + 1, n);
      const int64_t first = std::min(m.first_key(batch, i0 + r), seen);
      float mx = max_of(p + first, seen - first);
      float sum = exp_shifted(p + first, seen - first, mx);
      if (m.dropout.p > 0.0f && i0 + r < sq) {
        for_each_multiplier(m, batch, head, i0 + r, first, seen,
                            [p](int64_t j, float keep) { p[j] *= keep; });
      }
      std::fill(p + lo, p + first, 0.0f);
      std::fill(p + seen, p + n, 0.0f);
      inv_sum[r] = 1.0f / sum;
      if (i0 + r < sq) lse[(batch * m.hq + head) * sq + i0 + r] = mx + std::log(sum);
    }
    weights_times_rows(w.acc.data(), w.p.data() + lo, ld, w.vp.data() + lo * dpad, dpad, n - lo);
    for (int r = 0; r < kRows && i0 + r < sq; ++r) {
      scaled_copy(out + m.q_at(batch, i0 + r, head), w.acc.data() + r * dpad, d, inv_sum[r]);
    }
  }
}

// All query heads of kv head `kvh` of one batch element: dQ for them, dK and dV for kvh.
void backward_kv_head(const Dims& m, int64_t batch, int64_t kvh, float* dq, float* dk, float* dv,
                      const float* dout, const float* q, const float* k, const float* v,
                      const float* out, const float* lse, Scratch& w) {
  const int64_t sq = m.sq, d = m.d, ld = m.ld(), dpad = m.dpad(), group = m.hq / m.hkv;
  const float scale = 1.0f / std::sqrt(float(d));
  load_head(w.kt.data(), w.kp.data(), k + m.kv_at(batch, 0, kvh), m);
  load_head(w.vt.data(), nullptr, v + m.kv_at(batch, 0, kvh), m);
  std::fill(w.dk.begin(), w.dk.end(), 0.0f);
  std::fill(w.dv.begin(), w.dv.end(), 0.0f);
  for (int64_t head = kvh * group; head < (kvh + 1) * group; ++head) {
    for (int64_t i0 = 0; i0 < sq; i0 += kRows) {
      const int64_t n = std::min(m.sk, m.offset() + i0 + kRows);
      const int64_t lo = m.block_start(batch, i0), cols = n - lo;  // columns [lo, n) computed
      load_block(w.xq.data(), q + m.q_at(batch, i0, head), i0, m, scale);
      load_block(w.xdo.data(), dout + m.q_at(batch, i0, head), i0, m, 1.0f);
      float* p_lo = w.p.data() + lo;
      float* dp_lo = w.dp.data() + lo;
      rows_times_transposed(p_lo, w.xq.data(), dpad, w.kt.data() + lo, ld, cols, d, 1.0f);
      rows_times_transposed(dp_lo, w.xdo.data(), dpad, w.vt.data() + lo, ld, cols, d, 1.0f);
      for (int r = 0; r < kRows; ++r) {
        float* p = w.p.data() + r * ld;
        float* ds = w.dp.data() + r * ld;
        // row i sees keys [first, seen); a row past the queries sees none
        const int64_t i = i0 + r, seen = i < sq ? m.offset() + i + 1 : lo;
        const int64_t first = i < sq ? m.first_key(batch, i) : lo;
        if (i < sq) {
          exp_shifted(p + first, seen - first, lse[(batch * m.hq + head) * sq + i]);
          float delta = dot(w.xdo.data() + r * dpad, out + m.q_at(batch, i, head), d);
          if (m.dropout.p > 0.0f) {
            // dS = P o (dP o mask - delta); then P o mask, which weighs dO into dV
            for_each_multiplier(m, batch, head, i, first, seen, [&](int64_t j, float keep) {
              ds[j] = p[j] * (ds[j] * keep - delta);
              p[j] *= keep;
            });
          } else {
            softmax_grad(ds + first, p + first, seen - first, delta);
          }
        }
        for (float* row : {p, ds}) {
          std::fill(row + lo, row + first, 0.0f);
          std::fill(row + seen, row + n, 0.0f);
        }
      }
      // dQ = scale * dS K; dK += dS^T (scale * Q); dV += P^T dO.
      weights_times_rows(w.acc.data(), dp_lo, ld, w.kp.data() + lo * dpad, dpad, cols);
      for (int r = 0; r < kRows && i0 + r < sq; ++r) {
        scaled_copy(dq + m.q_at(batch, i0 + r, head), w.acc.data() + r * dpad, d, scale);
      }
      add_outer4(w.dk.data() + lo * dpad, dp_lo, ld, w.xq.data(), dpad, cols);
      add_outer4(w.dv.data() + lo * dpad, p_lo, ld, w.xdo.data(), dpad, cols);
    }
  }
  for (int64_t j = 0; j < m.sk; ++j) {
    scaled_copy(dk + m.kv_at(batch, j, kvh), w.dk.data() + j * dpad, d, 1.0f);
    scaled_copy(dv + m.kv_at(batch, j, kvh), w.dv.data() + j * dpad, d, 1.0f);
  }
}

// Heads below which one thread does all the work (about 2^17 multiply-adds).
int64_t heads_per_thread(const Dims& m) {
  const int64_t keys = m.window < 0 ? m.sk : std::min(m.sk, m.window + 1);  // per query
  return std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, m.sq * keys * m.d));
}

Dims dims_of(const Tensor& q, const Tensor& k, int64_t window, const Tensor& key_start,
             const AttentionDropout& dropout) {
  Dims m{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), window};
  m.dropout = dropout;
  if (key_start.defined()) {
    m.key_start = key_start.data_ptr<int32_t>();
    m.key_ld = key_start.size(1);
    // The blocks take their first row's first key as the smallest, and every row needs a key.
    for (int64_t b = 0; b < m.b; ++b) {
      const int32_t* row = m.key_start + b * m.key_ld;
      for (int64_t p = 0; p < m.sk; ++p) {
        const int32_t previous = p == 0 ? 0 : row[p - 1];
        BRAID_CHECK(previous <= row[p] && row[p] <= p, "attention: key_start[", b, "][", p,
                    "] = ", row[p], " must be at most ", p, " and at least the position before's (",
                    previous, ")");
      }
    }
  }
  return m;
}

}  // namespace

void attention_forward(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       int64_t window, const Tensor& key_start, const AttentionDropout& dropout,
                       Stream) {
  const Dims m = dims_of(q, k, window, key_start, dropout);
  float* o = out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  const float* pq = q.data_ptr<float>();
  const float* pk = k.data_ptr<float>();
  const float* pv = v.data_ptr<float>();
  parallel_for(m.b * m.hq, heads_per_thread(m), [&](int64_t i0, int64_t i1) {
    Scratch w(m, false);
    for (int64_t i = i0; i < i1; ++i) forward_head(m, i / m.hq, i % m.hq, o, l, pq, pk, pv, w);
  });
}

void attention_backward(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        int64_t window, const Tensor& key_start, const AttentionDropout& dropout,
                        Stream) {
  const Dims m = dims_of(q, k, window, key_start, dropout);
  float* pdq = dq.data_ptr<float>();
  float* pdk = dk.data_ptr<float>();
  float* pdv = dv.data_ptr<float>();
  const float* pdo = dout.data_ptr<float>();
  const float* pq = q.data_ptr<float>();
  const float* pk = k.data_ptr<float>();
  const float* pv = v.data_ptr<float>();
  const float* po = out.data_ptr<float>();
  const float* pl = lse.data_ptr<float>();
  parallel_for(m.b * m.hkv, heads_per_thread(m), [&](int64_t i0, int64_t i1) {
    Scratch w(m, true);
    for (int64_t i = i0; i < i1; ++i) {
      backward_kv_head(m, i / m.hkv, i % m.hkv, pdq, pdk, pdv, pdo, pq, pk, pv, po, pl, w);
    }
  });
}

}  // namespace braid::ops::cpu
