// RoPE's frequencies (ops.h): plain, or with Llama 3.1's or YaRN's scaling, in HF's f32
// arithmetic.
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
  BRAID_CHECK(attention_factor > 0.0f && std::isfinite(attention_factor),
              "rope: attention_factor = ", attention_factor, " must be positive and finite");
  BRAID_CHECK((llama3_factor != 0.0f) + (yarn_factor != 0.0f) + (linear_factor != 0.0f) <= 1,
              "rope: the llama3 factor (", llama3_factor, "), the YaRN factor (", yarn_factor,
              ") and the linear factor (", linear_factor, ") exclude each other");
  BRAID_CHECK(linear_factor >= 0.0f && std::isfinite(linear_factor), "rope: the linear factor ",
              linear_factor, " must be positive and finite (0: no interpolation)");
  if (yarn_factor != 0.0f) {  // HF's _validate_yarn_rope_parameters, as errors
    BRAID_CHECK(yarn_factor >= 1.0f && std::isfinite(yarn_factor), "rope: the YaRN factor ",
                yarn_factor, " must be >= 1 and finite (0: no YaRN)");
    BRAID_CHECK(
        0.0f < yarn_beta_slow && yarn_beta_slow <= yarn_beta_fast && std::isfinite(yarn_beta_fast),
        "rope: YaRN needs 0 < yarn_beta_slow (", yarn_beta_slow, ") <= yarn_beta_fast (",
        yarn_beta_fast, ")");
    BRAID_CHECK(original_max_positions > 0.0f && std::isfinite(original_max_positions),
                "rope: original_max_positions = ", original_max_positions, " must be positive");
  }
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

namespace {

// HF's _compute_yarn_parameters, operation for operation: the correction range in double
// (Python's math), the rest in f32 (torch's). `freq` holds the plain frequencies 1 / pos_freqs.
void apply_yarn(std::vector<float>& freq, const RotaryFrequencies& r, int64_t dim) {
  const double pi = std::numbers::pi;
  auto correction_dim = [&](double rotations) {
    return double(dim) * std::log(double(r.original_max_positions) / (rotations * 2.0 * pi)) /
           (2.0 * std::log(double(r.theta)));
  };
  // HF's find_correction_range: rounded outwards to whole pairs unless truncate is false.
  double low = correction_dim(r.yarn_beta_fast), high = correction_dim(r.yarn_beta_slow);
  if (r.yarn_truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, double(dim - 1));
  if (low == high) high += 0.001;  // HF's guard against a zero-width ramp
  const auto low_f = float(low), width = float(high - low);
  for (size_t i = 0; i < freq.size(); ++i) {
    const float pos_freq = std::pow(r.theta, float(2 * int64_t(i)) / float(dim));
    const float extrapolation = 1.0f / pos_freq;
    const float interpolation = 1.0f / (r.yarn_factor * pos_freq);
    const float ramp = std::clamp((float(i) - low_f) / width, 0.0f, 1.0f);
    const float kept = 1.0f - ramp;  // HF's inv_freq_extrapolation_factor
    freq[i] = interpolation * (1.0f - kept) + extrapolation * kept;
  }
}

}  // namespace

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
  if (yarn_factor > 0.0f) apply_yarn(out, *this, dim);
  if (linear_factor > 0.0f) {  // HF's _compute_linear_scaling_rope_parameters: inv_freq / factor
    for (float& f : out) f /= linear_factor;
  }
  return out;
}

}  // namespace braid::ops
