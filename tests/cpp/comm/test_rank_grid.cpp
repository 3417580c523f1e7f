// RankGrid: Megatron's rank order and its layout checks, without processes.

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <tuple>

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

// Megatron's expert-parallel example (initialize_model_parallel's docstring), 8 ranks with TP=2,
// EP=2 (so DP=4, expert DP=2): EP groups take consecutive DP ranks, expert-DP groups stride by ep.
TEST(RankGrid, MegatronExpertParallelExample) {
  RankGrid grid(8, {.tp = 2, .ep = 2});
  EXPECT_EQ(grid.dp(), 4);
  EXPECT_EQ(grid.ep(), 2);
  EXPECT_EQ(grid.expert_dp(), 2);
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.ep_group(r); }),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.expert_dp_group(r); }),
            (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  // Rank 6: tp 0, dp 3, so j = 3 = 1 + 2 · 1.
  EXPECT_EQ(grid.ep_rank(6), 1);
  EXPECT_EQ(grid.expert_dp_rank(6), 1);
}

// With CP the dp_cp index j = cp_rank + cp · dp_rank runs CP first, so EP takes the CP ranks
// first: with cp = 2 and ep = 2 an EP group is a CP group and an expert-DP group a DP group.
TEST(RankGrid, ExpertParallelGroupsWithContextParallel) {
  RankGrid grid(8, {.tp = 2, .cp = 2, .ep = 2});
  EXPECT_EQ(grid.dp(), 2);
  EXPECT_EQ(grid.expert_dp(), 2);
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(grid.ep_group(r), grid.cp_group(r));
    EXPECT_EQ(grid.expert_dp_group(r), grid.dp_group(r));
    EXPECT_EQ(grid.ep_rank(r), grid.coords(r).cp_rank);
    EXPECT_EQ(grid.expert_dp_rank(r), grid.coords(r).dp_rank);
  }
  EXPECT_EQ(grid.ep_group(0), (std::vector<int>{0, 2}));

  // ep = dp · cp: one EP group per (TP, PP) coordinate, the experts' DP groups of one rank.
  RankGrid all(8, {.tp = 2, .cp = 2, .ep = 4});
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(all.ep_group(r), all.dp_cp_group(r));
    EXPECT_EQ(all.expert_dp_group(r), std::vector<int>{r});
  }

  // EP groups may cross CP groups: cp = 2, dp = 3, ep = 3 (j 0..5 at tp 0 is rank 2j).
  RankGrid across(12, {.tp = 2, .cp = 2, .ep = 3});
  EXPECT_EQ(across.dp(), 3);
  EXPECT_EQ(across.expert_dp(), 2);
  EXPECT_EQ(all_groups(across, [&](int r) { return across.ep_group(r); }),
            (Groups{{0, 2, 4}, {1, 3, 5}, {6, 8, 10}, {7, 9, 11}}));
  EXPECT_EQ(all_groups(across, [&](int r) { return across.expert_dp_group(r); }),
            (Groups{{0, 6}, {1, 7}, {2, 8}, {3, 9}, {4, 10}, {5, 11}}));
}

