#pragma once
// Attention dropout's mask (ops.h, AttentionDropout), one definition for the CPU and CUDA
// kernels: the multiplier of each softmax probability, from its query and key positions.
#include "braid/core/philox.h"
#include "braid/kernels/ops.h"

namespace braid::ops::detail {

// The mask of one (sequence, head) of an attention call.
struct HeadDropout {
  float p, scale;  // scale: 1 / (1 - p), the multiplier of a kept probability
  uint64_t seed, stream;
  int64_t first_position;  // the global position of the call's key row 0

  // Sequence b (batch row), query head h of the call.
  BRAID_HOST_DEVICE static HeadDropout of(const AttentionDropout& d, int64_t b, int64_t h) {
    return {d.p, 1.0f / (1.0f - d.p), d.seed,
            philox::substream(d.stream, uint64_t(d.first_sequence + b), uint64_t(d.first_head + h)),
            d.first_position};
  }
  // The four random words of keys 4g .. 4g + 3 (global positions) for the query at global
  // position qp.
  BRAID_HOST_DEVICE philox::Words4 words(int64_t qp, int64_t g) const {
    return philox::random_words(seed, stream, (uint64_t(qp) << 32) | uint64_t(g));
  }
  BRAID_HOST_DEVICE float multiplier(uint32_t word) const {
    return philox::uniform_from_word(word) > p ? scale : 0.0f;
  }
  // The multiplier of query row i's probability of key row j, with `offset` = Sk - Sq (the
  // call's rows, not global positions).
  BRAID_HOST_DEVICE float at(int64_t offset, int64_t i, int64_t j) const {
    const int64_t kp = first_position + j;
    return multiplier(words(first_position + offset + i, kp >> 2).x[kp & 3]);
  }
};

}  // namespace braid::ops::detail
