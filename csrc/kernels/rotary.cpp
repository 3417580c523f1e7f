// RoPE's frequencies (ops.h): plain, or with Llama 3.1's scaling, in HF's f32 arithmetic.
#include <algorithm>
#include <cmath>
#include <numbers>

#include "braid/core/error.h"
#include "braid/kernels/ops.h"

namespace braid::ops {

void RotaryFrequencies::validate() const {
  BRAID_CHECK(theta > 0.0f && std::isfinite(theta), "rope: theta = ", theta,
              " must be positive and finite");
  BRAID_CHECK(rotary_dim >= 0 && rotary_dim % 2 == 0, "rope: rotary_dim = ", rotary_dim,
              " must be even (0: the whole head)");
  BRAID_CHECK(first_channel >= 0, "rope: first_channel = ", first_channel, " must not be negative");
  if (llama3_factor == 0.0f) return;
  BRAID_CHECK(llama3_factor > 0.0f && std::isfinite(llama3_factor), "rope: the llama3 factor ",
              llama3_factor, " must be positive (0: no scaling)");
  BRAID_CHECK(0.0f < low_freq_factor && low_freq_factor < high_freq_factor &&
                  std::isfinite(high_freq_factor),
              "rope: llama3 scaling needs 0 < low_freq_factor (", low_freq_factor,
              ") < high_freq_factor (", high_freq_factor, ")");
  BRAID_CHECK(original_max_positions > 0.0f,
              "rope: original_max_positions = ", original_max_positions, " must be positive");
}

int64_t RotaryFrequencies::rotated_channels(int64_t head_dim) const {
  return rotary_dim > 0 ? rotary_dim : head_dim - first_channel;
}

std::vector<float> RotaryFrequencies::inv_freq(int64_t head_dim) const {
  BRAID_CHECK(first_channel <= head_dim && rotary_dim <= head_dim - first_channel,
              "rope: channels from first_channel = ", first_channel, " (rotary_dim = ", rotary_dim,
              ") exceed the head's ", head_dim, " channels");
  const int64_t dim = rotated_channels(head_dim);
  const int64_t half = dim / 2;
  std::vector<float> out(size_t(std::max<int64_t>(half, 0)));
  for (int64_t i = 0; i < half; ++i) {
    float f = 1.0f / std::pow(theta, float(2 * i) / float(dim));
    if (llama3_factor > 0.0f) {  // HF's _compute_llama3_parameters, operation for operation
      const float wavelen = 2.0f * float(std::numbers::pi) / f;
      if (wavelen > original_max_positions / low_freq_factor) {
        f = f / llama3_factor;
      } else if (!(wavelen < original_max_positions / high_freq_factor)) {
        const float smooth = (original_max_positions / wavelen - low_freq_factor) /
                             (high_freq_factor - low_freq_factor);
        f = (1.0f - smooth) * f / llama3_factor + smooth * f;
      }
    }
    out[size_t(i)] = f;
  }
  return out;
}

}  // namespace braid::ops