TEST(RankGrid, ExpertGroupsPartitionEachDataParallelGroup) {
  for (auto [tp, pp, dp, cp] : {std::tuple{1, 1, 1, 1},
                                {2, 2, 2, 1},
                                {1, 1, 8, 1},
                                {2, 3, 6, 1},
                                {2, 2, 2, 2},
                                {1, 3, 2, 4},
                                {3, 1, 3, 2},
                                {2, 2, 4, 3}}) {
    for (int ep = 1; ep <= dp * cp; ++ep) {
      if (dp * cp % ep != 0) continue;
      RankGrid grid(tp * pp * dp * cp, {.tp = tp, .pp = pp, .dp = dp, .cp = cp, .ep = ep});
      SCOPED_TRACE(testing::Message()
                   << "tp " << tp << " pp " << pp << " dp " << dp << " cp " << cp << " ep " << ep);
      const int edp = dp * cp / ep;
      EXPECT_EQ(grid.expert_dp(), edp);
      for (int r = 0; r < grid.world_size(); ++r) {
        const GridCoords c = grid.coords(r);
        const std::vector<int> ep_group = grid.ep_group(r);
        const std::vector<int> edp_group = grid.expert_dp_group(r);
        EXPECT_EQ(grid.ep_rank(r) + ep * grid.expert_dp_rank(r), c.cp_rank + cp * c.dp_rank);
        ASSERT_EQ(ep_group.size(), size_t(ep));
        ASSERT_EQ(edp_group.size(), size_t(edp));
        EXPECT_EQ(ep_group[grid.ep_rank(r)], r);
        EXPECT_EQ(edp_group[grid.expert_dp_rank(r)], r);
        EXPECT_TRUE(std::is_sorted(ep_group.begin(), ep_group.end()));
        EXPECT_TRUE(std::is_sorted(edp_group.begin(), edp_group.end()));
        // Members agree on the group (and on their place in it) and share r's TP and PP ranks.
        for (int m : ep_group) {
          EXPECT_EQ(grid.ep_group(m), ep_group);
          EXPECT_EQ(grid.expert_dp_rank(m), grid.expert_dp_rank(r));
          EXPECT_EQ(grid.coords(m).tp_rank, c.tp_rank);
          EXPECT_EQ(grid.coords(m).pp_rank, c.pp_rank);
        }
        for (int m : edp_group) {
          EXPECT_EQ(grid.expert_dp_group(m), edp_group);
          EXPECT_EQ(grid.ep_rank(m), grid.ep_rank(r));
        }
        // EP × expert DP is exactly r's dp_cp group, and the two meet in r alone.
        std::set<int> product;
        for (int e : ep_group)
          for (int m : grid.expert_dp_group(e)) product.insert(m);
        const std::vector<int> dp_cp = grid.dp_cp_group(r);
        EXPECT_EQ(std::vector<int>(product.begin(), product.end()), dp_cp);
        std::vector<int> both;
        std::set_intersection(ep_group.begin(), ep_group.end(), edp_group.begin(), edp_group.end(),
                              std::back_inserter(both));
        EXPECT_EQ(both, std::vector<int>{r});
      }
      // Every rank in exactly one group of each kind.
      const size_t world = size_t(grid.world_size());
      for (const Groups& groups :
           {all_groups(grid, [&](int r) { return grid.ep_group(r); }),
            all_groups(grid, [&](int r) { return grid.expert_dp_group(r); })}) {
        std::multiset<int> seen;
        for (const std::vector<int>& g : groups) seen.insert(g.begin(), g.end());
        EXPECT_EQ(seen.size(), world);
        for (int r = 0; r < grid.world_size(); ++r) EXPECT_EQ(seen.count(r), 1u);
      }
      if (ep == 1) {
        for (int r = 0; r < grid.world_size(); ++r) {
          EXPECT_EQ(grid.ep_group(r), std::vector<int>{r});
          EXPECT_EQ(grid.expert_dp_group(r), grid.dp_cp_group(r));
        }
      }
    }
  }
}

