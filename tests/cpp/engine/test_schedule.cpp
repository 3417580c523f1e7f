// Pipeline schedules: exhaustive proof for pp <= 8, m <= 32, v <= 4 (every send meets its
// receive, no deadlock, forward before backward, in-flight bounds, exact bubble fractions),
// the layer split, the bad-layout messages, and broken lists the simulator must reject.

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "braid/core/error.h"
#include "braid/engine/schedule.h"

namespace braid::engine {
namespace {

enum class Kind { gpipe, one_f_one_b, interleaved };

Schedule make(Kind kind, int pp, int m, int v) {
  switch (kind) {
    case Kind::gpipe:
      return make_gpipe(pp, m);
    case Kind::one_f_one_b:
      return make_1f1b(pp, m);
    case Kind::interleaved:
      return make_interleaved_1f1b(pp, m, v);
  }
  return {};
}

// Checks made on the lists themselves, independent of the simulator: each rank runs every
// (chunk, microbatch) forward and backward exactly once, forward first; the multiset of sends
// equals the multiset of receives (as model-chunk-to-model-chunk transfers).
void check_lists(const Schedule& s, const std::string& label) {
  const int p = s.pp, v = s.virtual_stages, m = s.microbatches;
  using Transfer = std::tuple<bool, int, int, int>;  // activation?, from chunk, to chunk, mb
  std::map<Transfer, int> balance;
  for (int r = 0; r < p; ++r) {
    std::vector<int> fwd_at(v * m, -1), bwd_at(v * m, -1);
    const auto& list = s.ranks[r];
    for (int i = 0; i < int(list.size()); ++i) {
      const Action& a = list[i];
      if (a.kind == ActionKind::exchange) {
        for (const P2POp& op : a.ops) {
          const int here = s.model_chunk(r, op.chunk);
          const bool act =
              op.kind == P2PKind::send_activation || op.kind == P2PKind::recv_activation;
          const bool send = op.kind == P2PKind::send_activation || op.kind == P2PKind::send_grad;
          const int there = (act == send) ? here + 1 : here - 1;
          const int from = send ? here : there, to = send ? there : here;
          balance[{act, from, to, op.microbatch}] += send ? 1 : -1;
        }
        continue;
      }
      auto& at = a.kind == ActionKind::forward ? fwd_at : bwd_at;
      const int k = a.chunk * m + a.microbatch;
      ASSERT_EQ(at[k], -1) << label << " rank " << r << " repeats " << to_string(a, v);
      at[k] = i;
    }
    for (int k = 0; k < v * m; ++k) {
      ASSERT_GE(fwd_at[k], 0) << label << " rank " << r << " misses a forward";
      ASSERT_GT(bwd_at[k], fwd_at[k]) << label << " rank " << r << " chunk " << k / m << " mb "
                                      << k % m << ": backward not after forward";
    }
  }
  for (const auto& [t, n] : balance) ASSERT_EQ(n, 0) << label << ": unbalanced send/recv";
  // Every model-chunk boundary carries each microbatch once forward and once backward.
  ASSERT_EQ(balance.size(), size_t(2 * (p * v - 1) * m)) << label;
}

TEST(Schedule, ExhaustiveUpToPp8M32V4) {
  int schedules = 0, simulations = 0;
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      for (Kind kind : {Kind::gpipe, Kind::one_f_one_b, Kind::interleaved}) {
        for (int v = (kind == Kind::interleaved ? 2 : 1); v <= (kind == Kind::interleaved ? 4 : 1);
             ++v) {
          if (kind == Kind::interleaved && (p == 1 || m % p != 0)) continue;  // invalid layouts
          const Schedule s = make(kind, p, m, v);
          const std::string label = s.name + " pp=" + std::to_string(p) +
                                    " m=" + std::to_string(m) + " v=" + std::to_string(v);
          ++schedules;
          check_lists(s, label);
          if (testing::Test::HasFatalFailure()) return;
          for (P2PSemantics sem : {P2PSemantics::rendezvous, P2PSemantics::eager}) {
            SimulationCosts costs;  // unit forward, two-unit backward, free p2p
            costs.semantics = sem;
            const SimulationResult res = simulate(s, costs);
            ++simulations;
            ASSERT_TRUE(res.ok()) << label << ": " << res.error;
            // Exact: all times are small integers. Idle device time is (p - 1)(t_f + t_b) per
            // rank, so the makespan is (v m + p - 1)(t_f + t_b).
            EXPECT_EQ(res.makespan, 3.0 * (v * m + p - 1)) << label;
            EXPECT_DOUBLE_EQ(res.bubble_fraction, double(p - 1) / (v * m)) << label;
            for (int r = 0; r < p; ++r) {
              EXPECT_EQ(res.busy[r], 3.0 * v * m) << label;
              const int expect = kind == Kind::gpipe ? m
                                 : kind == Kind::one_f_one_b
                                     ? std::min(p - r, m)
                                     : std::min(interleaved_warmup_steps(p, m, v, r) + 1, v * m);
              EXPECT_EQ(res.max_in_flight[r], expect) << label << " rank " << r;
              if (kind == Kind::one_f_one_b) {
                EXPECT_LE(res.max_in_flight[r], p) << label;
              }
            }
          }
        }
      }
    }
  }
  // GPipe and 1F1B for every (pp, m); interleaved for v = 2..4 where pp > 1 and pp | m.
  EXPECT_EQ(schedules, 8 * 32 * 2 + 3 * (16 + 10 + 8 + 6 + 5 + 4 + 4));
  EXPECT_EQ(simulations, 2 * schedules);
}

