#include "braid/model/tensor_parallel.h"

namespace braid::model {
namespace {

Tensor gather_tokens(const TensorParallel& tp, const Tensor& shard) {
  Tensor full = Tensor::empty({shard.size(0) * tp.size(), shard.numel() / shard.size(0)},
                              shard.dtype(), shard.device());
  tp.group->all_gather(shard, full)->wait();
  return full;
}

Tensor scatter_tokens(const TensorParallel& tp, const Tensor& full) {
  BRAID_CHECK(full.size(0) % tp.size() == 0, "sequence parallelism: ", full.size(0),
              " tokens do not split over ", tp.size(), " ranks");
  Tensor shard = Tensor::empty({full.size(0) / tp.size(), full.numel() / full.size(0)},
                               full.dtype(), full.device());
  tp.group->reduce_scatter(full, shard)->wait();
  return shard;
}

Tensor reduced(const TensorParallel& tp, const Tensor& x) {
  tp.group->all_reduce(x)->wait();
  return x;
}

}  // namespace

Tensor enter_tp_forward(const TensorParallel& tp, const Tensor& x) {
  return tp.sharded_tokens() ? gather_tokens(tp, x) : x;
}

Tensor enter_tp_backward(const TensorParallel& tp, const Tensor& dx_partial) {
  if (!tp.active()) return dx_partial;
  return tp.sequence_parallel ? scatter_tokens(tp, dx_partial) : reduced(tp, dx_partial);
}

Tensor exit_tp_forward(const TensorParallel& tp, const Tensor& y_partial) {
  if (!tp.active()) return y_partial;
  return tp.sequence_parallel ? scatter_tokens(tp, y_partial) : reduced(tp, y_partial);
}

Tensor exit_tp_backward(const TensorParallel& tp, const Tensor& dy) {
  return tp.sharded_tokens() ? gather_tokens(tp, dy) : dy;
}

void all_reduce_tp(const TensorParallel& tp, Tensor t) {
  if (tp.active()) tp.group->all_reduce(t)->wait();
}

}  // namespace braid::model
