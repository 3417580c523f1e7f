#pragma once
// KVCache: the keys and values of the positions a model has already seen, per layer, so that
// decoding a token runs the new position alone instead of the whole sequence (inference only).
//
// Each layer holds keys and values [batch, capacity, kv_heads, head_dim] in the activation dtype
// on the model's device; positions [0, length()) are filled. Keys are stored after rope, as the
// attention reads them. GPTModel::kv_cache makes one for a model and GPTModel::decode fills it.

#include <cstdint>
#include <vector>

#include "braid/core/tensor.h"

namespace braid::model {

class KVCache {
 public:
  KVCache() = default;
  KVCache(int layers, int64_t batch, int64_t capacity, int64_t kv_heads, int64_t head_dim,
          DType dtype, Device device);

  int layers() const { return int(keys_.size()); }
  int64_t batch() const { return batch_; }
  int64_t capacity() const { return capacity_; }
  int64_t length() const { return length_; }  // positions filled, in every layer
  // Layer `layer`'s buffers; a layer outside [0, layers()) is a ConfigError naming the range.
  const Tensor& keys(int layer) const { return keys_[check_layer(layer)]; }
  const Tensor& values(int layer) const { return values_[check_layer(layer)]; }

  // Writes k, v [batch, n, kv_heads, head_dim] at positions [length(), length() + n) of `layer`
  // (the caller checked that they fit); length() moves on at advance().
  void write(int layer, const Tensor& k, const Tensor& v);
  // length() += n once every layer has written its n positions.
  void advance(int64_t n);
  // Forgets every position (the buffers stay allocated): the cache takes a new batch.
  void reset() { length_ = 0; }

 private:
  size_t check_layer(int layer) const;

  int64_t batch_ = 0, capacity_ = 0, length_ = 0;
  std::vector<Tensor> keys_, values_;
};

}  // namespace braid::model