// Evaluation: every forward once, no backward, every boundary carries each microbatch once,
// deadlock-free under both send semantics, and pipelined: with unit forwards the last rank
// finishes at v m + p - 1, as the training schedules' forward halves do.
TEST(Schedule, ForwardOnlyExhaustiveUpToPp8M32V4) {
  int schedules = 0;
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      for (int v = 1; v <= 4; ++v) {
        if (v > 1 && (p == 1 || m % p != 0)) continue;  // the interleaved schedule's rules
        const Schedule s = make_forward_only(p, m, v);
        const std::string label = "forward-only pp=" + std::to_string(p) +
                                  " m=" + std::to_string(m) + " v=" + std::to_string(v);
        ++schedules;
        ASSERT_TRUE(s.forward_only) << label;
        int sends = 0, recvs = 0;
        for (int r = 0; r < p; ++r) {
          std::vector<int> forwards(size_t(v * m), 0);
          for (const Action& a : s.ranks[size_t(r)]) {
            ASSERT_NE(a.kind, ActionKind::backward) << label;
            if (a.kind == ActionKind::forward) ++forwards[size_t(a.chunk * m + a.microbatch)];
            for (const P2POp& op : a.ops) {
              ASSERT_TRUE(op.kind == P2PKind::send_activation ||
                          op.kind == P2PKind::recv_activation)
                  << label;
              (op.kind == P2PKind::send_activation ? sends : recvs) += 1;
            }
          }
          for (int n : forwards) ASSERT_EQ(n, 1) << label << " rank " << r;
        }
        ASSERT_EQ(sends, (p * v - 1) * m) << label;
        ASSERT_EQ(recvs, sends) << label;
        for (P2PSemantics sem : {P2PSemantics::rendezvous, P2PSemantics::eager}) {
          SimulationCosts costs;
          costs.semantics = sem;
          const SimulationResult res = simulate(s, costs);
          ASSERT_TRUE(res.ok()) << label << ": " << res.error;
          EXPECT_EQ(res.makespan, double(v * m + p - 1)) << label;
          for (int r = 0; r < p; ++r) EXPECT_EQ(res.busy[size_t(r)], double(v * m)) << label;
        }
      }
    }
  }
  EXPECT_EQ(schedules, 8 * 32 + 3 * (16 + 10 + 8 + 6 + 5 + 4 + 4));
}

