// Rotary position embedding on the CPU, on channels [F, F + R) of each head (F = first_channel,
// R = 2 x the frequencies): as HF Llama computes it (rotate_half: channel F + i pairs with
// F + i + R/2), or interleaved (GPT-J, DeepSeek: F + 2i pairs with F + 2i + 1); either pair turns
// by angle pos * inv_freq[i], cos and sin times attention_factor (YaRN's). The other channels pass
// through (partial rotary, MLA's no-rope channels).
#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "braid/core/error.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {
namespace {

// out = x rotated by +angle (sign = 1) or -angle (sign = -1); the table holds cos and sin of
// the angles of one position: cos_sin[i], cos_sin[half + i].
BRAID_CPU_MULTIVERSION void rotate_head(float* out, const float* x, const float* cos_sin,
                                        int64_t half, float sign) {
  const float* cs = cos_sin;
  const float* sn = cos_sin + half;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    float x1 = x[i], x2 = x[i + half], s = sign * sn[i];
    out[i] = x1 * cs[i] - x2 * s;
    out[i + half] = x2 * cs[i] + x1 * s;
  }
}

// The same turn on interleaved pairs (2i, 2i + 1).
BRAID_CPU_MULTIVERSION void rotate_pairs(float* out, const float* x, const float* cos_sin,
                                         int64_t half, float sign) {
  const float* cs = cos_sin;
  const float* sn = cos_sin + half;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    float x1 = x[2 * i], x2 = x[2 * i + 1], s = sign * sn[i];
    out[2 * i] = x1 * cs[i] - x2 * s;
    out[2 * i + 1] = x2 * cs[i] + x1 * s;
  }
}

// Table [P, 2 * half] of positions position_offset .. position_offset + P - 1. Follows HF's
// float32 arithmetic: angle = float(pos) * inv_freq in f32; cos and sin of that f32 angle,
// correctly rounded, times attention_factor in f32 (exact at 1).
std::vector<float> cos_sin_table(int64_t p_len, std::span<const float> inv_freq,
                                 int64_t position_offset, float attention_factor) {
  const auto half = int64_t(inv_freq.size());
  std::vector<float> table(static_cast<size_t>(p_len * 2 * half));
  for (int64_t s = 0; s < p_len; ++s) {
    for (int64_t i = 0; i < half; ++i) {
      float angle = float(position_offset + s) * inv_freq[size_t(i)];
      table[size_t(s * 2 * half + i)] = float(std::cos(double(angle))) * attention_factor;
      table[size_t(s * 2 * half + half + i)] = float(std::sin(double(angle))) * attention_factor;
    }
  }
  return table;
}

void rope(Tensor out, const Tensor& x, std::span<const float> inv_freq, int64_t first,
          bool interleaved, int64_t position_offset, const Tensor& positions,
          float attention_factor, float sign) {
  const int64_t b = x.size(0), s_len = x.size(1), h = x.size(2), d = x.size(3);
  const auto half = int64_t(inv_freq.size());
  const int64_t end = first + 2 * half;  // channels [first, end) turn
  // Row r's position (past position_offset): its own with `positions`, else r's place in its
  // sequence.
  const int32_t* own = positions.defined() ? positions.data_ptr<int32_t>() : nullptr;
  int64_t p_len = s_len;
  if (own != nullptr) {
    p_len = 0;
    for (int64_t r = 0; r < b * s_len; ++r) {
      BRAID_CHECK(own[r] >= 0, "rope: positions[", r / s_len, "][", r % s_len, "] = ", own[r],
                  " must not be negative");
      p_len = std::max<int64_t>(p_len, int64_t(own[r]) + 1);
    }
  }
  std::vector<float> table = cos_sin_table(p_len, inv_freq, position_offset, attention_factor);
  float* o = out.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  parallel_for(b * s_len, std::max<int64_t>(1, 8192 / std::max<int64_t>(h * d, 1)),
               [&](int64_t r0, int64_t r1) {
                 for (int64_t r = r0; r < r1; ++r) {
                   const int64_t position = own != nullptr ? own[r] : r % s_len;
                   const float* cs = table.data() + position * 2 * half;
                   for (int64_t head = 0; head < h; ++head) {
                     int64_t at = (r * h + head) * d;
                     if (interleaved) {
                       rotate_pairs(o + at + first, px + at + first, cs, half, sign);
                     } else {
                       rotate_head(o + at + first, px + at + first, cs, half, sign);
                     }
                     if (o != px) {
                       std::copy(px + at, px + at + first, o + at);
                       std::copy(px + at + end, px + at + d, o + at + end);
                     }
                   }
                 }
               });
}

}  // namespace

void rope_forward(Tensor out, const Tensor& x, std::span<const float> inv_freq,
                  int64_t first_channel, bool interleaved, int64_t position_offset,
                  const Tensor& positions, float attention_factor, Stream) {
  rope(out, x, inv_freq, first_channel, interleaved, position_offset, positions, attention_factor,
       1.0f);
}

void rope_backward(Tensor dx, const Tensor& dout, std::span<const float> inv_freq,
                   int64_t first_channel, bool interleaved, int64_t position_offset,
                   const Tensor& positions, float attention_factor, Stream) {
  // The rotation is orthogonal: its transpose turns by the opposite angle (the factor stays).
  rope(dx, dout, inv_freq, first_channel, interleaved, position_offset, positions, attention_factor,
       -1.0f);
}

}  // namespace braid::ops::cpu
