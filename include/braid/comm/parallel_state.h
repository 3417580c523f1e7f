#pragma once
// ParallelState: the (tp, cp, dp, pp) rank grid and its communicators, in Megatron's order
// (megatron-core's "tp-cp-ep-dp-pp") — TP fastest, then CP, then DP, then PP:
//
//   rank = tp_rank + tp · (cp_rank + cp · (dp_rank + dp · pp_rank))
//
// so the ranks of one TP group are neighbours (one node), and a PP group strides by tp·cp·dp.
// Megatron's own example, 16 ranks with TP=2, PP=4 (so DP=2):
//   TP groups [0,1] [2,3] ... [14,15]      DP groups [0,2] [1,3] [4,6] ... [13,15]
//   PP groups [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]
// Context parallelism (CP) splits each sequence over its group; the ranks of a CP group read
// the same samples, as TP ranks do, so the data is split over DP alone, while gradients are
// summed over DP×CP (the dp_cp group, Megatron's data-parallel group "with CP"), which is also
// what the distributed optimizer shards over.
// Model-parallel groups hold the TP×PP ranks of one (DP, CP) rank; embedding groups hold the
// first and the last stage of each PP group (one rank when pp = 1).
//
// Expert parallelism (EP, --expert-model-parallel-size) splits the DP×CP ranks of one (TP, PP)
// coordinate again, as megatron-core's expert RankGenerator ("tp-ep-dp-pp", expert TP = TP)
// does: with j = cp_rank + cp · dp_rank (the rank in the dp_cp group),
//
//   ep_rank = j % ep,   expert_dp_rank = j / ep   (expert DP size = dp · cp / ep)
//
// An EP group (ranks that hold different experts and exchange tokens) is ep consecutive j;
// an expert-DP group (ranks that hold the same experts and sum their gradients) strides j by
// ep. Megatron's example, 8 ranks with TP=2, EP=2 (so DP=4, expert DP=2):
//   EP groups [0,2] [4,6] [1,3] [5,7]      expert-DP groups [0,4] [2,6] [1,5] [3,7]
// With cp > 1 an EP group takes the CP ranks first (cp = 2, ep = 2: the EP group is the CP
// pair).
//
// With --expert-tensor-parallel-size 1 under TP (Megatron's "MoE parallel folding"), each TP rank
// routes its own sequence-parallel tokens through whole experts, so the experts split all the
// TP × DP × CP ranks of a stage: with k = tp_rank + tp · j (the rank's place in its stage),
//
//   ep_rank = k % ep,   expert_dp_rank = k / ep   (expert DP size = tp · dp · cp / ep)
//
// TP=2, EP=2, DP=2 on 4 ranks: EP groups [0,1] [2,3], expert-DP groups [0,2] [1,3].
//
// RankGrid is the arithmetic alone (no communication), so layouts are checked, on every rank
// alike and before any collective, from numbers every rank has: a bad layout is the same
// ConfigError everywhere.

#include <initializer_list>
#include <memory>
#include <vector>

#include "braid/comm/communicator.h"

namespace braid::comm {

struct ParallelLayout {
  int tp = 1;   // --tensor-model-parallel-size
  int pp = 1;   // --pipeline-model-parallel-size
  int dp = 0;   // data-parallel size; 0: world size / (tp · cp · pp)
  int cp = 1;   // --context-parallel-size
  int ep = 1;   // --expert-model-parallel-size
  int etp = 0;  // --expert-tensor-parallel-size: 0 or tp (experts split over TP), or 1
};

struct GridCoords {
  int tp_rank = 0;
  int dp_rank = 0;
  int pp_rank = 0;
  int cp_rank = 0;
};

class RankGrid {
 public:
  // ConfigError unless every size is >= 1, tp · cp · pp · dp == world_size, etp is 0 or tp (split
  // experts) or 1 and ep divides dp · cp (tp · dp · cp with etp 1).
  RankGrid(int world_size, const ParallelLayout& layout);

  int world_size() const { return tp_ * cp_ * pp_ * dp_; }
  int tp() const { return tp_; }
  int cp() const { return cp_; }
  int pp() const { return pp_; }
  int dp() const { return dp_; }
  int ep() const { return ep_; }
  int expert_dp() const { return dp_ * cp_ * (whole_experts_ ? tp_ : 1) / ep_; }
  // Expert TP 1 under TP > 1: every rank holds whole experts.
  bool whole_experts() const { return whole_experts_; }

