// RankGrid: Megatron's rank order and its layout checks, without processes.

#include <gtest/gtest.h>

#include <set>

#include "braid/comm/parallel_state.h"

using braid::ConfigError;
using braid::comm::GridCoords;
using braid::comm::ParallelLayout;
using braid::comm::RankGrid;
using Groups = std::vector<std::vector<int>>;

namespace {

// Every distinct group of one kind, in order of first member.
template <typename GroupOf>
Groups all_groups(const RankGrid& grid, GroupOf group_of) {
  std::set<std::vector<int>> seen;
  Groups groups;
  for (int r = 0; r < grid.world_size(); ++r) {
    std::vector<int> g = group_of(r);
    if (!g.empty() && seen.insert(g).second) groups.push_back(g);
  }
  return groups;
}

std::string layout_error(int world, ParallelLayout layout) {
  try {
    RankGrid grid(world, layout);
  } catch (const ConfigError& e) {
    return e.message();
  }
  return "";
}

}  // namespace

// The example in Megatron-LM's parallel_state.initialize_model_parallel docstring.
TEST(RankGrid, MegatronDocumentedExample) {
  RankGrid grid(16, {.tp = 2, .pp = 4});
  EXPECT_EQ(grid.dp(), 2);
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.tp_group(r); }),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.dp_group(r); }),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.pp_group(r); }),
            (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.model_parallel_group(r); }),
            (Groups{{0, 1, 4, 5, 8, 9, 12, 13}, {2, 3, 6, 7, 10, 11, 14, 15}}));
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.embedding_group(r); }),
            (Groups{{0, 12}, {1, 13}, {2, 14}, {3, 15}}));
  EXPECT_TRUE(grid.embedding_group(5).empty());
}

// megatron-core's order "tp-cp-ep-dp-pp" (RankGenerator) for 16 ranks, TP=2, CP=2, PP=2 (so
// DP=2): CP strides by tp, DP by tp·cp, PP by tp·cp·dp; the gradients' DP×CP group holds the
// CP and DP ranks of one (TP, PP) coordinate.
TEST(RankGrid, ContextParallelGroupsInMegatronsOrder) {
  RankGrid grid(16, {.tp = 2, .pp = 2, .cp = 2});
  EXPECT_EQ(grid.dp(), 2);
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.tp_group(r); }),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.cp_group(r); }),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.dp_group(r); }),
            (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.dp_cp_group(r); }),
            (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.pp_group(r); }),
            (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.model_parallel_group(r); }),
            (Groups{{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}}));
  const GridCoords c = grid.coords(13);  // 13 = 1 + 2 (0 + 2 (1 + 2 · 1))
  EXPECT_EQ(c.tp_rank, 1);
  EXPECT_EQ(c.cp_rank, 0);
  EXPECT_EQ(c.dp_rank, 1);
  EXPECT_EQ(c.pp_rank, 1);
  EXPECT_NE(layout_error(12, {.tp = 2, .pp = 2, .cp = 2}).find("--context-parallel-size"),
            std::string::npos);
  EXPECT_NE(layout_error(8, {.tp = 2, .cp = 0}).find("--context-parallel-size"), std::string::npos);
}