TEST(Schedule, BubbleFormulaHoldsForOtherCostRatios) {
  for (auto [tf, tb] : {std::pair{1.0, 1.0}, std::pair{1.0, 3.0}, std::pair{2.0, 1.0}}) {
    for (int p : {2, 4, 8})
      for (int m : {8, 16}) {
        for (int v : {1, 2, 4}) {
          const Schedule s = v == 1 ? make_1f1b(p, m) : make_interleaved_1f1b(p, m, v);
          const SimulationResult res = simulate(s, tf, tb);
          ASSERT_TRUE(res.ok()) << res.error;
          EXPECT_DOUBLE_EQ(res.bubble_fraction, double(p - 1) / (v * m))
              << s.name << " p" << p << " m" << m << " v" << v << " tf" << tf << " tb" << tb;
        }
        const SimulationResult g = simulate(make_gpipe(p, m), tf, tb);
        EXPECT_DOUBLE_EQ(g.bubble_fraction, double(p - 1) / m);
      }
  }
}

TEST(Schedule, P2PCostAndPerChunkCosts) {
  // A p2p latency only adds time; nothing deadlocks.
  for (int v : {1, 2}) {
    const Schedule s = make_interleaved_1f1b(4, 8, v);
    const SimulationResult free_p2p = simulate(s, 1, 2, 0.0);
    const SimulationResult slow_p2p = simulate(s, 1, 2, 0.25);
    ASSERT_TRUE(slow_p2p.ok()) << slow_p2p.error;
    EXPECT_GT(slow_p2p.makespan, free_p2p.makespan);
  }
  // Per-chunk costs: a last stage twice as slow bounds the makespan by its own busy time.
  SimulationCosts costs;
  costs.forward_by_chunk = {{1}, {1}, {1}, {2}};
  costs.backward_by_chunk = {{2}, {2}, {2}, {4}};
  const SimulationResult res = simulate(make_1f1b(4, 8), costs);
  ASSERT_TRUE(res.ok()) << res.error;
  EXPECT_EQ(res.busy[3], 8 * 6.0);
  EXPECT_GE(res.makespan, res.busy[3]);
  EXPECT_EQ(res.busy[0], 8 * 3.0);
}

// When each chunk's gradients are complete: the last backward of that chunk in the rank's
// list, timed like every action; in the interleaved order the later chunks finish first.
TEST(Schedule, LastBackwardOfEachChunk) {
  for (const Schedule& s : {make_1f1b(4, 8), make_gpipe(4, 8), make_interleaved_1f1b(4, 8, 2),
                            make_interleaved_1f1b(2, 4, 4)}) {
    SCOPED_TRACE(s.name);
    const SimulationResult r = simulate(s);
    ASSERT_TRUE(r.ok()) << r.error;
    for (int rank = 0; rank < s.pp; ++rank) {
      const std::vector<Action>& list = s.ranks[size_t(rank)];
      for (int c = 0; c < s.virtual_stages; ++c) {
        size_t last = list.size();
        for (size_t i = 0; i < list.size(); ++i)
          if (list[i].kind == ActionKind::backward && list[i].chunk == c) last = i;
        ASSERT_LT(last, list.size());
        EXPECT_EQ(r.last_backward_start[size_t(rank)][size_t(c)], r.start[size_t(rank)][last]);
        EXPECT_EQ(r.last_backward_end[size_t(rank)][size_t(c)], r.end[size_t(rank)][last]);
        if (c > 0) {
          EXPECT_LT(r.last_backward_end[size_t(rank)][size_t(c)],
                    r.last_backward_end[size_t(rank)][size_t(c - 1)]);
        }
      }
    }
  }
  const SimulationResult forward_only = simulate(make_forward_only(2, 4));
  ASSERT_TRUE(forward_only.ok());
  EXPECT_EQ(forward_only.last_backward_end[0][0], -1.0);
}

