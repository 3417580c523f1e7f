// The attention ops' front door (ops.h, "attention"): checks every argument, then dispatches to
// kernels/cpu/attention*.cpp or kernels/cuda/attention*.cu.
#include "kernels/op_checks.h"

namespace braid::ops {
using namespace checks;

// ---------------------------------------------------------------- attention

namespace {
void check_window(const char* op, int64_t window) {
  BRAID_CHECK(window >= -1, op, ": window ", window,
              " must be >= 0 (keys before each query it sees) or -1 (no window)");
}

// -1 for a window that reaches every key anyway (the last query's sees `keys` - 1 before it):
// the kernels then take their windowless path, and no bound arithmetic can overflow.
int64_t effective_window(int64_t window, int64_t keys) { return window >= keys - 1 ? -1 : window; }

// q [B, Sq, Hq, D], k, v [B, Sk, Hkv, D], Sq <= Sk, Hq % Hkv == 0; lse [B, Hq, Sq] f32.
void check_attention(const char* op, Device device, const Tensor& q, const Tensor& k,
                     const Tensor& v, const Tensor& lse, int64_t window, const Tensor& key_start) {
  check_window(op, window);
  check_activation(op, device, "q", q);
  check_same_dtype(op, "k", k, "q", q);
  check_same_dtype(op, "v", v, "q", q);
  BRAID_CHECK(q.dim() == 4 && k.dim() == 4, op, ": q ", describe(q), " and k ", describe(k),
              " must be [B, S, H, D]");
  check_same_shape(op, "v", v, "k", k);
  BRAID_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), op, ": q ", q.shape(), " and k ",
              k.shape(), " disagree on B or D");
  BRAID_CHECK(q.size(1) <= k.size(1), op, ": q ", q.shape(), " has more positions than k ",
              k.shape(), " (queries are the last Sq of the Sk key positions)");
  BRAID_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, op, ": q has ", q.size(2),
              " heads, not a multiple of the ", k.size(2), " kv heads (q ", q.shape(), ", k ",
              k.shape(), ")");
  check_dtype(op, "lse", lse, DType::f32);
  check_shape(op, "lse", lse, Shape{q.size(0), q.size(2), q.size(1)});
  check_token_table(op, "key_start", key_start, device, q.size(0), k.size(1), true);
}

// keys: Sk. The mask's Philox counter holds a query position in 32 bits.
void check_dropout(const char* op, const AttentionDropout& dropout, int64_t keys) {
  BRAID_CHECK(dropout.p >= 0.0f && dropout.p < 1.0f, op, ": dropout probability ", dropout.p,
              " must lie in [0, 1)");
  BRAID_CHECK(dropout.first_position + keys <= (int64_t(1) << 32), op,
              ": dropout's positions reach ", dropout.first_position + keys,
              ", beyond the mask's 2^32");
  BRAID_CHECK(dropout.first_sequence >= 0 && dropout.first_head >= 0 && dropout.first_position >= 0,
              op, ": dropout's first sequence, head and position (", dropout.first_sequence, ", ",
              dropout.first_head, ", ", dropout.first_position, ") must be >= 0");
}

// sinks [Hq] (one logit per query head) of the reference argument's dtype.
void check_sinks(const char* op, const Tensor& sinks, const char* ref_name, const Tensor& ref,
                 int64_t heads) {
  check_same_dtype(op, "sinks", sinks, ref_name, ref);
  check_shape(op, "sinks", sinks, Shape{heads});
}

// attention_forward's out [B, Sq, Hq, D] and lse [B, Hq, Sq] f32, and the sinks [Hq] of out's
// dtype.
void check_sink_softmax(const char* op, Device device, const Tensor& out, const Tensor& lse,
                        const Tensor& sinks) {
  check_activation(op, device, "out", out);
  BRAID_CHECK(out.dim() == 4, op, ": out must be [B, Sq, Hq, D], got ", describe(out));
  check_dtype(op, "lse", lse, DType::f32);
  check_shape(op, "lse", lse, Shape{out.size(0), out.size(2), out.size(1)});
  check_sinks(op, sinks, "out", out, out.size(2));
}
}  // namespace

void attention_forward(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       int64_t window, const Tensor& key_start, const AttentionDropout& dropout,
                       Stream stream) {
  const char* op = "attention_forward";
  Device device = device_of(op, {{"out", out}, {"lse", lse}, {"q", q}, {"k", k}, {"v", v}});
  check_attention(op, device, q, k, v, lse, window, key_start);
  check_dropout(op, dropout, k.size(1));
  check_like(op, "out", out, "q", q);
  if (out.numel() == 0 && lse.numel() == 0) return;
  BRAID_DISPATCH(device, attention_forward, out, lse, q, k, v, effective_window(window, k.size(1)),
                 key_start, dropout, stream);
}