TEST(RankGrid, CoordinatesRoundTripAndGroupsPartitionTheWorld) {
  for (auto [tp, pp, dp, cp] : {std::tuple{1, 1, 1, 1},
                                {2, 2, 2, 1},
                                {4, 2, 1, 1},
                                {1, 4, 2, 1},
                                {8, 1, 1, 1},
                                {1, 1, 8, 1},
                                {2, 3, 5, 1},
                                {2, 2, 2, 2},
                                {1, 3, 2, 4},
                                {3, 1, 1, 2}}) {
    RankGrid grid(tp * pp * dp * cp, {.tp = tp, .pp = pp, .dp = dp, .cp = cp});
    SCOPED_TRACE(testing::Message() << "tp " << tp << " pp " << pp << " dp " << dp << " cp " << cp);
    for (int r = 0; r < grid.world_size(); ++r) {
      GridCoords c = grid.coords(r);
      EXPECT_EQ(grid.rank_of(c), r);
      EXPECT_EQ(grid.tp_group(r)[c.tp_rank], r);
      EXPECT_EQ(grid.cp_group(r)[c.cp_rank], r);
      EXPECT_EQ(grid.dp_group(r)[c.dp_rank], r);
      EXPECT_EQ(grid.dp_cp_group(r)[c.cp_rank + cp * c.dp_rank], r);
      EXPECT_EQ(grid.pp_group(r)[c.pp_rank], r);
      EXPECT_EQ(grid.tp_group(r).size(), size_t(tp));
      EXPECT_EQ(grid.cp_group(r).size(), size_t(cp));
      EXPECT_EQ(grid.dp_group(r).size(), size_t(dp));
      EXPECT_EQ(grid.dp_cp_group(r).size(), size_t(dp * cp));
      EXPECT_EQ(grid.pp_group(r).size(), size_t(pp));
      EXPECT_EQ(grid.model_parallel_group(r).size(), size_t(tp * pp));
      // TP neighbours are consecutive ranks (one node).
      EXPECT_EQ(grid.tp_group(r).back() - grid.tp_group(r).front(), tp - 1);
    }
    const size_t world = size_t(grid.world_size());
    EXPECT_EQ(all_groups(grid, [&](int r) { return grid.tp_group(r); }).size(), world / tp);
    EXPECT_EQ(all_groups(grid, [&](int r) { return grid.cp_group(r); }).size(), world / cp);
    EXPECT_EQ(all_groups(grid, [&](int r) { return grid.dp_group(r); }).size(), world / dp);
    EXPECT_EQ(all_groups(grid, [&](int r) { return grid.dp_cp_group(r); }).size(),
              world / (dp * cp));
    EXPECT_EQ(all_groups(grid, [&](int r) { return grid.pp_group(r); }).size(), world / pp);
  }
}

TEST(RankGrid, DataParallelSizeIsInferred) {
  EXPECT_EQ(RankGrid(8, {.tp = 2, .pp = 1}).dp(), 4);
  EXPECT_EQ(RankGrid(8, {.tp = 2, .pp = 2, .dp = 2}).dp(), 2);
  EXPECT_EQ(RankGrid(1, {}).dp(), 1);
}

TEST(RankGrid, PipelineOfOneEmbedsOnEveryRank) {
  RankGrid grid(4, {.tp = 2});
  for (int r = 0; r < 4; ++r) EXPECT_EQ(grid.embedding_group(r), std::vector<int>{r});
}

TEST(RankGrid, BadLayoutsNameTheRule) {
  EXPECT_EQ(layout_error(6, {.tp = 4}),
            "parallel layout: world size 6 is not divisible by --tensor-model-parallel-size (4) "
            "× --pipeline-model-parallel-size (1) = 4");
  EXPECT_EQ(layout_error(8, {.tp = 2, .pp = 2, .dp = 4}),
            "parallel layout: world size 8 is not tensor (2) × pipeline (2) × data (4) parallel = "
            "16");
  EXPECT_EQ(layout_error(4, {.tp = 0}),
            "parallel layout: --tensor-model-parallel-size must be at least 1, got 0");
  EXPECT_EQ(layout_error(4, {.tp = 1, .pp = -2}),
            "parallel layout: --pipeline-model-parallel-size must be at least 1, got -2");
  EXPECT_EQ(layout_error(4, {.tp = 1, .pp = 1, .dp = -1}),
            "parallel layout: the data-parallel size must be at least 1 (or 0: inferred), got -1");
  EXPECT_NE(layout_error(0, {}), "");
  EXPECT_THROW(RankGrid(4, {.tp = 2}).coords(4), braid::Error);
}
