// The op table's front door: checks every argument, then dispatches on the tensors' device to
// the CPU reference (kernels/cpu) or the CUDA implementation (kernels/cuda).
#include "braid/kernels/ops.h"

#include <cmath>
#include <string>
#include <vector>

#include "kernels/op_checks.h"

namespace braid::ops {
using namespace checks;

// ---------------------------------------------------------------- GEMM

void matmul(Tensor out, const Tensor& a, const Tensor& b, const Tensor& bias, bool trans_a,
            bool trans_b, float alpha, bool accumulate, Stream stream) {
  const char* op = "matmul";
  Device device = device_of(op, {{"out", out}, {"a", a}, {"b", b}, {"bias", bias, true}});
  BRAID_CHECK(a.dim() >= 1 && b.dim() >= 1 && out.dim() >= 1, op, ": a ", a.shape(), ", b ",
              b.shape(), " and out ", out.shape(), " need at least one dim");
  // Each operand as a matrix [numel / last dim, last dim].
  int64_t a_rows = rows_of(a), a_cols = last_dim(a), b_rows = rows_of(b), b_cols = last_dim(b);
  int64_t m = trans_a ? a_cols : a_rows, k = trans_a ? a_rows : a_cols;
  int64_t kb = trans_b ? b_cols : b_rows, n = trans_b ? b_rows : b_cols;
  BRAID_CHECK(k == kb, op, ": a ", a.shape(), (trans_a ? "^T" : ""), " and b ", b.shape(),
              (trans_b ? "^T" : ""), " disagree on K (", k, " vs ", kb, ")");
  BRAID_CHECK(last_dim(out) == n && out.numel() == m * n, op, ": out ", out.shape(),
              " does not hold the [", m, ", ", n, "] product of a ", a.shape(),
              (trans_a ? "^T" : ""), " and b ", b.shape(), (trans_b ? "^T" : ""));
  if (bias.defined()) {
    BRAID_CHECK(bias.numel() == n, op, ": bias ", bias.shape(), " does not match N = ", n);
  }
  if (device.is_cpu()) {
    check_activation(op, device, "a", a);
    check_activation(op, device, "b", b);
    check_activation(op, device, "out", out);
    if (bias.defined()) check_activation(op, device, "bias", bias);
  } else {
    check_activation(op, device, "a", a);
    check_same_dtype(op, "b", b, "a", a);
    BRAID_CHECK(out.dtype() == a.dtype() || out.dtype() == DType::f32, op, ": out is ",
                describe(out), " but a and b are ", dtype_name(a.dtype()),
                " (out is their dtype or f32)");
    if (bias.defined()) check_same_dtype(op, "bias", bias, "b", b);
  }
  if (out.numel() == 0) return;
  BRAID_DISPATCH(device, matmul, out, a, b, bias, trans_a, trans_b, alpha, accumulate, stream);
}

void bias_backward(Tensor dbias, const Tensor& dout, Stream stream) {
  const char* op = "bias_backward";
  Device device = device_of(op, {{"dbias", dbias}, {"dout", dout}});
  check_dtype(op, "dbias", dbias, DType::f32);
  check_activation(op, device, "dout", dout);
  BRAID_CHECK(dout.dim() >= 1 && dbias.numel() == last_dim(dout), op, ": dbias ", dbias.shape(),
              " does not match the last dim of dout ", dout.shape());
  if (dout.numel() == 0) return;
  BRAID_DISPATCH(device, bias_backward, dbias, dout, stream);
}

// ---------------------------------------------------------------- elementwise

void add(Tensor out, const Tensor& a, const Tensor& b, Stream stream) {
  const char* op = "add";
  Device device = device_of(op, {{"out", out}, {"a", a}, {"b", b}});
  check_activation(op, device, "a", a);
  check_like(op, "b", b, "a", a);
  check_like(op, "out", out, "a", a);
  if (out.numel() == 0) return;
  BRAID_DISPATCH(device, add, out, a, b, stream);
}

void scale(Tensor out, const Tensor& x, float alpha, float beta, Stream stream) {
  const char* op = "scale";
  Device device = device_of(op, {{"out", out}, {"x", x}});
  check_activation(op, device, "x", x);
  check_like(op, "out", out, "x", x);
  if (out.numel() == 0) return;
  BRAID_DISPATCH(device, scale, out, x, alpha, beta, stream);
}

void cast(Tensor out, const Tensor& x, Stream stream) {
  const char* op = "cast";
  Device device = device_of(op, {{"out", out}, {"x", x}});
  BRAID_CHECK(is_floating(out.dtype()) && is_floating(x.dtype()), op, ": x ", describe(x),
              " to out ", describe(out), " (cast converts between f32, bf16 and f16)");
  check_same_shape(op, "out", out, "x", x);
  if (out.numel() == 0) return;
  BRAID_DISPATCH(device, cast, out, x, stream);
}

// An elementwise activation's forward (out = f(x)) and backward (dx = dout f'(x)) checks and
// dispatch.
#define BRAID_ELEMENTWISE_ACTIVATION(name)                                              \
  void name##_forward(Tensor out, const Tensor& x, Stream stream) {                     \
    const char* op = #name "_forward";                                                  \
    Device device = device_of(op, {{"out", out}, {"x", x}});                            \
    check_activation(op, device, "x", x);                                               \
    check_like(op, "out", out, "x", x);                                                 \
    if (out.numel() == 0) return;                                                       \
    BRAID_DISPATCH(device, name##_forward, out, x, stream);                             \
  }                                                                                     \
  void name##_backward(Tensor dx, const Tensor& dout, const Tensor& x, Stream stream) { \
    const char* op = #name "_backward";                                                 \
    Device device = device_of(op, {{"dx", dx}, {"dout", dout}, {"x", x}});              \
    check_activation(op, device, "x", x);                                               \
    check_like(op, "dout", dout, "x", x);                                               \
    check_like(op, "dx", dx, "x", x);                                                   \
    if (dx.numel() == 0) return;                                                        \
    BRAID_DISPATCH(device, name##_backward, dx, dout, x, stream);                       \
  }

BRAID_ELEMENTWISE_ACTIVATION(gelu)
BRAID_ELEMENTWISE_ACTIVATION(gelu_exact)
BRAID_ELEMENTWISE_ACTIVATION(squared_relu)
BRAID_ELEMENTWISE_ACTIVATION(sigmoid)
#undef BRAID_ELEMENTWISE_ACTIVATION

namespace {
// x [..., 2F] and the [..., F] tensor on the other side of the gated linear unit, and the spec.
void check_glu(const char* op, const Tensor& halves, const char* name, const Tensor& x,
               const GluSpec& glu) {
  BRAID_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, op, ": x ", describe(x),
              " must hold [gate | up] in an even last dim");
  bool ok = halves.dim() == x.dim() && halves.size(-1) * 2 == x.size(-1);
  for (int d = 0; ok && d + 1 < x.dim(); ++d) ok = halves.size(d) == x.size(d);
  BRAID_CHECK(ok, op, ": ", name, " ", describe(halves), " must be x ", describe(x),
              " with the last dim halved");
  BRAID_CHECK(glu.clamp >= 0.0f && std::isfinite(glu.clamp), op, ": clamp = ", glu.clamp,
              " must be finite and >= 0 (0: none)");
  BRAID_CHECK(std::isfinite(glu.linear_offset), op, ": linear_offset = ", glu.linear_offset,
              " must be finite");
}
}  // namespace