void attention_backward(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        int64_t window, const Tensor& key_start, const AttentionDropout& dropout,
                        Stream stream) {
  const char* op = "attention_backward";
  Device device = device_of(op, {{"dq", dq},
                                 {"dk", dk},
                                 {"dv", dv},
                                 {"dout", dout},
                                 {"q", q},
                                 {"k", k},
                                 {"v", v},
                                 {"out", out},
                                 {"lse", lse}});
  check_attention(op, device, q, k, v, lse, window, key_start);
  check_dropout(op, dropout, k.size(1));
  for (const auto& [name, t] :
       {std::pair<const char*, const Tensor&>{"dq", dq}, {"dout", dout}, {"out", out}}) {
    check_like(op, name, t, "q", q);
  }
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"dk", dk}, {"dv", dv}}) {
    check_like(op, name, t, "k", k);
  }
  if (dq.numel() == 0 && dk.numel() == 0) return;
  BRAID_DISPATCH(device, attention_backward, dq, dk, dv, dout, q, k, v, out, lse,
                 effective_window(window, k.size(1)), key_start, dropout, stream);
}

void attention_cached_forward(Tensor out, const Tensor& q, const Tensor& k_cache,
                              const Tensor& v_cache, int64_t length, int64_t window,
                              const Tensor& sinks, Stream stream) {
  const char* op = "attention_cached_forward";
  Device device = device_of(
      op,
      {{"out", out}, {"q", q}, {"k_cache", k_cache}, {"v_cache", v_cache}, {"sinks", sinks, true}});
  check_activation(op, device, "q", q);
  check_same_dtype(op, "k_cache", k_cache, "q", q);
  check_same_dtype(op, "v_cache", v_cache, "q", q);
  BRAID_CHECK(q.dim() == 4 && k_cache.dim() == 4, op, ": q ", describe(q), " and k_cache ",
              describe(k_cache), " must be [B, S, H, D]");
  check_same_shape(op, "v_cache", v_cache, "k_cache", k_cache);
  BRAID_CHECK(k_cache.size(0) == q.size(0) && k_cache.size(3) == q.size(3), op, ": q ", q.shape(),
              " and k_cache ", k_cache.shape(), " disagree on B or D");
  BRAID_CHECK(k_cache.size(2) > 0 && q.size(2) % k_cache.size(2) == 0, op, ": q has ", q.size(2),
              " heads, not a multiple of the ", k_cache.size(2), " kv heads");
  BRAID_CHECK(q.size(1) <= length && length <= k_cache.size(1), op, ": length ", length,
              " must lie in [Sq, C] = [", q.size(1), ", ", k_cache.size(1), "]");
  check_window(op, window);
  check_like(op, "out", out, "q", q);
  if (sinks.defined()) check_sinks(op, sinks, "q", q, q.size(2));
  if (out.numel() == 0) return;
  BRAID_DISPATCH(device, attention_cached_forward, out, q, k_cache, v_cache, length,
                 effective_window(window, length), sinks, stream);
}

void attention_sink_forward(Tensor out, Tensor lse, const Tensor& sinks, Stream stream) {
  const char* op = "attention_sink_forward";
  Device device = device_of(op, {{"out", out}, {"lse", lse}, {"sinks", sinks}});
  check_sink_softmax(op, device, out, lse, sinks);
  if (lse.numel() == 0) return;
  BRAID_DISPATCH(device, attention_sink_forward, out, lse, sinks, stream);
}

void attention_sink_backward(Tensor dsinks, const Tensor& dout, const Tensor& out,
                             const Tensor& lse, const Tensor& sinks, Stream stream) {
  const char* op = "attention_sink_backward";
  Device device = device_of(
      op, {{"dsinks", dsinks}, {"dout", dout}, {"out", out}, {"lse", lse}, {"sinks", sinks}});
  check_sink_softmax(op, device, out, lse, sinks);
  check_like(op, "dout", dout, "out", out);
  check_dtype(op, "dsinks", dsinks, DType::f32);
  check_shape(op, "dsinks", dsinks, sinks.shape());
  if (lse.numel() == 0) return;
  BRAID_DISPATCH(device, attention_sink_backward, dsinks, dout, out, lse, sinks, stream);
}

}  // namespace braid::ops
