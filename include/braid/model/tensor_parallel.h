#pragma once
// Tensor parallelism as Megatron-LM does it, on activations of T tokens (the flattened
// [B, S]) by H features:
//
//   region        forward              backward
//   enter (f)     identity             all-reduce          before a column-parallel layer
//   exit  (g)     all-reduce           identity            after a row-parallel layer
//
// With sequence parallelism the regions between TP blocks (norms, dropout, residual adds) hold
// T/tp tokens each, and the operators become
//   enter (f)     all-gather tokens    reduce-scatter tokens
//   exit  (g)     reduce-scatter       all-gather
// moving the same bytes as the all-reduces they replace, in two halves. Rank r holds tokens
// [r·T/tp, (r+1)·T/tp) of the flattened [B, S] (Megatron's split along s of [s, b, h]).
// Every operator returns its input untouched when the group has one rank.

#include "braid/comm/communicator.h"
#include "braid/core/tensor.h"

namespace braid::model {

struct TensorParallel {
  comm::Communicator* group = nullptr;  // the TP group; nullptr: no tensor parallelism
  bool sequence_parallel = false;

  int size() const { return group != nullptr ? group->size() : 1; }
  int rank() const { return group != nullptr ? group->rank() : 0; }
  bool active() const { return size() > 1; }
  bool sharded_tokens() const { return sequence_parallel && active(); }
};

// x: [T_region, ...] where T_region is T/tp with sequence parallelism, else T.
Tensor enter_tp_forward(const TensorParallel& tp, const Tensor& x);
Tensor enter_tp_backward(const TensorParallel& tp, const Tensor& dx_partial);
Tensor exit_tp_forward(const TensorParallel& tp, const Tensor& y_partial);
Tensor exit_tp_backward(const TensorParallel& tp, const Tensor& dy);

// Sums `t` over the TP group in place (gradients of parameters the group replicates).
void all_reduce_tp(const TensorParallel& tp, Tensor t);

}  // namespace braid::model