TEST(Schedule, MegatronOrdersForPp4M8) {
  EXPECT_EQ(format_rank(make_1f1b(4, 8), 0, false),
            "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(format_rank(make_1f1b(4, 8), 3, false),
            "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
  EXPECT_EQ(format_rank(make_1f1b(4, 8), 1),
            "[rA0<0] F0 [sA0>2] [rA1<0] F1 [sA1>2] [rA2<0] F2 [sA2>2 rG0<2] B0 [rA3<0 sG0>0] "
            "F3 [sA3>2 rG1<2] B1 [rA4<0 sG1>0] F4 [sA4>2 rG2<2] B2 [rA5<0 sG2>0] F5 "
            "[sA5>2 rG3<2] B3 [rA6<0 sG3>0] F6 [sA6>2 rG4<2] B4 [rA7<0 sG4>0] F7 "
            "[sA7>2 rG5<2] B5 [sG5>0] [rG6<2] B6 [sG6>0] [rG7<2] B7 [sG7>0]");
  // Narayanan et al. 2021, figure 4: rank 0 warms up with 2 (pp - 1) + (v - 1) pp = 10
  // forwards, chunks taken in groups of pp microbatches.
  EXPECT_EQ(format_rank(make_interleaved_1f1b(4, 8, 2), 0, false),
            "F0c0 F1c0 F2c0 F3c0 F0c1 F1c1 F2c1 F3c1 F4c0 F5c0 F6c0 B0c1 F7c0 B1c1 F4c1 B2c1 "
            "F5c1 B3c1 F6c1 B0c0 F7c1 B1c0 B2c0 B3c0 B4c1 B5c1 B6c1 B7c1 B4c0 B5c0 B6c0 B7c0");
  EXPECT_EQ(format_rank(make_gpipe(2, 3), 1),
            "[rA0<0] F0 [rA1<0] F1 [rA2<0] F2 B0 [sG0>0] B1 "
            "[sG1>0] B2 [sG2>0]");
  EXPECT_EQ(interleaved_warmup_steps(4, 8, 2, 0), 10);
  EXPECT_EQ(interleaved_warmup_steps(4, 8, 2, 3), 4);
  EXPECT_EQ(interleaved_warmup_steps(4, 4, 4, 0), 16);  // all warmup: capped at v m
}

TEST(Schedule, InterleavedV1IsOneFOneB) {
  EXPECT_EQ(make_interleaved_1f1b(4, 6, 1).ranks, make_1f1b(4, 6).ranks);
}

// ---- broken lists: the checks can fail ------------------------------------------------------

size_t find_action(const std::vector<Action>& list, ActionKind kind, int mb) {
  for (size_t i = 0; i < list.size(); ++i)
    if (list[i].kind == kind && list[i].microbatch == mb) return i;
  return list.size();
}

TEST(ScheduleBroken, SwappedExchangesDeadlock) {
  // Rank 0 waits for gradient 0 before it sends activation 0: the two ranks wait on each
  // other. (Per-direction send order is unchanged, so this is not a mismatch.)
  Schedule s = make_1f1b(2, 1);
  auto& r0 = s.ranks[0];
  ASSERT_EQ(format_rank(s, 0), "F0 [sA0>1] [rG0<1] B0");
  std::swap(r0[1], r0[2]);
  const SimulationResult res = simulate(s);
  EXPECT_FALSE(res.ok());
  EXPECT_NE(res.error.find("deadlock"), std::string::npos) << res.error;
  EXPECT_EQ(res.blocked_ranks, (std::vector<int>{0, 1}));
}

// Every swap of two neighbouring actions of every rank: the simulator either accepts the list
// (and then the independent list checks hold too) or names what broke. Each kind of failure
// occurs (a mismatch needs a non-adjacent swap: SwappedForwardsAreMismatched).
TEST(ScheduleBroken, EveryAdjacentSwap) {
  std::map<std::string, int> outcomes;
  for (const Schedule& base : {make_1f1b(4, 8), make_interleaved_1f1b(4, 8, 2), make_gpipe(3, 4)}) {
    for (int r = 0; r < base.pp; ++r)
      for (size_t i = 0; i + 1 < base.ranks[r].size(); ++i) {
        Schedule s = base;
        std::swap(s.ranks[r][i], s.ranks[r][i + 1]);
        const SimulationResult res = simulate(s);
        if (res.ok()) {
          check_lists(s, s.name + " swapped");
          ++outcomes["ok"];
          continue;
        }
        bool known = false;
        for (const char* what :
             {"deadlock", "mismatched p2p", "before its input activation",
              "before its output gradient", "backward before forward", "not yet computed"})
          if (res.error.find(what) != std::string::npos) {
            ++outcomes[what];
            known = true;
          }
        EXPECT_TRUE(known) << res.error;
      }
  }
  for (const char* what :
       {"ok", "deadlock", "before its input activation", "before its output gradient",
        "backward before forward", "not yet computed"})
    EXPECT_GT(outcomes[what], 0) << what;
}

TEST(ScheduleBroken, RendezvousDeadlockThatEagerSendsHide) {
  // Both ranks send before they receive in one exchange each... and in separate exchanges:
  // rank 1 sends its gradient and only then receives the next activation, while rank 0 sends
  // the next activation and only then receives the gradient. Buffered sends finish; NCCL-like
  // rendezvous sends do not.
  Schedule s = make_1f1b(2, 2);
  // rank 0: F0 [sA0>1] F1 [sA1>1 rG0<1] B0 [rG1<1] B1
  // Split rank 0's [sA1>1 rG0<1] into [sA1>1] [rG0<1] and rank 1's [rA1<0 sG0>0] into
  // [sG0>0] [rA1<0].
  auto& r0 = s.ranks[0];
  auto& r1 = s.ranks[1];
  const size_t i0 = 3;
  ASSERT_EQ(to_string(r0[i0]), "[sA1>1 rG0<1]");
  Action send_a = r0[i0], recv_g = r0[i0];
  send_a.ops = {r0[i0].ops[0]};
  recv_g.ops = {r0[i0].ops[1]};
  r0[i0] = send_a;
  r0.insert(r0.begin() + i0 + 1, recv_g);
  const size_t i1 = find_action(r1, ActionKind::backward, 0) + 1;
  ASSERT_EQ(to_string(r1[i1]), "[rA1<0 sG0>0]");
  Action recv_a = r1[i1], send_g = r1[i1];
  recv_a.ops = {r1[i1].ops[0]};
  send_g.ops = {r1[i1].ops[1]};
  r1[i1] = send_g;
  r1.insert(r1.begin() + i1 + 1, recv_a);
  // FIFO order per direction is unchanged, so it matches; rank 0 waits for rank 1 to take
  // activation 1, rank 1 waits for rank 0 to take gradient 0.
  const SimulationResult rendezvous = simulate(s);
  EXPECT_NE(rendezvous.error.find("deadlock"), std::string::npos) << rendezvous.error;
  SimulationCosts eager;
  eager.semantics = P2PSemantics::eager;
  EXPECT_TRUE(simulate(s, eager).ok()) << simulate(s, eager).error;
}

TEST(ScheduleBroken, SwappedForwardsAreMismatched) {
  // Rank 0 of GPipe runs microbatch 1 before microbatch 0: the k-th send to rank 1 now carries
  // a different microbatch than rank 1's k-th receive expects.
  Schedule s = make_gpipe(3, 4);
  auto& r0 = s.ranks[0];  // F0 [sA0>1] F1 [sA1>1] ...
  std::swap(r0[0], r0[2]);
  std::swap(r0[1], r0[3]);
  const SimulationResult res = simulate(s);
  EXPECT_FALSE(res.ok());
  EXPECT_NE(res.error.find("mismatched p2p"), std::string::npos) << res.error;
}

TEST(ScheduleBroken, ForwardBeforeItsInputIsRejected) {
  Schedule s = make_1f1b(4, 8);
  auto& r2 = s.ranks[2];  // [rA0<1] F0 ...
  std::swap(r2[0], r2[1]);
  const SimulationResult res = simulate(s);
  EXPECT_NE(res.error.find("forward before its input activation arrived"), std::string::npos)
      << res.error;
}

TEST(ScheduleBroken, BackwardBeforeForwardIsRejected) {
  Schedule s = make_1f1b(1, 2);  // F0 B0 F1 B1
  std::swap(s.ranks[0][0], s.ranks[0][1]);
  EXPECT_NE(simulate(s).error.find("backward before forward"), std::string::npos);
}

TEST(ScheduleBroken, DroppedReceiveIsUnmatched) {
  Schedule s = make_1f1b(4, 8);
  auto& r0 = s.ranks[0];  // ... [rG7<1] B7
  ASSERT_EQ(to_string(r0[r0.size() - 2]), "[rG7<1]");
  r0.erase(r0.end() - 2);
  const SimulationResult res = simulate(s);
  EXPECT_NE(res.error.find("unmatched send"), std::string::npos) << res.error;
}

TEST(ScheduleBroken, WrongPeerIsRejected) {
  Schedule s = make_1f1b(4, 4);
  s.ranks[0][1].ops[0].peer = 2;  // activation of stage 0 sent to rank 2
  EXPECT_NE(simulate(s).error.find("lives on rank 1"), std::string::npos) << simulate(s).error;
}

// ---- layer split ----------------------------------------------------------------------------

std::vector<int> sizes(const std::vector<std::vector<LayerRange>>& split) {
  std::vector<int> out;  // in model-chunk order
  const int pp = int(split.size()), v = int(split[0].size());
  for (int c = 0; c < v; ++c)
    for (int r = 0; r < pp; ++r) out.push_back(split[r][c].size());
  return out;
}

void expect_contiguous(const std::vector<std::vector<LayerRange>>& split, int num_layers) {
  const int pp = int(split.size()), v = int(split[0].size());
  int next = 0;
  for (int c = 0; c < v; ++c)
    for (int r = 0; r < pp; ++r) {
      EXPECT_EQ(split[r][c].begin, next);
      next = split[r][c].end;
    }
  EXPECT_EQ(next, num_layers);
}

TEST(StageLayers, EvenSplit) {
  const auto s = stage_layers(8, 4, 1);
  EXPECT_EQ(s[0][0], (LayerRange{0, 2}));
  EXPECT_EQ(s[3][0], (LayerRange{6, 8}));
  expect_contiguous(s, 8);
}

TEST(StageLayers, InterleavedChunkMapping) {
  // Megatron: chunk c of rank r is model chunk c * pp + r.
  const auto s = stage_layers(16, 4, 2);
  EXPECT_EQ(s[0][0], (LayerRange{0, 2}));
  EXPECT_EQ(s[1][0], (LayerRange{2, 4}));
  EXPECT_EQ(s[0][1], (LayerRange{8, 10}));
  EXPECT_EQ(s[3][1], (LayerRange{14, 16}));
  expect_contiguous(s, 16);
}

TEST(StageLayers, UnevenFirstAndLast) {
  // 30 layers, pp 4: first 6, last 8, the middle two 8 each.
  auto s = stage_layers(30, 4, 1, 6, 8);
  EXPECT_EQ(sizes(s), (std::vector<int>{6, 8, 8, 8}));
  expect_contiguous(s, 30);
  // Only the first set: 14 = 2 + 4 * 3.
  s = stage_layers(14, 4, 1, 2, std::nullopt);
  EXPECT_EQ(sizes(s), (std::vector<int>{2, 4, 4, 4}));
  // Only the last set.
  s = stage_layers(10, 3, 1, std::nullopt, 2);
  EXPECT_EQ(sizes(s), (std::vector<int>{4, 4, 2}));
  // pp 2 with both set: they are the whole model.
  s = stage_layers(7, 2, 1, 3, 4);
  EXPECT_EQ(sizes(s), (std::vector<int>{3, 4}));
  // With v = 2: every rank's layers split evenly over its chunks, in model-chunk order
  // r0c0 r1c0 r2c0 r0c1 r1c1 r2c1.
  s = stage_layers(20, 3, 2, 4, 6);
  EXPECT_EQ(sizes(s), (std::vector<int>{2, 5, 3, 2, 5, 3}));
  expect_contiguous(s, 20);
  EXPECT_EQ(s[2][0], (LayerRange{7, 10}));
  EXPECT_EQ(s[0][1], (LayerRange{10, 12}));
}

TEST(StageLayers, ExplicitModelChunks) {
  // A pipeline layout, model chunk by model chunk: "E|ttt|tt|t|tt|ttL" at pp 3, v 2 - rank 0
  // holds chunks 0 and 3, its first with the embeddings alone.
  const auto s = stage_layers(11, 3, 2, std::nullopt, std::nullopt, {0, 3, 2, 1, 2, 3});
  EXPECT_EQ(sizes(s), (std::vector<int>{0, 3, 2, 1, 2, 3}));
  expect_contiguous(s, 11);
  EXPECT_EQ(s[0][0], (LayerRange{0, 0}));
  EXPECT_EQ(s[0][1], (LayerRange{5, 6}));
  EXPECT_EQ(s[2][1], (LayerRange{8, 11}));
  // The head's chunk may hold no layer either.
  EXPECT_EQ(sizes(stage_layers(4, 2, 1, std::nullopt, std::nullopt, {4, 0})),
            (std::vector<int>{4, 0}));
}

void expect_config_error(auto&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no ConfigError; expected one mentioning: " << needle;
  } catch (const ConfigError& e) {
    EXPECT_NE(e.message().find(needle), std::string::npos) << e.message();
  }
}