void glu_forward(Tensor out, const Tensor& x, const GluSpec& glu, Stream stream) {
  const char* op = "glu_forward";
  Device device = device_of(op, {{"out", out}, {"x", x}});
  check_activation(op, device, "x", x);
  check_same_dtype(op, "out", out, "x", x);
  check_glu(op, out, "out", x, glu);
  if (x.numel() == 0) return;
  BRAID_DISPATCH(device, glu_forward, out, x, glu, stream);
}

void glu_backward(Tensor dx, const Tensor& dout, const Tensor& x, const GluSpec& glu,
                  Stream stream) {
  const char* op = "glu_backward";
  Device device = device_of(op, {{"dx", dx}, {"dout", dout}, {"x", x}});
  check_activation(op, device, "x", x);
  check_same_dtype(op, "dout", dout, "x", x);
  check_like(op, "dx", dx, "x", x);
  check_glu(op, dout, "dout", x, glu);
  if (x.numel() == 0) return;
  BRAID_DISPATCH(device, glu_backward, dx, dout, x, glu, stream);
}

void dropout_forward(Tensor out, const Tensor& x, float p, uint64_t seed, uint64_t offset,
                     int64_t first_element, Stream stream) {
  const char* op = "dropout_forward";
  Device device = device_of(op, {{"out", out}, {"x", x}});
  BRAID_CHECK(p >= 0.0f && p <= 1.0f, op, ": p = ", p, " is not in [0, 1]");
  BRAID_CHECK(first_element >= 0, op, ": first_element = ", first_element, " must not be negative");
  check_activation(op, device, "x", x);
  check_like(op, "out", out, "x", x);
  if (out.numel() == 0) return;
  BRAID_DISPATCH(device, dropout_forward, out, x, p, seed, offset, first_element, stream);
}

