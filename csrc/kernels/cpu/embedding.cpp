// Token embedding lookup and its gradient on the CPU (vocab-parallel: ids outside this rank's
// slice [vocab_offset, vocab_offset + V_local) read zeros and add nothing).
#include <cstring>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {
void embedding_forward(Tensor out, const Tensor& ids, const Tensor& weight, int64_t vocab_offset,
                       Stream) {
  const int64_t tokens = ids.numel(), v = weight.size(0), c = weight.size(1);
  const int32_t* id = ids.data_ptr<int32_t>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  parallel_for(tokens, std::max<int64_t>(1, 16384 / c), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t row = int64_t(id[t]) - vocab_offset;
      if (row >= 0 && row < v) {
        std::memcpy(o + t * c, w + row * c, size_t(c) * sizeof(float));
      } else {
        std::memset(o + t * c, 0, size_t(c) * sizeof(float));
      }
    }
  });
}

void embedding_backward(Tensor dweight, const Tensor& dout, const Tensor& ids, int64_t vocab_offset,
                        Stream) {
  // Tokens repeat, so threads split the columns, never the tokens: each gradient element is
  // summed token after token by one thread, whatever the thread count.
  const int64_t tokens = ids.numel(), v = dweight.size(0), c = dweight.size(1);
  const int32_t* id = ids.data_ptr<int32_t>();
  const float* g = dout.data_ptr<float>();
  float* dw = dweight.data_ptr<float>();
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (c + kBlock - 1) / kBlock;
  parallel_for(blocks, tokens >= 64 ? 1 : blocks, [&](int64_t b0, int64_t b1) {
    int64_t c0 = b0 * kBlock, width = std::min(c, b1 * kBlock) - c0;
    for (int64_t t = 0; t < tokens; ++t) {
      int64_t row = int64_t(id[t]) - vocab_offset;
      if (row >= 0 && row < v) add_into(dw + row * c + c0, g + t * c + c0, width);
    }
  });
}

}  // namespace braid::ops::cpu