  int rank_of(const GridCoords& c) const {
    return c.tp_rank + tp_ * (c.cp_rank + cp_ * (c.dp_rank + dp_ * c.pp_rank));
  }
  GridCoords coords(int rank) const;
  // The expert grid's coordinates (not in GridCoords: they are a second reading of cp and dp).
  int ep_rank(int rank) const;
  int expert_dp_rank(int rank) const;

  // The members of `rank`'s groups, in group-rank order.
  std::vector<int> tp_group(int rank) const;
  std::vector<int> cp_group(int rank) const;
  std::vector<int> dp_group(int rank) const;
  std::vector<int> dp_cp_group(int rank) const;  // DP × CP, ordered cp fastest
  std::vector<int> pp_group(int rank) const;
  std::vector<int> model_parallel_group(int rank) const;  // TP × PP, ordered tp fastest
  std::vector<int> embedding_group(int rank) const;       // empty if `rank` is in none
  std::vector<int> ep_group(int rank) const;              // ep consecutive expert indices
  std::vector<int> expert_dp_group(int rank) const;       // expert indices strided by ep

 private:
  // The ranks that share `rank`'s coordinates but for those `vary` lists, in rank order.
  std::vector<int> group(int rank, std::initializer_list<int GridCoords::*> vary) const;
  int size_of(int GridCoords::*coord) const;
  // The rank's index in the expert grid (above).
  int expert_index(int rank) const;
  // The ranks of `rank`'s stage (and TP coordinate, unless whole experts) whose expert index is
  // first + stride · i, i < count.
  std::vector<int> expert_group(int rank, int first, int stride, int count) const;

  int tp_, pp_, dp_, cp_, ep_;
  bool whole_experts_;
};

class ParallelState {
 public:
  // Checks the layout against world->size() (ConfigError, no communication), then splits
  // `world` into the groups (collective over `world`). Works for any backend.
  ParallelState(std::shared_ptr<Communicator> world, const ParallelLayout& layout);

  const RankGrid& grid() const { return grid_; }
  int rank() const { return world_->rank(); }
  const GridCoords& coords() const { return coords_; }
  int tp_rank() const { return coords_.tp_rank; }
  int cp_rank() const { return coords_.cp_rank; }
  int dp_rank() const { return coords_.dp_rank; }
  int pp_rank() const { return coords_.pp_rank; }
  int ep_rank() const { return grid_.ep_rank(rank()); }
  int expert_dp_rank() const { return grid_.expert_dp_rank(rank()); }
  bool is_first_stage() const { return coords_.pp_rank == 0; }
  bool is_last_stage() const { return coords_.pp_rank == grid_.pp() - 1; }
  // Neighbouring stages as ranks of the PP group (wrapping around, as Megatron does).
  int next_stage() const { return (coords_.pp_rank + 1) % grid_.pp(); }
  int prev_stage() const { return (coords_.pp_rank + grid_.pp() - 1) % grid_.pp(); }

  Communicator& world() const { return *world_; }
  Communicator& tp() const { return *tp_; }
  Communicator& cp() const { return *cp_; }
  Communicator& dp() const { return *dp_; }
  // The gradients' group: DP × CP (the DP group itself when cp = 1).
  Communicator& dp_cp() const { return *dp_cp_; }
  Communicator& pp() const { return *pp_; }
  // Expert parallelism: the EP group (one rank when ep = 1) and the experts' gradient group
  // (dp_cp itself when ep = 1 and the experts are split over TP).
  Communicator& ep() const { return *ep_; }
  Communicator& expert_dp() const { return *expert_dp_; }
  Communicator& model_parallel() const { return *model_parallel_; }
  // nullptr on ranks that are neither the first nor the last stage.
  Communicator* embedding() const { return embedding_.get(); }

 private:
  std::shared_ptr<Communicator> world_;
  RankGrid grid_;
  GridCoords coords_;
  std::shared_ptr<Communicator> tp_, cp_, dp_, dp_cp_, pp_, model_parallel_, embedding_, ep_,
      expert_dp_;
};

}  // namespace braid::comm
