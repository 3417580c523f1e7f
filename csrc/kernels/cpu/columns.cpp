// Column copies on the CPU (multi-latent attention's [no-rope | rope] heads): a block of columns
// from one [R, C] tensor into another, one [R, W] tensor into the same channels of every head
// of an [R, H, D] tensor, and the sum over heads that is its backward.
#include <algorithm>
#include <cstring>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/loops.h"

namespace braid::ops::cpu {

void copy_columns(Tensor dst, int64_t dst_column, const Tensor& src, int64_t src_column,
                  int64_t width, Stream) {
  const int64_t rows = src.size(0), cd = dst.size(1), cs = src.size(1);
  float* d = dst.data_ptr<float>() + dst_column;
  const float* s = src.data_ptr<float>() + src_column;
  parallel_for(rows, std::max<int64_t>(1, 16384 / width), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(d + r * cd, s + r * cs, size_t(width) * sizeof(float));
    }
  });
}

void broadcast_heads(Tensor out, int64_t column, const Tensor& x, Stream) {
  const int64_t rows = out.size(0), h = out.size(1), d = out.size(2), w = x.size(1);
  float* o = out.data_ptr<float>() + column;
  const float* px = x.data_ptr<float>();
  parallel_for(rows, std::max<int64_t>(1, 16384 / (h * w)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t head = 0; head < h; ++head) {
        std::memcpy(o + (r * h + head) * d, px + r * w, size_t(w) * sizeof(float));
      }
    }
  });
}

void sum_heads(Tensor dx, const Tensor& dout, int64_t column, Stream) {
  const int64_t rows = dout.size(0), h = dout.size(1), d = dout.size(2), w = dx.size(1);
  float* g = dx.data_ptr<float>();
  const float* dy = h > 0 ? dout.data_ptr<float>() + column : nullptr;
  parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(h * w, 1)),
               [&](int64_t r0, int64_t r1) {
                 for (int64_t r = r0; r < r1; ++r) {
                   // Head after head into the f32 row: the order every device sums in.
                   std::fill(g + r * w, g + (r + 1) * w, 0.0f);
                   for (int64_t head = 0; head < h; ++head) {
                     add_into(g + r * w, dy + (r * h + head) * d, w);
                   }
                 }
               });
}

}  // namespace braid::ops::cpu
