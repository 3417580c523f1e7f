#pragma once
// PipelineExecutor: runs one rank's action list of a Schedule (schedule.h) over its model
// chunks, moving activations forward and their gradients back through the pipeline group.
//
// Chunk c of this rank is model chunk c·pp + rank (Megatron's interleaving); a chunk holds the
// embedding when it is model chunk 0 and the head when it is the last one. Received tensors
// have shapes known ahead ([tokens of the region, hidden], the model's dtype): no shape
// handshake. The sends and receives of one exchange are posted together and waited on
// together, so neighbours exchanging in both directions cannot deadlock; every wait has the
// communicator's deadline.

#include <span>
#include <vector>

#include "braid/comm/communicator.h"
#include "braid/core/trace.h"
#include "braid/engine/schedule.h"
#include "braid/model/gpt_model.h"

namespace braid::engine {

class PipelineExecutor {
 public:
  // `chunks[c]` is this rank's chunk c; `pp` the pipeline group (its rank is the stage).
  PipelineExecutor(Schedule schedule, std::vector<model::GPTModel*> chunks, comm::Communicator& pp);

  // One step's forwards and backwards: ids[m], targets[m] are microbatch m ([B, S] i32, the
  // same on every stage). Microbatch m's loss (its mean over non-ignored targets) is scaled by
  // grad_scales[m] in backward: 1/M each for the mean over M microbatches, or m's share of the
  // batch's tokens for the mean over tokens. Returns sum_m grad_scales[m] · loss_m - the
  // scalar whose gradient the chunks accumulate - on the stage that holds the head, 0 on the
  // others. Call each chunk's finalize_grads() afterwards. first_samples[m]: microbatch m's
  // first sequence's run-wide index, its dropout masks' key (GPTModel::forward_stage); empty:
  // each chunk's own count.
  float run(std::span<const Tensor> ids, std::span<const Tensor> targets,
            std::span<const float> grad_scales, std::span<const int64_t> first_samples = {});

  const Schedule& schedule() const { return schedule_; }

  // Records every action of run() on `trace` (null: none, the default, costs one branch per
  // action): forward/backward spans (microbatch, chunk) on lane "compute"; for an exchange the
  // posting as "send", "recv" or "exchange" (both kinds) with its ops, then its "wait", on
  // lane "p2p"; and, as the thread's current trace during run(), every communication wait on
  // its group's lane "comm:<group>" (core/trace.h). The trace must outlive the runs it records.
  void set_trace(Trace* trace) { trace_ = trace; }
  Trace* trace() const { return trace_; }

 private:
  Schedule schedule_;
  std::vector<model::GPTModel*> chunks_;
  comm::Communicator& pp_;
  Trace* trace_ = nullptr;
};

}  // namespace braid::engine