void dropout_backward(Tensor dx, const Tensor& dout, float p, uint64_t seed, uint64_t offset,
                      int64_t first_element, Stream stream) {
  const char* op = "dropout_backward";
  Device device = device_of(op, {{"dx", dx}, {"dout", dout}});
  BRAID_CHECK(p >= 0.0f && p <= 1.0f, op, ": p = ", p, " is not in [0, 1]");
  BRAID_CHECK(first_element >= 0, op, ": first_element = ", first_element, " must not be negative");
  check_activation(op, device, "dout", dout);
  check_like(op, "dx", dx, "dout", dout);
  if (dx.numel() == 0) return;
  BRAID_DISPATCH(device, dropout_backward, dx, dout, p, seed, offset, first_element, stream);
}

// ---------------------------------------------------------------- normalisation

namespace {
// x [..., C] with out/dx shaped like x, and a [C] parameter of x's dtype.
void check_norm_param(const char* op, const char* name, const Tensor& w, const Tensor& x) {
  check_same_dtype(op, name, w, "x", x);
  BRAID_CHECK(w.numel() == last_dim(x), op, ": ", name, " ", describe(w),
              " does not match the last dim of x ", describe(x));
}
void check_norm_grad(const char* op, const char* name, const Tensor& g, const Tensor& x) {
  check_dtype(op, name, g, DType::f32);
  BRAID_CHECK(g.numel() == last_dim(x), op, ": ", name, " ", describe(g),
              " does not match the last dim of x ", describe(x));
}
}  // namespace

void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, const Tensor& x, const Tensor& weight,
                       const Tensor& bias, float eps, Stream stream) {
  const char* op = "layernorm_forward";
  Device device = device_of(
      op,
      {{"out", out}, {"mean", mean}, {"rstd", rstd}, {"x", x}, {"weight", weight}, {"bias", bias}});
  BRAID_CHECK(x.dim() >= 1, op, ": x must have at least one dim, got ", describe(x));
  check_activation(op, device, "x", x);
  check_like(op, "out", out, "x", x);
  check_norm_param(op, "weight", weight, x);
  check_norm_param(op, "bias", bias, x);
  check_row_stat(op, "mean", mean, rows_of(x), x);
  check_row_stat(op, "rstd", rstd, rows_of(x), x);
  if (x.numel() == 0) return;
  BRAID_DISPATCH(device, layernorm_forward, out, mean, rstd, x, weight, bias, eps, stream);
}

void layernorm_backward(Tensor dx, Tensor dweight, Tensor dbias, const Tensor& dout,
                        const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, Stream stream) {
  const char* op = "layernorm_backward";
  Device device = device_of(op, {{"dx", dx},
                                 {"dweight", dweight},
                                 {"dbias", dbias},
                                 {"dout", dout},
                                 {"x", x},
                                 {"weight", weight},
                                 {"mean", mean},
                                 {"rstd", rstd}});
  BRAID_CHECK(x.dim() >= 1, op, ": x must have at least one dim, got ", describe(x));
  check_activation(op, device, "x", x);
  check_like(op, "dout", dout, "x", x);
  check_like(op, "dx", dx, "x", x);
  check_norm_param(op, "weight", weight, x);
  check_norm_grad(op, "dweight", dweight, x);
  check_norm_grad(op, "dbias", dbias, x);
  check_row_stat(op, "mean", mean, rows_of(x), x);
  check_row_stat(op, "rstd", rstd, rows_of(x), x);
  if (x.numel() == 0) return;
  BRAID_DISPATCH(device, layernorm_backward, dx, dweight, dbias, dout, x, weight, mean, rstd,
                 stream);
}

