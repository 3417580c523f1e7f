#pragma once
// Expert parallelism (Megatron's --expert-model-parallel-size): the ep ranks of an EP group
// (ParallelState::ep, carved out of the data-parallel ranks) hold E / ep experts each - EP rank r
// experts [r·E/ep, (r+1)·E/ep) of every expert layer - and route their own tokens. A layer's routed
// rows (moe.h: [N, H], grouped by expert, so by the rank that holds the expert) travel to those
// ranks in one all-to-all, run through the local experts there, and come back the same way:
//
//   dispatch_rows   [N, C] routed order  ->  all-to-all  ->  [source rank][local expert]
//                   -> gather_rows        ->  [M, C] local-expert order (each source's rows of
//                                             one expert together, sources in rank order)
//   return_rows     the inverse, so each is the other's backward.
//
// Every rank needs to know how many rows it receives, and where each expert's rows start: the
// per-expert counts are all-gathered over the EP group first (one small host collective per
// layer and microbatch, as Megatron's token counts are). Under tensor parallelism every TP rank of
// an EP rank routes the same tokens and exchanges them with the same TP rank of its EP peers -
// unless the experts are whole (expert TP 1, Megatron's --expert-tensor-parallel-size 1, which
// needs sequence parallelism): then each TP rank routes its own sequence-parallel shard of the
// tokens through whole experts, and the EP group spans TP ranks too (parallel_state.h).
//
// The experts' gradients then hold the contributions of every EP rank's tokens: they are summed
// over the expert-data-parallel group (the ranks holding the same experts) rather than the data-
// parallel one (engine/grad_buffer.h).

#include <cstdint>
#include <vector>

#include "braid/comm/communicator.h"
#include "braid/core/tensor.h"
#include "braid/model/moe.h"
#include "braid/model/parameters.h"
#include "braid/model/tensor_parallel.h"

namespace braid::model {

struct ExpertParallel {
  comm::Communicator* group = nullptr;  // the EP group; nullptr: every rank holds every expert
  // Expert TP 1 under TP > 1 with sequence parallelism: the experts are not split over TP, and
  // each TP rank routes its own tokens through them (the router's gradient is then partial, and
  // the experts' are summed over the expert-DP group that ParallelModel gives them).
  bool whole_experts = false;

  int size() const { return group != nullptr ? group->size() : 1; }
  int rank() const { return group != nullptr ? group->rank() : 0; }
  bool active() const { return size() > 1; }
  // `chunk` holding this rank's experts of a model with `num_experts` (whole ones if so).
  ModelChunk holding(ModelChunk chunk, int64_t num_experts) const;
};

// `chunk` holding EP rank `rank` of `size`'s experts, [rank·E/size, (rank + 1)·E/size) of
// `num_experts`; `chunk` itself when size is 1.
ModelChunk holding_experts(ModelChunk chunk, int rank, int size, int64_t num_experts);

// ConfigError unless `ep` ranks can split the model's experts: it has experts and ep divides
// num_experts.
void check_expert_parallel(const TransformerConfig& config, int ep);

// ConfigError for whole experts under TP without sequence parallelism (each TP rank must hold
// its own tokens).
void check_whole_experts(const ExpertParallel& ep, const TensorParallel& tp);

// How one layer's routed rows travel for one microbatch.
struct ExpertDispatch {
  std::vector<int64_t> send;     // [ep] routed rows for each EP rank's experts
  std::vector<int64_t> recv;     // [ep] rows each EP rank sends here
  std::vector<int64_t> offsets;  // [E/ep + 1] the local experts' rows in local-expert order
  // [M] i32: the arrival-order row ([source][local expert]) at each local-expert-order row, and
  // the inverse. Undefined without expert parallelism, where nothing moves.
  Tensor expert_order, arrival_order;
  int64_t rows() const { return offsets.back(); }  // M
};

// The plan for `routing`'s rows (its offsets, over all experts). Collective over the EP group;
// without expert parallelism the local experts are all experts and nothing moves.
ExpertDispatch plan_dispatch(const MoeRouting& routing, const ExpertParallel& ep);

// `rows` [N, C] in routed order -> [M, C] in local-expert order (`rows` itself without EP).
Tensor dispatch_rows(const Tensor& rows, const ExpertDispatch& plan, const ExpertParallel& ep);
// The inverse: `rows` [M, C] in local-expert order -> `out` [N, C] in routed order (nothing
// without EP, where the experts write `out` directly).
void return_rows(Tensor out, const Tensor& rows, const ExpertDispatch& plan,
                 const ExpertParallel& ep);

}  // namespace braid::model