// Expert TP 1 (Megatron's MoE parallel folding): the expert grid reads a rank's place in its
// stage, k = tp_rank + tp · (cp_rank + cp · dp_rank), as ep_rank + ep · expert_dp_rank - megatron-
// core's expert RankGenerator with etp 1 ("tp-ep-dp-pp"). TP=2, EP=2, DP=2, PP=2 on 16 ranks
// with CP=2: each stage's 8 ranks are 4 EP pairs of neighbours, and expert-DP groups stride by 2.
TEST(RankGrid, WholeExpertsSplitEveryRankOfAStage) {
  RankGrid grid(16, {.tp = 2, .pp = 2, .cp = 2, .ep = 2, .etp = 1});
  EXPECT_TRUE(grid.whole_experts());
  EXPECT_EQ(grid.expert_dp(), 4);
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.ep_group(r); }),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(all_groups(grid, [&](int r) { return grid.expert_dp_group(r); }),
            (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  // An EP group of a whole stage: tp 2 × dp 2 = 4 ranks, expert DP 1.
  RankGrid stage(8, {.tp = 2, .pp = 2, .ep = 4, .etp = 1});
  EXPECT_EQ(stage.expert_dp(), 1);
  EXPECT_EQ(stage.ep_group(5), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(stage.ep_rank(6), 2);
  EXPECT_EQ(stage.expert_dp_group(6), std::vector<int>{6});
  // EP 1: every rank holds every expert whole; their gradients sum over the stage's ranks.
  RankGrid replicated(4, {.tp = 2, .ep = 1, .etp = 1});
  EXPECT_EQ(replicated.ep_group(3), std::vector<int>{3});
  EXPECT_EQ(replicated.expert_dp_group(3), (std::vector<int>{0, 1, 2, 3}));
  // etp = tp, and etp 1 without TP, are the split experts' grid.
  for (const ParallelLayout& same :
       {ParallelLayout{.tp = 2, .ep = 2, .etp = 2}, ParallelLayout{.tp = 1, .ep = 2, .etp = 1}}) {
    RankGrid a(8, same), b(8, {.tp = same.tp, .ep = 2});
    EXPECT_FALSE(a.whole_experts());
    for (int r = 0; r < 8; ++r) EXPECT_EQ(a.ep_group(r), b.ep_group(r));
  }
  EXPECT_EQ(layout_error(4, {.tp = 2, .ep = 3, .etp = 1}),
            "parallel layout: --expert-model-parallel-size (3) must divide tensor (2) × data (2) "
            "parallel = 4: with --expert-tensor-parallel-size 1 expert parallelism splits the "
            "ranks of a pipeline stage");
  EXPECT_EQ(layout_error(8, {.tp = 4, .ep = 2, .etp = 2}),
            "parallel layout: --expert-tensor-parallel-size must be 1 or the TP size (4), got 2");
}

// With whole experts every rank of a stage sits in one EP group and one expert-DP group, whose
// intersection is itself, for every layout of up to 8 ranks.
TEST(RankGrid, WholeExpertGroupsPartitionEachStage) {
  for (int tp : {2, 4})
    for (int pp : {1, 2})
      for (int dp : {1, 2})
        for (int cp : {1, 2}) {
          const int stage = tp * dp * cp;
          for (int ep = 1; ep <= stage; ++ep) {
            if (stage % ep != 0) continue;
            RankGrid grid(stage * pp, {.tp = tp, .pp = pp, .dp = dp, .cp = cp, .ep = ep, .etp = 1});
            SCOPED_TRACE("tp " + std::to_string(tp) + " pp " + std::to_string(pp) + " dp " +
                         std::to_string(dp) + " cp " + std::to_string(cp) + " ep " +
                         std::to_string(ep));
            for (int r = 0; r < grid.world_size(); ++r) {
              const std::vector<int> e = grid.ep_group(r), d = grid.expert_dp_group(r);
              ASSERT_EQ(e.size(), size_t(ep));
              ASSERT_EQ(d.size(), size_t(stage / ep));
              EXPECT_EQ(e[size_t(grid.ep_rank(r))], r);
              EXPECT_EQ(d[size_t(grid.expert_dp_rank(r))], r);
              for (int m : e) EXPECT_EQ(grid.coords(m).pp_rank, grid.coords(r).pp_rank);
              for (int m : d) EXPECT_EQ(grid.ep_rank(m), grid.ep_rank(r));
              std::vector<int> both;
              std::set_intersection(e.begin(), e.end(), d.begin(), d.end(),
                                    std::back_inserter(both));
              EXPECT_EQ(both, std::vector<int>{r});
            }
          }
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
  EXPECT_EQ(layout_error(4, {.ep = 0}),
            "parallel layout: --expert-model-parallel-size must be at least 1, got 0");
  EXPECT_EQ(layout_error(3, {.ep = 4}),
            "parallel layout: --expert-model-parallel-size (4) must divide the data-parallel "
            "size (3): expert parallelism splits the data-parallel ranks");
  EXPECT_EQ(layout_error(12, {.tp = 2, .cp = 2, .ep = 4}),
            "parallel layout: --expert-model-parallel-size (4) must divide the data-parallel "
            "size × --context-parallel-size (3 × 2 = 6): expert parallelism splits the "
            "data-parallel ranks");
  // ep divides dp · cp but neither alone: allowed, as in Megatron.
  EXPECT_EQ(layout_error(8, {.tp = 2, .cp = 2, .ep = 4}), "");
  EXPECT_THROW(RankGrid(4, {.tp = 2}).coords(4), braid::Error);
}