void rmsnorm_forward(Tensor out, Tensor rstd, const Tensor& x, const Tensor& weight, float eps,
                     Stream stream) {
  const char* op = "rmsnorm_forward";
  Device device = device_of(op, {{"out", out}, {"rstd", rstd}, {"x", x}, {"weight", weight}});
  BRAID_CHECK(x.dim() >= 1, op, ": x must have at least one dim, got ", describe(x));
  check_activation(op, device, "x", x);
  check_like(op, "out", out, "x", x);
  check_norm_param(op, "weight", weight, x);
  check_row_stat(op, "rstd", rstd, rows_of(x), x);
  if (x.numel() == 0) return;
  BRAID_DISPATCH(device, rmsnorm_forward, out, rstd, x, weight, eps, stream);
}

void rmsnorm_backward(Tensor dx, Tensor dweight, const Tensor& dout, const Tensor& x,
                      const Tensor& weight, const Tensor& rstd, Stream stream) {
  const char* op = "rmsnorm_backward";
  Device device = device_of(op, {{"dx", dx},
                                 {"dweight", dweight},
                                 {"dout", dout},
                                 {"x", x},
                                 {"weight", weight},
                                 {"rstd", rstd}});
  BRAID_CHECK(x.dim() >= 1, op, ": x must have at least one dim, got ", describe(x));
  check_activation(op, device, "x", x);
  check_like(op, "dout", dout, "x", x);
  check_like(op, "dx", dx, "x", x);
  check_norm_param(op, "weight", weight, x);
  check_norm_grad(op, "dweight", dweight, x);
  check_row_stat(op, "rstd", rstd, rows_of(x), x);
  if (x.numel() == 0) return;
  BRAID_DISPATCH(device, rmsnorm_backward, dx, dweight, dout, x, weight, rstd, stream);
}

// ---------------------------------------------------------------- positions and embeddings

namespace {
void check_rope(const char* op, Device device, const char* out_name, const Tensor& out,
                const char* in_name, const Tensor& in, const RotaryFrequencies& rotary,
                int64_t position_offset, const Tensor& positions) {
  BRAID_CHECK(position_offset >= 0, op, ": position_offset = ", position_offset,
              " must not be negative");
  check_activation(op, device, in_name, in);
  check_like(op, out_name, out, in_name, in);
  rotary.validate();
  BRAID_CHECK(in.dim() == 4, op, ": ", in_name, " must be [B, S, H, D], got ", describe(in));
  const int64_t d = in.size(3), first = rotary.first_channel, r = rotary.rotated_channels(d);
  BRAID_CHECK(first <= d, op, ": first_channel ", first, " exceeds the head's ", d, " channels (",
              in_name, " ", describe(in), ")");
  BRAID_CHECK(r <= d - first, op, ": first_channel ", first, " + rotary_dim ", r,
              " exceeds the head's ", d, " channels (", in_name, " ", describe(in), ")");
  BRAID_CHECK(r % 2 == 0, op, ": the ", r, " channels that turn (head dim ", d, " - first_channel ",
              first, ") must be even (", in_name, " ", describe(in), ")");
  check_token_table(op, "positions", positions, device, in.size(0), in.size(1), false);
}
}  // namespace

void rope_forward(Tensor out, const Tensor& x, const RotaryFrequencies& rotary,
                  int64_t position_offset, const Tensor& positions, Stream stream) {
  const char* op = "rope_forward";
  Device device = device_of(op, {{"out", out}, {"x", x}});
  check_rope(op, device, "out", out, "x", x, rotary, position_offset, positions);
  if (x.numel() == 0) return;
  const std::vector<float> inv_freq = rotary.inv_freq(x.size(3));
  BRAID_DISPATCH(device, rope_forward, out, x, inv_freq, rotary.first_channel, rotary.interleaved,
                 position_offset, positions, rotary.attention_factor, stream);
}

void rope_backward(Tensor dx, const Tensor& dout, const RotaryFrequencies& rotary,
                   int64_t position_offset, const Tensor& positions, Stream stream) {
  const char* op = "rope_backward";
  Device device = device_of(op, {{"dx", dx}, {"dout", dout}});
  check_rope(op, device, "dx", dx, "dout", dout, rotary, position_offset, positions);
  if (dout.numel() == 0) return;
  const std::vector<float> inv_freq = rotary.inv_freq(dout.size(3));
  BRAID_DISPATCH(device, rope_backward, dx, dout, inv_freq, rotary.first_channel,
                 rotary.interleaved, position_offset, positions, rotary.attention_factor, stream);
}

