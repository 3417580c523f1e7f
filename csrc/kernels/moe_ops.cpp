// The mixture-of-experts ops' front door (ops.h, "mixture of experts"): checks every argument,
// then dispatches to kernels/cpu/moe.cpp or kernels/cuda/moe.cu.
#include <cmath>

#include "kernels/op_checks.h"

namespace braid::ops {
using namespace checks;

// ---------------------------------------------------------------- mixture of experts

namespace {
constexpr int64_t kMaxExperts = 1024;

// logits [T, E] f32 and the [T, k] probs / experts of a routing.
void check_routing(const char* op, const Tensor& logits, const char* probs_name,
                   const Tensor& probs, const Tensor& experts) {
  check_dtype(op, "logits", logits, DType::f32);
  BRAID_CHECK(logits.dim() == 2 && logits.size(1) >= 1 && logits.size(1) <= kMaxExperts, op,
              ": logits ", describe(logits), " must be [tokens, experts] with 1 to ", kMaxExperts,
              " experts");
  check_dtype(op, "experts", experts, DType::i32);
  BRAID_CHECK(experts.dim() == 2 && experts.size(0) == logits.size(0) && experts.size(1) >= 1 &&
                  experts.size(1) <= logits.size(1),
              op, ": experts ", describe(experts), " must be [", logits.size(0),
              ", k] with 1 <= k <= ", logits.size(1), " (logits ", describe(logits), ")");
  check_dtype(op, probs_name, probs, DType::f32);
  check_same_shape(op, probs_name, probs, "experts", experts);
}

void check_expert_vector(const char* op, const char* name, const Tensor& t, const Tensor& logits) {
  if (!t.defined()) return;
  check_dtype(op, name, t, DType::f32);
  check_shape(op, name, t, Shape{logits.size(1)});
}

// score_sums / aux_grad: [G, E] f32 with G dividing the T tokens.
void check_group_scores(const char* op, const char* name, const Tensor& t, const Tensor& logits) {
  if (!t.defined()) return;
  check_dtype(op, name, t, DType::f32);
  const int64_t tokens = logits.size(0);
  BRAID_CHECK(
      t.dim() == 2 && t.size(1) == logits.size(1) && t.size(0) >= 1 && tokens % t.size(0) == 0, op,
      ": ", name, " ", describe(t), " must be [G, ", logits.size(1), "] with G dividing the ",
      tokens, " tokens");
}

void check_spec(const char* op, const MoeRouterSpec& spec, const Tensor& experts,
                const Tensor& logits) {
  const int64_t e = logits.size(1), k = experts.size(1);
  BRAID_CHECK(!(spec.sigmoid && spec.softmax_first), op,
              ": softmax_first is for the softmax score function");
  BRAID_CHECK(spec.scaling_factor > 0 && std::isfinite(spec.scaling_factor), op,
              ": scaling_factor must be > 0 and finite, got ", spec.scaling_factor);
  BRAID_CHECK(spec.num_groups != 0 || spec.group_topk == 0, op, ": group_topk ", spec.group_topk,
              " needs num_groups");
  if (spec.num_groups == 0) return;
  const int64_t g = spec.num_groups, gk = spec.group_topk;
  BRAID_CHECK(g >= 1 && e % g == 0 && gk >= 1 && gk <= g && k % gk == 0 && k / gk <= e / g, op,
              ": num_groups ", g, " must divide the ", e, " experts, group_topk ", gk,
              " be in [1, num_groups] and divide k = ", k,
              ", and k / group_topk be at most a "
              "group's experts");
}

// rows [T, k] i32 indexing the N rows of y, and the [T, C] tensor on the other side.
void check_combine(const char* op, const Tensor& out, const char* out_name, const Tensor& y,
                   const Tensor& rows) {
  BRAID_CHECK(y.dim() == 2, op, ": y ", describe(y), " must be [rows, C]");
  check_dtype(op, "rows", rows, DType::i32);
  BRAID_CHECK(rows.dim() == 2, op, ": rows ", describe(rows), " must be [tokens, k]");
  check_shape(op, out_name, out, Shape{rows.size(0), y.size(1)});
}
}  // namespace

void moe_router_forward(Tensor probs, Tensor experts, Tensor score_sums, Tensor lse,
                        const Tensor& logits, const Tensor& expert_bias, const MoeRouterSpec& spec,
                        Stream stream) {
  const char* op = "moe_router_forward";
  Device device = device_of(op, {{"probs", probs},
                                 {"experts", experts},
                                 {"score_sums", score_sums, true},
                                 {"lse", lse, true},
                                 {"logits", logits},
                                 {"expert_bias", expert_bias, true}});
  check_routing(op, logits, "probs", probs, experts);
  check_spec(op, spec, experts, logits);
  check_group_scores(op, "score_sums", score_sums, logits);
  check_expert_vector(op, "expert_bias", expert_bias, logits);
  BRAID_CHECK(!expert_bias.defined() || spec.sigmoid, op,
              ": expert_bias is for the sigmoid score function");
  if (lse.defined()) {
    check_dtype(op, "lse", lse, DType::f32);
    check_shape(op, "lse", lse, Shape{logits.size(0)});
  }
  BRAID_DISPATCH(device, moe_router_forward, probs, experts, score_sums, lse, logits, expert_bias,
                 spec, stream);
}

void moe_router_backward(Tensor dlogits, const Tensor& dprobs, const Tensor& logits,
                         const Tensor& experts, const MoeRouterSpec& spec, const Tensor& aux_grad,
                         float z_grad, Stream stream) {
  const char* op = "moe_router_backward";
  Device device = device_of(op, {{"dlogits", dlogits},
                                 {"dprobs", dprobs},
                                 {"logits", logits},
                                 {"experts", experts},
                                 {"aux_grad", aux_grad, true}});
  check_routing(op, logits, "dprobs", dprobs, experts);
  check_spec(op, spec, experts, logits);
  check_like(op, "dlogits", dlogits, "logits", logits);
  check_group_scores(op, "aux_grad", aux_grad, logits);
  BRAID_CHECK(std::isfinite(z_grad), op, ": z_grad must be finite, got ", z_grad);
  if (logits.numel() == 0) return;
  BRAID_DISPATCH(device, moe_router_backward, dlogits, dprobs, logits, experts, spec, aux_grad,
                 z_grad, stream);
}

void gather_rows(Tensor out, const Tensor& x, const Tensor& index, const Tensor& scale,
                 Stream stream) {
  const char* op = "gather_rows";
  Device device = device_of(op, {{"out", out}, {"x", x}, {"index", index}, {"scale", scale, true}});
  check_activation(op, device, "x", x);
  check_same_dtype(op, "out", out, "x", x);
  BRAID_CHECK(x.dim() == 2, op, ": x ", describe(x), " must be [rows, C]");
  check_dtype(op, "index", index, DType::i32);
  BRAID_CHECK(index.dim() == 1, op, ": index ", describe(index), " must be [N]");
  check_shape(op, "out", out, Shape{index.size(0), x.size(1)});
  if (scale.defined()) {
    check_dtype(op, "scale", scale, DType::f32);
    check_shape(op, "scale", scale, Shape{index.size(0)});
  }
  if (out.numel() == 0) return;
  BRAID_DISPATCH(device, gather_rows, out, x, index, scale, stream);
}

void combine_rows(Tensor out, const Tensor& y, const Tensor& rows, const Tensor& weight,
                  Stream stream) {
  const char* op = "combine_rows";
  Device device = device_of(op, {{"out", out}, {"y", y}, {"rows", rows}, {"weight", weight, true}});
  check_activation(op, device, "y", y);
  check_same_dtype(op, "out", out, "y", y);
  check_combine(op, out, "out", y, rows);
  if (weight.defined()) {
    check_dtype(op, "weight", weight, DType::f32);
    check_same_shape(op, "weight", weight, "rows", rows);
  }
  if (out.numel() == 0) return;
  BRAID_DISPATCH(device, combine_rows, out, y, rows, weight, stream);
}

void combine_rows_weight_grad(Tensor dweight, const Tensor& dout, const Tensor& y,
                              const Tensor& rows, Stream stream) {
  const char* op = "combine_rows_weight_grad";
  Device device = device_of(op, {{"dweight", dweight}, {"dout", dout}, {"y", y}, {"rows", rows}});
  check_activation(op, device, "y", y);
  check_same_dtype(op, "dout", dout, "y", y);
  check_combine(op, dout, "dout", y, rows);
  check_dtype(op, "dweight", dweight, DType::f32);
  check_same_shape(op, "dweight", dweight, "rows", rows);
  if (dweight.numel() == 0) return;
  BRAID_DISPATCH(device, combine_rows_weight_grad, dweight, dout, y, rows, stream);
}

}  // namespace braid::ops