TEST(StageLayers, BadLayouts) {
  expect_config_error(
      [] {
        stage_layers(8, 2, 1, std::nullopt, std::nullopt, {4, 3});
      },
      "the pipeline layout places 7 layers; --num-layers is 8");
  expect_config_error(
      [] {
        stage_layers(8, 2, 2, std::nullopt, std::nullopt, {4, 4});
      },
      "the pipeline layout has 2 stages; --pipeline-model-parallel-size (2) × "
      "virtual stages per rank (2) is 4");
  expect_config_error(
      [] {
        stage_layers(8, 2, 2, std::nullopt, std::nullopt, {4, 0, 4, 0});
      },
      "stage 1 holds 0 layers");
  expect_config_error(
      [] {
        stage_layers(8, 2, 1, 4, std::nullopt, {4, 4});
      },
      "excludes --decoder-first-pipeline-num-layers");
  expect_config_error([] { stage_layers(10, 4, 1); },
                      "--num-layers (10) must be divisible by --pipeline-model-parallel-size (4)");
  expect_config_error([] { stage_layers(12, 4, 2); },
                      "layers per pipeline stage (3) must be divisible by "
                      "--num-virtual-stages-per-pipeline-rank (2)");
  expect_config_error([] { stage_layers(8, 1, 2); },
                      "--num-virtual-stages-per-pipeline-rank (2) > 1 needs "
                      "--pipeline-model-parallel-size > 1");
  expect_config_error([] { stage_layers(15, 4, 1, 2, 2); },
                      "leaves 11 layers, which must split evenly");
  expect_config_error([] { stage_layers(20, 3, 2, 3, 5); },
                      "--decoder-first-pipeline-num-layers (3) must be divisible by "
                      "--num-virtual-stages-per-pipeline-rank (2)");
  expect_config_error([] { stage_layers(21, 3, 2, 4, 5); },
                      "--decoder-last-pipeline-num-layers (5) must be divisible by "
                      "--num-virtual-stages-per-pipeline-rank (2)");
  expect_config_error([] { stage_layers(8, 2, 1, 3, 4); }, "must equal --num-layers (8)");
  expect_config_error([] { stage_layers(8, 4, 1, 0, std::nullopt); },
                      "--decoder-first-pipeline-num-layers must be >= 1");
  expect_config_error([] { stage_layers(8, 1, 1, 2, std::nullopt); },
                      "need --pipeline-model-parallel-size > 1");
  expect_config_error([] { stage_layers(8, 4, 1, 6, 4); }, "exceed --num-layers (8)");
}

TEST(Schedule, BadLayouts) {
  expect_config_error([] { make_interleaved_1f1b(4, 6, 2); },
                      "number of microbatches (6) is not divisible by "
                      "--pipeline-model-parallel-size (4) when using the interleaved schedule");
  expect_config_error([] { make_interleaved_1f1b(4, 2, 2); }, "is not divisible by");
  expect_config_error([] { make_interleaved_1f1b(1, 4, 2); },
                      "--num-virtual-stages-per-pipeline-rank (2) > 1 needs "
                      "--pipeline-model-parallel-size > 1");
  expect_config_error([] { make_1f1b(4, 0); }, "number of microbatches");
  expect_config_error([] { make_gpipe(0, 4); }, "--pipeline-model-parallel-size must be >= 1");
  expect_config_error([] { make_interleaved_1f1b(2, 4, 0); },
                      "--num-virtual-stages-per-pipeline-rank must be >= 1");
}

}  // namespace
}  // namespace braid::engine
