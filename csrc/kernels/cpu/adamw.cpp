// AdamW on the CPU, step for step the arithmetic of torch.optim.AdamW (single-tensor path,
// fp32): decay, lerp of the first moment, bias corrections computed in double as Python does.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {
namespace {

// The scalars of one step for one group, rounded to f32 where torch rounds them.
struct AdamWScalars {
  float decay;         // 1 - lr * weight_decay
  float one_minus_b1;  // lerp weight
  float beta2, one_minus_b2;
  float step_size;  // lr / (1 - beta1^t)
  float bc2_sqrt;   // sqrt(1 - beta2^t)
  float eps, grad_scale;
};

BRAID_CPU_MULTIVERSION void adamw_chunk(float* __restrict p, const float* __restrict grad,
                                        float* __restrict m, float* __restrict v, int64_t n,
                                        const AdamWScalars& c) {
  for (int64_t i = 0; i < n; ++i) {
    float g = grad[i] * c.grad_scale;
    float pi = p[i] * c.decay;
    float mi = m[i] + c.one_minus_b1 * (g - m[i]);  // torch.lerp for weight < 0.5
    float vi = v[i] * c.beta2 + c.one_minus_b2 * g * g;
    float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    p[i] = pi + (-c.step_size * mi) / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

void write_model_copy(void* dst, DType dtype, const float* src, int64_t begin, int64_t end) {
  switch (dtype) {
    case DType::f32:
      std::copy(src + begin, src + end, static_cast<float*>(dst) + begin);
      break;
    case DType::bf16:
      for (int64_t i = begin; i < end; ++i) static_cast<uint16_t*>(dst)[i] = float_to_bf16(src[i]);
      break;
    default:
      for (int64_t i = begin; i < end; ++i) static_cast<uint16_t*>(dst)[i] = float_to_f16(src[i]);
      break;
  }
}

}  // namespace

void adamw_step(std::span<const AdamWGroup> groups, const AdamWHyper& h, Stream) {
  const double bc1 = 1.0 - std::pow(double(h.beta1), double(h.step));
  const double bc2 = 1.0 - std::pow(double(h.beta2), double(h.step));
  for (const AdamWGroup& group : groups) {
    AdamWScalars c;
    c.decay = float(1.0 - double(h.lr) * double(group.weight_decay));
    c.one_minus_b1 = float(1.0 - double(h.beta1));
    c.beta2 = h.beta2;
    c.one_minus_b2 = float(1.0 - double(h.beta2));
    c.step_size = float(double(h.lr) / bc1);
    c.bc2_sqrt = float(std::sqrt(bc2));
    c.eps = h.eps;
    c.grad_scale = h.grad_scale;
    float* p = group.master.data_ptr<float>();
    const float* g = group.grad.data_ptr<float>();
    float* m = group.exp_avg.data_ptr<float>();
    float* v = group.exp_avg_sq.data_ptr<float>();
    const Tensor& model = group.model_param;
    parallel_for(group.master.numel(), 1 << 15, [&](int64_t i0, int64_t i1) {
      adamw_chunk(p + i0, g + i0, m + i0, v + i0, i1 - i0, c);
      if (model.defined()) write_model_copy(model.data(), model.dtype(), p, i0, i1);
    });
  }
}

}  // namespace braid::ops::cpu