namespace {
// out [..., C] (the dims of ids, then C) against weight [V_local, C].
void check_embedding(const char* op, const char* out_name, const Tensor& out, const Tensor& ids,
                     const Tensor& weight) {
  check_dtype(op, "ids", ids, DType::i32);
  BRAID_CHECK(weight.dim() == 2, op, ": weight must be [V, C], got ", describe(weight));
  bool ok = out.dim() == ids.dim() + 1 && out.size(-1) == weight.size(1);
  for (int d = 0; ok && d < ids.dim(); ++d) ok = out.size(d) == ids.size(d);
  BRAID_CHECK(ok, op, ": ", out_name, " ", describe(out), " must be ids ", ids.shape(),
              " followed by C = ", weight.size(1), " (weight ", describe(weight), ")");
}
}  // namespace

void embedding_forward(Tensor out, const Tensor& ids, const Tensor& weight, int64_t vocab_offset,
                       Stream stream) {
  const char* op = "embedding_forward";
  Device device = device_of(op, {{"out", out}, {"ids", ids}, {"weight", weight}});
  check_activation(op, device, "weight", weight);
  check_same_dtype(op, "out", out, "weight", weight);
  check_embedding(op, "out", out, ids, weight);
  if (out.numel() == 0) return;
  BRAID_DISPATCH(device, embedding_forward, out, ids, weight, vocab_offset, stream);
}

void embedding_backward(Tensor dweight, const Tensor& dout, const Tensor& ids, int64_t vocab_offset,
                        Stream stream) {
  const char* op = "embedding_backward";
  Device device = device_of(op, {{"dweight", dweight}, {"dout", dout}, {"ids", ids}});
  check_dtype(op, "dweight", dweight, DType::f32);
  check_activation(op, device, "dout", dout);
  check_embedding(op, "dout", dout, ids, dweight);
  if (dout.numel() == 0) return;
  BRAID_DISPATCH(device, embedding_backward, dweight, dout, ids, vocab_offset, stream);
}

// ---------------------------------------------------------------- column copies

namespace {
// Columns [column, column + width) lie within [0, columns) (width >= 0 checked).
void check_columns(const char* op, const char* name, const Tensor& t, int64_t columns,
                   const char* column_name, int64_t column, int64_t width) {
  BRAID_CHECK(column >= 0 && column <= columns - width, op, ": ", column_name, " ", column,
              " with width ", width, " is outside [0, ", columns, "), the last dim of ", name, " ",
              describe(t));
}

// out [R, H, D] and x [R, W] (x is dx for sum_heads) of broadcast_heads and sum_heads.
void check_heads(const char* op, Device device, const char* out_name, const Tensor& out,
                 const char* x_name, const Tensor& x, int64_t column) {
  check_activation(op, device, x_name, x);
  check_same_dtype(op, out_name, out, x_name, x);
  BRAID_CHECK(out.dim() == 3 && x.dim() == 2, op, ": ", out_name, " ", describe(out),
              " must be [R, H, D] and ", x_name, " ", describe(x), " [R, W]");
  BRAID_CHECK(out.size(0) == x.size(0), op, ": ", out_name, " ", describe(out), " and ", x_name,
              " ", describe(x), " disagree on R");
  check_columns(op, out_name, out, out.size(2), "column", column, x.size(1));
}
}  // namespace

void copy_columns(Tensor dst, int64_t dst_column, const Tensor& src, int64_t src_column,
                  int64_t width, Stream stream) {
  const char* op = "copy_columns";
  Device device = device_of(op, {{"dst", dst}, {"src", src}});
  check_activation(op, device, "src", src);
  check_same_dtype(op, "dst", dst, "src", src);
  BRAID_CHECK(dst.dim() == 2 && src.dim() == 2, op, ": dst ", describe(dst), " and src ",
              describe(src), " must be [R, C]");
  BRAID_CHECK(dst.size(0) == src.size(0), op, ": dst ", describe(dst), " and src ", describe(src),
              " disagree on R");
  BRAID_CHECK(width >= 0, op, ": width ", width, " must not be negative");
  check_columns(op, "dst", dst, dst.size(1), "dst_column", dst_column, width);
  check_columns(op, "src", src, src.size(1), "src_column", src_column, width);
  if (dst.size(0) == 0 || width == 0) return;
  BRAID_DISPATCH(device, copy_columns, dst, dst_column, src, src_column, width, stream);
}

