// ParallelState over real MPI processes: each group's communicator holds exactly the ranks
// RankGrid says, in its order, for every layout the world size allows.

#include <gtest/gtest.h>

#include <utility>

#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"

using namespace braid;
using namespace braid::comm;

namespace {

// The global ranks of `comm`'s members, in group-rank order.
std::vector<int> members(Communicator& comm) {
  Tensor mine = Tensor::empty({1}, DType::i32);
  mine.data_ptr<int32_t>()[0] = error_rank();
  Tensor all = Tensor::empty({comm.size()}, DType::i32);
  comm.all_gather(mine, all)->wait();
  return std::vector<int>(all.data_ptr<int32_t>(), all.data_ptr<int32_t>() + comm.size());
}

// Every layout of powers of two that fits `world`, with every expert-parallel size that
// divides its dp · cp.
std::vector<ParallelLayout> layouts(int world) {
  std::vector<ParallelLayout> all;
  for (int tp = 1; tp <= world; tp *= 2)
    for (int pp = 1; tp * pp <= world; pp *= 2)
      for (int cp = 1; tp * pp * cp <= world; cp *= 2) {
        if (world % (tp * pp * cp) != 0) continue;
        const int dp_cp = world / (tp * pp);
        for (int ep = 1; ep <= dp_cp; ep *= 2)
          if (dp_cp % ep == 0) all.push_back({.tp = tp, .pp = pp, .cp = cp, .ep = ep});
      }
  return all;
}

}  // namespace

TEST(ParallelState, GroupsMatchTheGrid) {
  std::shared_ptr<MpiCommunicator> world = init_distributed().world;
  const int me = world->rank();
  for (const ParallelLayout& layout : layouts(world->size())) {
    ParallelState state(world, layout);
    const RankGrid& grid = state.grid();
    SCOPED_TRACE(testing::Message() << "tp " << grid.tp() << " pp " << grid.pp() << " dp "
                                    << grid.dp() << " cp " << grid.cp() << " ep " << grid.ep());
    EXPECT_EQ(
        state.tp_rank() + grid.tp() * (state.cp_rank() +
                                       grid.cp() * (state.dp_rank() + grid.dp() * state.pp_rank())),
        me);
    EXPECT_EQ(members(state.tp()), grid.tp_group(me));
    EXPECT_EQ(members(state.cp()), grid.cp_group(me));
    EXPECT_EQ(members(state.dp()), grid.dp_group(me));
    EXPECT_EQ(members(state.dp_cp()), grid.dp_cp_group(me));
    EXPECT_EQ(members(state.pp()), grid.pp_group(me));
    EXPECT_EQ(members(state.model_parallel()), grid.model_parallel_group(me));
    EXPECT_EQ(members(state.ep()), grid.ep_group(me));
    EXPECT_EQ(members(state.expert_dp()), grid.expert_dp_group(me));
    EXPECT_EQ(state.ep().size(), grid.ep());
    EXPECT_EQ(state.ep().rank(), state.ep_rank());
    EXPECT_EQ(state.expert_dp().size(), grid.expert_dp());
    EXPECT_EQ(state.expert_dp().rank(), state.expert_dp_rank());
    EXPECT_EQ(state.ep_rank() + grid.ep() * state.expert_dp_rank(),
              state.cp_rank() + grid.cp() * state.dp_rank());
    if (grid.ep() > 1) {
      EXPECT_EQ(state.ep().name(), "ep");
      EXPECT_EQ(state.expert_dp().name(), "expert_dp");
    } else {
      EXPECT_EQ(&state.expert_dp(), &state.dp_cp());
    }
    EXPECT_EQ(state.tp().name(), "tp");
    EXPECT_EQ(state.pp().rank(), state.pp_rank());
    ASSERT_EQ(state.embedding() != nullptr, state.is_first_stage() || state.is_last_stage());
    if (state.embedding() != nullptr) {
      EXPECT_EQ(members(*state.embedding()), grid.embedding_group(me));
    }
    world->barrier()->wait();
  }
}

// An all-reduce over the EP group sums exactly its members (as a token exchange between the
// ranks holding different experts would reach them), and one over the expert-DP group the
// ranks holding the same experts.
TEST(ParallelState, ExpertGroupsReduceOverTheirMembers) {
  std::shared_ptr<MpiCommunicator> world = init_distributed().world;
  const int me = world->rank();
  for (const ParallelLayout& layout : layouts(world->size())) {
    ParallelState state(world, layout);
    const RankGrid& grid = state.grid();
    SCOPED_TRACE(testing::Message() << "tp " << grid.tp() << " pp " << grid.pp() << " dp "
                                    << grid.dp() << " cp " << grid.cp() << " ep " << grid.ep());
    auto sum_of_ranks = [&](Communicator& comm) {
      Tensor t = Tensor::empty({2}, DType::i64);
      t.data_ptr<int64_t>()[0] = me;
      t.data_ptr<int64_t>()[1] = int64_t(1) << me;  // which ranks, not just how many
      comm.all_reduce(t)->wait();
      return std::pair{t.data_ptr<int64_t>()[0], t.data_ptr<int64_t>()[1]};
    };
    auto expected = [](const std::vector<int>& group) {
      std::pair<int64_t, int64_t> s{0, 0};
      for (int r : group) {
        s.first += r;
        s.second |= int64_t(1) << r;
      }
      return s;
    };
    EXPECT_EQ(sum_of_ranks(state.ep()), expected(grid.ep_group(me)));
    EXPECT_EQ(sum_of_ranks(state.expert_dp()), expected(grid.expert_dp_group(me)));
    world->barrier()->wait();
  }
}

// Activations travel forward through the stages and gradients back, as a pipeline does.
TEST(ParallelState, PipelineNeighboursExchange) {
  std::shared_ptr<MpiCommunicator> world = init_distributed().world;
  if (world->size() % 2 != 0) GTEST_SKIP() << "needs an even world";
  ParallelState state(world, {.tp = 1, .pp = world->size() / (world->size() >= 4 ? 2 : 1)});
  Communicator& pp = state.pp();
  Tensor activation = Tensor::zeros({3}, DType::f32);
  if (!state.is_first_stage()) pp.recv(activation, state.prev_stage())->wait();
  activation.data_ptr<float>()[0] += 1;  // this stage's "forward"
  if (!state.is_last_stage()) pp.send(activation, state.next_stage())->wait();
  if (state.is_last_stage()) {
    EXPECT_EQ(activation.item(0), state.grid().pp());
  }
  Tensor grad = Tensor::zeros({3}, DType::f32);
  if (!state.is_last_stage()) pp.recv(grad, state.next_stage())->wait();
  grad.data_ptr<float>()[1] += 1;
  if (!state.is_first_stage()) pp.send(grad, state.prev_stage())->wait();
  if (state.is_first_stage()) {
    EXPECT_EQ(grad.item(1), state.grid().pp());
  }
}

TEST(ParallelState, BadLayoutIsTheSameErrorOnEveryRankBeforeAnyCollective) {
  std::shared_ptr<MpiCommunicator> world = init_distributed().world;
  try {
    ParallelState state(world, {.tp = world->size() + 1});
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.message()).find("is not divisible by --tensor-model-parallel-size"),
              std::string::npos);
  }
}
