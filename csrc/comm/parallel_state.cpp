#include "braid/comm/parallel_state.h"

#include <algorithm>
#include <string>

namespace braid::comm {
namespace {

int resolve_dp(int world_size, const ParallelLayout& layout) {
  BRAID_CONFIG_CHECK(world_size >= 1, "parallel layout: the world size must be at least 1, got ",
                     world_size);
  BRAID_CONFIG_CHECK(layout.tp >= 1,
                     "parallel layout: --tensor-model-parallel-size must be at "
                     "least 1, got ",
                     layout.tp);
  BRAID_CONFIG_CHECK(layout.pp >= 1,
                     "parallel layout: --pipeline-model-parallel-size must be at "
                     "least 1, got ",
                     layout.pp);
  BRAID_CONFIG_CHECK(layout.cp >= 1,
                     "parallel layout: --context-parallel-size must be at least 1, got ",
                     layout.cp);
  BRAID_CONFIG_CHECK(layout.ep >= 1,
                     "parallel layout: --expert-model-parallel-size must be at least 1, got ",
                     layout.ep);
  BRAID_CONFIG_CHECK(layout.dp >= 0,
                     "parallel layout: the data-parallel size must be at least 1 "
                     "(or 0: inferred), got ",
                     layout.dp);
  const int64_t model_parallel = int64_t(layout.tp) * layout.cp * layout.pp;
  // Context parallelism is named where it is used.
  const std::string cp_flag =
      layout.cp == 1 ? "" : " × --context-parallel-size (" + std::to_string(layout.cp) + ")";
  const std::string cp_term =
      layout.cp == 1 ? "" : " × context (" + std::to_string(layout.cp) + ")";
  if (layout.dp == 0) {
    BRAID_CONFIG_CHECK(world_size % model_parallel == 0, "parallel layout: world size ", world_size,
                       " is not divisible by --tensor-model-parallel-size (", layout.tp, ")",
                       cp_flag, " × --pipeline-model-parallel-size (", layout.pp,
                       ") = ", model_parallel);
    return int(world_size / model_parallel);
  }
  BRAID_CONFIG_CHECK(model_parallel * layout.dp == world_size, "parallel layout: world size ",
                     world_size, " is not tensor (", layout.tp, ")", cp_term, " × pipeline (",
                     layout.pp, ") × data (", layout.dp,
                     ") parallel = ", model_parallel * layout.dp);
  return layout.dp;
}

// Experts split the DP × CP ranks of one (TP, PP) coordinate, or with expert TP 1 the
// TP × DP × CP ranks of one stage (after dp is resolved).
int checked_ep(const ParallelLayout& layout, int dp) {
  const int etp = layout.etp == 0 ? layout.tp : layout.etp;
  BRAID_CONFIG_CHECK(etp == layout.tp || etp == 1,
                     "parallel layout: --expert-tensor-parallel-size ",
                     "must be 1 or the TP size (", layout.tp, "), got ", layout.etp);
  const int64_t data = int64_t(dp) * layout.cp;
  if (etp == 1 && layout.tp > 1) {
    const int64_t ranks = data * layout.tp;
    BRAID_CONFIG_CHECK(ranks % layout.ep == 0, "parallel layout: --expert-model-parallel-size (",
                       layout.ep, ") must divide tensor (", layout.tp, ") × data (", dp, ")",
                       layout.cp == 1 ? "" : " × context (" + std::to_string(layout.cp) + ")",
                       " parallel = ", ranks,
                       ": with --expert-tensor-parallel-size 1 expert parallelism splits the "
                       "ranks of a pipeline stage");
    return layout.ep;
  }
  const std::string sizes = layout.cp == 1 ? " (" + std::to_string(dp) + ")"
                                           : " × --context-parallel-size (" + std::to_string(dp) +
                                                 " × " + std::to_string(layout.cp) + " = " +
                                                 std::to_string(data) + ")";
  BRAID_CONFIG_CHECK(data % layout.ep == 0, "parallel layout: --expert-model-parallel-size (",
                     layout.ep, ") must divide the data-parallel size", sizes,
                     ": expert parallelism splits the data-parallel ranks");
  return layout.ep;
}

}  // namespace

RankGrid::RankGrid(int world_size, const ParallelLayout& layout)
    : tp_(layout.tp),
      pp_(layout.pp),
      dp_(resolve_dp(world_size, layout)),
      cp_(layout.cp),
      ep_(checked_ep(layout, dp_)),
      whole_experts_(tp_ > 1 && layout.etp == 1) {}

GridCoords RankGrid::coords(int rank) const {
  BRAID_CHECK(rank >= 0 && rank < world_size(), "rank ", rank, " is outside the grid of ",
              world_size(), " ranks");
  GridCoords c;
  c.tp_rank = rank % tp_;
  c.cp_rank = (rank / tp_) % cp_;
  c.dp_rank = (rank / (tp_ * cp_)) % dp_;
  c.pp_rank = rank / (tp_ * cp_ * dp_);
  return c;
}

int RankGrid::size_of(int GridCoords::*coord) const {
  if (coord == &GridCoords::tp_rank) return tp_;
  if (coord == &GridCoords::cp_rank) return cp_;
  if (coord == &GridCoords::dp_rank) return dp_;
  return pp_;
}

std::vector<int> RankGrid::group(int rank, std::initializer_list<int GridCoords::*> vary) const {
  GridCoords c = coords(rank);
  for (int GridCoords::*coord : vary) c.*coord = 0;
  std::vector<int> members{rank_of(c)};
  // Odometer over the varied coordinates, the first fastest: rank order, since the grid's
  // own order puts tp before cp before dp before pp.
  for (int GridCoords::*coord : vary) {
    const size_t before = members.size();
    for (int i = 1; i < size_of(coord); ++i) {
      for (size_t m = 0; m < before; ++m) {
        GridCoords other = coords(members[m]);
        other.*coord = i;
        members.push_back(rank_of(other));
      }
    }
  }
  std::sort(members.begin(), members.end());
  return members;
}

std::vector<int> RankGrid::tp_group(int rank) const { return group(rank, {&GridCoords::tp_rank}); }
std::vector<int> RankGrid::cp_group(int rank) const { return group(rank, {&GridCoords::cp_rank}); }
std::vector<int> RankGrid::dp_group(int rank) const { return group(rank, {&GridCoords::dp_rank}); }
std::vector<int> RankGrid::pp_group(int rank) const { return group(rank, {&GridCoords::pp_rank}); }

std::vector<int> RankGrid::dp_cp_group(int rank) const {
  return group(rank, {&GridCoords::cp_rank, &GridCoords::dp_rank});
}

std::vector<int> RankGrid::model_parallel_group(int rank) const {
  return group(rank, {&GridCoords::tp_rank, &GridCoords::pp_rank});
}

std::vector<int> RankGrid::embedding_group(int rank) const {
  const GridCoords c = coords(rank);
  if (c.pp_rank != 0 && c.pp_rank != pp_ - 1) return {};
  std::vector<int> stages = pp_group(rank);
  if (pp_ == 1) return stages;
  return {stages.front(), stages.back()};
}

// The expert grid reads the index k of a rank among its stage's experts' ranks as ep_rank + ep
// · expert_dp_rank. With the experts split over TP, k is the dp_cp index j = cp_rank + cp ·
// dp_rank (rank = tp_rank + tp · (j + dp · cp · pp_rank)); with whole experts it is the rank's
// place in its stage, tp_rank + tp · j (rank = k + tp · dp · cp · pp_rank). Ranks grow with k.
int RankGrid::expert_index(int rank) const {
  const GridCoords c = coords(rank);
  const int j = c.cp_rank + cp_ * c.dp_rank;
  return whole_experts_ ? c.tp_rank + tp_ * j : j;
}

int RankGrid::ep_rank(int rank) const { return expert_index(rank) % ep_; }

int RankGrid::expert_dp_rank(int rank) const { return expert_index(rank) / ep_; }

std::vector<int> RankGrid::expert_group(int rank, int first, int stride, int count) const {
  const GridCoords c = coords(rank);
  std::vector<int> members;
  for (int i = 0; i < count; ++i) {
    const int k = first + stride * i;
    if (whole_experts_) {
      members.push_back(k + tp_ * cp_ * dp_ * c.pp_rank);
    } else {
      members.push_back(rank_of(
          {.tp_rank = c.tp_rank, .dp_rank = k / cp_, .pp_rank = c.pp_rank, .cp_rank = k % cp_}));
    }
  }
  return members;
}

std::vector<int> RankGrid::ep_group(int rank) const {
  return expert_group(rank, ep_ * expert_dp_rank(rank), 1, ep_);
}

std::vector<int> RankGrid::expert_dp_group(int rank) const {
  return expert_group(rank, ep_rank(rank), ep_, expert_dp());
}

ParallelState::ParallelState(std::shared_ptr<Communicator> world, const ParallelLayout& layout)
    : world_(std::move(world)),
      grid_(world_->size(), layout),
      coords_(grid_.coords(world_->rank())) {
  // A group's colour is its first member, the same on every member; the world rank as key
  // orders the members as RankGrid lists them (rank order).
  const int me = world_->rank();
  auto split = [&](const std::vector<int>& members, const char* name) {
    return world_->split(members.front(), me, name);
  };
  tp_ = split(grid_.tp_group(me), "tp");
  cp_ = split(grid_.cp_group(me), "cp");
  dp_ = split(grid_.dp_group(me), "dp");
  dp_cp_ = grid_.cp() == 1 ? dp_ : split(grid_.dp_cp_group(me), "dp_cp");
  pp_ = split(grid_.pp_group(me), "pp");
  model_parallel_ = split(grid_.model_parallel_group(me), "model_parallel");
  const std::vector<int> embedding = grid_.embedding_group(me);
  embedding_ = world_->split(embedding.empty() ? -1 : embedding.front(), me, "embedding");
  if (grid_.ep() == 1 && !grid_.whole_experts()) {
    ep_ = world_->split(me, me, "ep");  // every rank its own group
    expert_dp_ = dp_cp_;
  } else {
    ep_ = split(grid_.ep_group(me), "ep");
    expert_dp_ = split(grid_.expert_dp_group(me), "expert_dp");
  }
}

}  // namespace braid::comm