void broadcast_heads(Tensor out, int64_t column, const Tensor& x, Stream stream) {
  const char* op = "broadcast_heads";
  Device device = device_of(op, {{"out", out}, {"x", x}});
  check_heads(op, device, "out", out, "x", x, column);
  if (out.numel() == 0 || x.numel() == 0) return;
  BRAID_DISPATCH(device, broadcast_heads, out, column, x, stream);
}

void sum_heads(Tensor dx, const Tensor& dout, int64_t column, Stream stream) {
  const char* op = "sum_heads";
  Device device = device_of(op, {{"dx", dx}, {"dout", dout}});
  check_heads(op, device, "dout", dout, "dx", dx, column);
  if (dx.numel() == 0) return;
  BRAID_DISPATCH(device, sum_heads, dx, dout, column, stream);
}

// ---------------------------------------------------------------- cross-entropy

namespace {
// logits [T, V_local] (activation dtype); targets [T] i32.
void check_logits(const char* op, Device device, const Tensor& logits, const Tensor& targets) {
  check_activation(op, device, "logits", logits);
  BRAID_CHECK(logits.dim() == 2, op, ": logits must be [T, V], got ", describe(logits));
  check_dtype(op, "targets", targets, DType::i32);
  check_shape(op, "targets", targets, Shape{logits.size(0)});
}
void check_row_f32(const char* op, const char* name, const Tensor& t, const Tensor& targets) {
  check_dtype(op, name, t, DType::f32);
  check_shape(op, name, t, targets.shape());
}
}  // namespace

void cross_entropy_partials(Tensor max, Tensor sumexp, Tensor target_logit, const Tensor& logits,
                            const Tensor& targets, int64_t vocab_offset, Stream stream) {
  const char* op = "cross_entropy_partials";
  Device device = device_of(op, {{"max", max},
                                 {"sumexp", sumexp},
                                 {"target_logit", target_logit},
                                 {"logits", logits},
                                 {"targets", targets}});
  check_logits(op, device, logits, targets);
  check_row_f32(op, "max", max, targets);
  check_row_f32(op, "sumexp", sumexp, targets);
  check_row_f32(op, "target_logit", target_logit, targets);
  if (targets.numel() == 0) return;
  BRAID_DISPATCH(device, cross_entropy_partials, max, sumexp, target_logit, logits, targets,
                 vocab_offset, stream);
}

void cross_entropy_loss(Tensor loss, const Tensor& max, const Tensor& sumexp,
                        const Tensor& target_logit, const Tensor& targets, Stream stream) {
  const char* op = "cross_entropy_loss";
  Device device = device_of(op, {{"loss", loss},
                                 {"max", max},
                                 {"sumexp", sumexp},
                                 {"target_logit", target_logit},
                                 {"targets", targets}});
  check_dtype(op, "targets", targets, DType::i32);
  BRAID_CHECK(targets.dim() == 1, op, ": targets must be [T], got ", describe(targets));
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"loss", loss},
                                {"max", max},
                                {"sumexp", sumexp},
                                {"target_logit", target_logit}}) {
    check_row_f32(op, name, t, targets);
  }
  if (targets.numel() == 0) return;
  BRAID_DISPATCH(device, cross_entropy_loss, loss, max, sumexp, target_logit, targets, stream);
}

void cross_entropy_rescale(Tensor sumexp, const Tensor& max, const Tensor& global_max,
                           Stream stream) {
  const char* op = "cross_entropy_rescale";
  Device device = device_of(op, {{"sumexp", sumexp}, {"max", max}, {"global_max", global_max}});
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"sumexp", sumexp},
                                {"max", max},
                                {"global_max", global_max}}) {
    check_row_f32(op, name, t, sumexp);
  }
  BRAID_CHECK(sumexp.dim() == 1, op, ": sumexp must be [T], got ", describe(sumexp));
  if (sumexp.numel() == 0) return;
  BRAID_DISPATCH(device, cross_entropy_rescale, sumexp, max, global_max, stream);
}

