#pragma once
// A checkpoint's layout and tensor index (metadata.json, docs/checkpoints.md): the layout a
// save comes from, the file each (tp, pp, ep) position writes, the slices it stores, and the
// metadata that indexes them - built from the saving layout alone, so every rank agrees.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "braid/engine/checkpoint.h"
#include "braid/engine/parallel_model.h"
#include "braid/model/parameters.h"

namespace braid::engine {

struct SavedLayout {
  int tp = 1, pp = 1, dp = 1, cp = 1, ep = 1, virtual_stages = 1;
  bool whole_experts = false;  // expert TP 1 under TP > 1
  std::optional<int> first_stage_layers, last_stage_layers;
  std::vector<int> model_chunk_layers;
  bool distributed_optimizer = false;
};

SavedLayout layout_of(const ParallelModel& model);

// Megatron's names: mp_rank_TT_PPP per (tp, pp) position, and under expert parallelism
// (ep > 1) mp_rank_TT_PPP_EEE per (tp, pp, ep) position.
std::string file_name(int tp_rank, int pp_rank, int ep_rank, int ep);

// One parameter's slice that a (tp, pp) position stores: the valid rows (tp_dim 0) or columns
// (tp_dim 1) [start, start + length) of its TP shard; the whole tensor when replicated.
struct Slice {
  size_t param;  // index in the chunk's layout
  int tp_dim;
  int64_t start;
  int64_t length;
};

// The slices this TP rank's chunk stores: not the last stage's copy of tied embeddings, not a
// kv head another TP rank stores already, nothing for an all-padding vocabulary slice.
std::vector<Slice> stored_slices(const model::ParamLayout& layout);

// The metadata.json of a save: everything but the tensors' bytes, and the tensor index (every
// (tp, pp, ep) position's stored slices: the experts in the file of the EP rank that holds them,
// the rest in EP rank 0's).
nlohmann::json checkpoint_metadata(Trainer& trainer, const LoopState& loop,
                                   const SaveOptions& options);

}  // namespace braid::engine
