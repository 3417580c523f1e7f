#include "braid/comm/parallel_state.h"

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
  BRAID_CONFIG_CHECK(layout.dp >= 0,
                     "parallel layout: the data-parallel size must be at least 1 "
                     "(or 0: inferred), got ",
                     layout.dp);
  const int64_t model_parallel = int64_t(layout.tp) * layout.pp;
  if (layout.dp == 0) {
    BRAID_CONFIG_CHECK(world_size % model_parallel == 0, "parallel layout: world size ", world_size,
                       " is not divisible by --tensor-model-parallel-size (", layout.tp,
                       ") × --pipeline-model-parallel-size (", layout.pp, ") = ", model_parallel);
    return int(world_size / model_parallel);
  }
  BRAID_CONFIG_CHECK(model_parallel * layout.dp == world_size, "parallel layout: world size ",
                     world_size, " is not tensor (", layout.tp, ") × pipeline (", layout.pp,
                     ") × data (", layout.dp, ") parallel = ", model_parallel * layout.dp);
  return layout.dp;
}

}  // namespace

RankGrid::RankGrid(int world_size, const ParallelLayout& layout)
    : tp_(layout.tp), pp_(layout.pp), dp_(resolve_dp(world_size, layout)) {}

GridCoords RankGrid::coords(int rank) const {
  BRAID_CHECK(rank >= 0 && rank < world_size(), "rank ", rank, " is outside the grid of ",
              world_size(), " ranks");
  return GridCoords{rank % tp_, (rank / tp_) % dp_, rank / (tp_ * dp_)};
}

std::vector<int> RankGrid::tp_group(int rank) const {
  GridCoords c = coords(rank);
  std::vector<int> group;
  for (c.tp_rank = 0; c.tp_rank < tp_; ++c.tp_rank) group.push_back(rank_of(c));
  return group;
}

std::vector<int> RankGrid::dp_group(int rank) const {
  GridCoords c = coords(rank);
  std::vector<int> group;
  for (c.dp_rank = 0; c.dp_rank < dp_; ++c.dp_rank) group.push_back(rank_of(c));
  return group;
}

std::vector<int> RankGrid::pp_group(int rank) const {
  GridCoords c = coords(rank);
  std::vector<int> group;
  for (c.pp_rank = 0; c.pp_rank < pp_; ++c.pp_rank) group.push_back(rank_of(c));
  return group;
}

std::vector<int> RankGrid::model_parallel_group(int rank) const {
  GridCoords c = coords(rank);
  std::vector<int> group;
  for (c.pp_rank = 0; c.pp_rank < pp_; ++c.pp_rank)
    for (c.tp_rank = 0; c.tp_rank < tp_; ++c.tp_rank) group.push_back(rank_of(c));
  return group;
}

std::vector<int> RankGrid::embedding_group(int rank) const {
  const GridCoords c = coords(rank);
  if (c.pp_rank != 0 && c.pp_rank != pp_ - 1) return {};
  std::vector<int> stages = pp_group(rank);
  if (pp_ == 1) return stages;
  return {stages.front(), stages.back()};
}

ParallelState::ParallelState(std::shared_ptr<Communicator> world, const ParallelLayout& layout)
    : world_(std::move(world)),
      grid_(world_->size(), layout),
      coords_(grid_.coords(world_->rank())) {
  // Every member of a group computes the same colour; keys order the members as the group lists.
  const GridCoords& c = coords_;
  const int tp = grid_.tp(), dp = grid_.dp();
  tp_ = world_->split(c.dp_rank + dp * c.pp_rank, c.tp_rank, "tp");
  dp_ = world_->split(c.tp_rank + tp * c.pp_rank, c.dp_rank, "dp");
  pp_ = world_->split(c.tp_rank + tp * c.dp_rank, c.pp_rank, "pp");
  model_parallel_ = world_->split(c.dp_rank, c.tp_rank + tp * c.pp_rank, "model_parallel");
  const bool embeds = is_first_stage() || is_last_stage();
  embedding_ = world_->split(embeds ? c.tp_rank + tp * c.dp_rank : -1, c.pp_rank, "embedding");
}

}  // namespace braid::comm