void cross_entropy_backward(Tensor dlogits, const Tensor& logits, const Tensor& targets,
                            const Tensor& max, const Tensor& sumexp, const Tensor& dloss,
                            int64_t vocab_offset, Stream stream) {
  const char* op = "cross_entropy_backward";
  Device device = device_of(op, {{"dlogits", dlogits},
                                 {"logits", logits},
                                 {"targets", targets},
                                 {"max", max},
                                 {"sumexp", sumexp},
                                 {"dloss", dloss}});
  check_logits(op, device, logits, targets);
  check_like(op, "dlogits", dlogits, "logits", logits);
  check_row_f32(op, "max", max, targets);
  check_row_f32(op, "sumexp", sumexp, targets);
  check_row_f32(op, "dloss", dloss, targets);
  if (logits.numel() == 0) return;
  BRAID_DISPATCH(device, cross_entropy_backward, dlogits, logits, targets, max, sumexp, dloss,
                 vocab_offset, stream);
}

// ---------------------------------------------------------------- optimizer

void adamw_step(std::span<const AdamWGroup> groups, const AdamWHyper& hyper, Stream stream) {
  const char* op = "adamw_step";
  BRAID_CHECK(hyper.step >= 1, op, ": step is 1-based, got ", hyper.step);
  BRAID_CHECK(
      hyper.beta1 >= 0.0f && hyper.beta1 < 1.0f && hyper.beta2 >= 0.0f && hyper.beta2 < 1.0f, op,
      ": betas (", hyper.beta1, ", ", hyper.beta2, ") must be in [0, 1)");
  std::vector<AdamWGroup> work;
  for (size_t i = 0; i < groups.size(); ++i) {
    const AdamWGroup& g = groups[i];
    std::string where = std::string(op) + " (group " + std::to_string(i) + ")";
    const char* w = where.c_str();
    Device device = device_of(w, {{"master", g.master},
                                  {"grad", g.grad},
                                  {"exp_avg", g.exp_avg},
                                  {"exp_avg_sq", g.exp_avg_sq},
                                  {"model_param", g.model_param, true}});
    if (!work.empty()) {
      BRAID_CHECK(device == work.front().master.device(), w, ": on ", device.str(),
                  " but group 0 is on ", work.front().master.device().str());
    }
    for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"master", g.master},
                                  {"grad", g.grad},
                                  {"exp_avg", g.exp_avg},
                                  {"exp_avg_sq", g.exp_avg_sq}}) {
      check_dtype(w, name, t, DType::f32);
      BRAID_CHECK(t.numel() == g.master.numel(), w, ": ", name, " ", describe(t), " and master ",
                  describe(g.master), " differ in numel");
    }
    if (g.model_param.defined()) {
      BRAID_CHECK(is_floating(g.model_param.dtype()) && g.model_param.numel() == g.master.numel(),
                  w, ": model_param ", describe(g.model_param),
                  " must be a f32/bf16/f16 copy of master ", describe(g.master));
    }
    if (g.master.numel() > 0) work.push_back(g);
  }
  if (work.empty()) return;
  BRAID_DISPATCH(work.front().master.device(), adamw_step, work, hyper, stream);
}

namespace {

// sum_of_squares' and count_zeros' checks: `out` one element of `dtype`, float tensors on its
// device.
Device check_tensor_statistic(const char* op, const Tensor& out, DType dtype,
                              std::span<const Tensor> tensors) {
  Device device = device_of(op, {{"out", out}});
  check_dtype(op, "out", out, dtype);
  BRAID_CHECK(out.numel() == 1, op, ": out must hold one element, got ", describe(out));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    BRAID_CHECK(t.defined(), op, ": tensor ", i, " is undefined");
    BRAID_CHECK(t.device() == device, op, ": tensor ", i, " is on ", t.device().str(),
                " but out is on ", device.str());
    BRAID_CHECK(is_floating(t.dtype()), op, ": tensor ", i, " is ", describe(t),
                " (f32, bf16 or f16)");
  }
  return device;
}

}  // namespace

void sum_of_squares(Tensor out, std::span<const Tensor> tensors, Stream stream) {
  Device device = check_tensor_statistic("sum_of_squares", out, DType::f32, tensors);
  BRAID_DISPATCH(device, sum_of_squares, out, tensors, stream);
}

void count_zeros(Tensor out, std::span<const Tensor> tensors, Stream stream) {
  Device device = check_tensor_statistic("count_zeros", out, DType::i64, tensors);
  BRAID_DISPATCH(device, count_zeros, out, tensors, stream);
}

}  // namespace braid::ops
