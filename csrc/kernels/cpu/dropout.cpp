// Inverted dropout on the CPU. The mask is a pure function of (seed, offset, element index),
// drawn exactly as ops.h specifies, so backward (and the CUDA kernel) redraw the same one.
#include <algorithm>

#include "braid/core/philox.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {
namespace {

// Element i keeps iff uniform_from_word(word i % 4 of random_words(seed, offset, i / 4)) > p;
// kept elements are multiplied by 1 / (1 - p), dropped ones are 0.
inline float dropout_element(float x, uint32_t word, float p, float scale) {
  return philox::uniform_from_word(word) > p ? x * scale : 0.0f;
}

// Groups [g0, g1) of four elements; the caller handles a partial last group.
BRAID_CPU_MULTIVERSION void dropout_groups(float* out, const float* x, float p, float scale,
                                           uint64_t seed, uint64_t offset, uint64_t first_group,
                                           int64_t g0, int64_t g1) {
#pragma omp simd
  for (int64_t g = g0; g < g1; ++g) {
    philox::Words4 w = philox::random_words(seed, offset, first_group + uint64_t(g));
    for (int l = 0; l < 4; ++l) out[4 * g + l] = dropout_element(x[4 * g + l], w.x[l], p, scale);
  }
}

// Element i is element first_element + i of the larger tensor: a partial first group (the
// elements before the next multiple of 4), then whole groups.
void dropout(float* out, const float* x, int64_t n, float p, uint64_t seed, uint64_t offset,
             int64_t first_element) {
  const float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  const int lead = int(first_element % 4);
  uint64_t first_group = uint64_t(first_element / 4);
  if (lead != 0) {
    const philox::Words4 w = philox::random_words(seed, offset, first_group);
    const int64_t head = std::min<int64_t>(n, 4 - lead);
    for (int64_t i = 0; i < head; ++i) out[i] = dropout_element(x[i], w.x[lead + i], p, scale);
    out += head;
    x += head;
    n -= head;
    ++first_group;
  }
  const int64_t full_groups = n / 4;
  parallel_for(full_groups, 4096, [&](int64_t g0, int64_t g1) {
    dropout_groups(out, x, p, scale, seed, offset, first_group, g0, g1);
  });
  if (n % 4 != 0) {
    philox::Words4 w = philox::random_words(seed, offset, first_group + uint64_t(full_groups));
    for (int64_t i = full_groups * 4; i < n; ++i) {
      out[i] = dropout_element(x[i], w.x[i % 4], p, scale);
    }
  }
}

}  // namespace

void dropout_forward(Tensor out, const Tensor& x, float p, uint64_t seed, uint64_t offset,
                     int64_t first_element, Stream) {
  dropout(out.data_ptr<float>(), x.data_ptr<float>(), out.numel(), p, seed, offset, first_element);
}

void dropout_backward(Tensor dx, const Tensor& dout, float p, uint64_t seed, uint64_t offset,
                      int64_t first_element, Stream) {
  // d out / d x is the same mask and scale.
  dropout(dx.data_ptr<float>(), dout.data_ptr<float>(), dx.numel(), p, seed, offset, first_element);
}

}  // namespace braid::ops::cpu
