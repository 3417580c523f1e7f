#include "braid/model/kv_cache.h"

#include "braid/core/error.h"

namespace braid::model {

KVCache::KVCache(int layers, int64_t batch, int64_t capacity, int64_t kv_heads, int64_t head_dim,
                 DType dtype, Device device)
    : batch_(batch), capacity_(capacity) {
  BRAID_CHECK(layers >= 0 && batch > 0 && capacity > 0 && kv_heads > 0 && head_dim > 0,
              "KVCache: layers ", layers, ", batch ", batch, ", capacity ", capacity, ", kv heads ",
              kv_heads, ", head dim ", head_dim, " must be positive");
  for (int l = 0; l < layers; ++l) {
    keys_.push_back(Tensor::zeros({batch, capacity, kv_heads, head_dim}, dtype, device));
    values_.push_back(Tensor::zeros({batch, capacity, kv_heads, head_dim}, dtype, device));
  }
}

size_t KVCache::check_layer(int layer) const {
  BRAID_CONFIG_CHECK(layer >= 0 && layer < layers(), "KVCache: layer ", layer,
                     " is outside the cache's layers [0, ", layers(), ")");
  return size_t(layer);
}

void KVCache::write(int layer, const Tensor& k, const Tensor& v) {
  const Tensor& keys = keys_[check_layer(layer)];
  const int64_t n = k.size(1), row = keys.size(2) * keys.size(3);
  BRAID_CHECK(k.dim() == 4 && k.size(0) == batch_ && k.size(2) == keys.size(2) &&
                  k.size(3) == keys.size(3) && v.shape() == k.shape(),
              "KVCache::write: k ", k.shape(), " and v ", v.shape(), " do not fit a cache of ",
              keys.shape());
  BRAID_CHECK(length_ + n <= capacity_, "KVCache::write: ", length_, " + ", n,
              " positions exceed the capacity ", capacity_);
  // Position p of sequence b starts at element (b * capacity + p) * row: one contiguous run of
  // n positions per sequence.
  for (int64_t b = 0; b < batch_; ++b) {
    const Shape run{n, keys.size(2), keys.size(3)};
    keys.slice((b * capacity_ + length_) * row, run).copy_from(k.slice(b * n * row, run));
    values_[size_t(layer)]
        .slice((b * capacity_ + length_) * row, run)
        .copy_from(v.slice(b * n * row, run));
  }
}

void KVCache::advance(int64_t n) {
  BRAID_CHECK(n >= 0 && length_ + n <= capacity_, "KVCache::advance: ", length_, " + ", n,
              " positions exceed the capacity ", capacity_);
  length_ += n;
}

}  // namespace braid::model
