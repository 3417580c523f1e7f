// Expert parallelism against the single-rank model, as real MPI jobs: the token all-to-all moves
// every routed row to the rank holding its expert and back, and a model whose experts are split
// over an EP group (alone, and with tensor parallelism inside it) computes, on each rank's own
// batch, the loss and gradients of the model that holds every expert - the experts' gradients
// summed over the group's batches, as the expert-data-parallel reduction then expects.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "braid/comm/launch.h"
#include "braid/model/expert_parallel.h"
#include "tp/tp_test_util.h"

using namespace braid;
using namespace braid::model;
using namespace braid::tp_testing;

namespace {

std::shared_ptr<comm::MpiCommunicator> world() { return comm::init_distributed().world; }

// Parameter i of the one-rank `reference`, from its flat buffer `flat` (params or grads).
std::vector<float> global_of_parameter(const GPTModel& reference, size_t i, const Tensor& flat) {
  const int64_t n = reference.layout().specs[i].shape.numel();
  const float* p = flat.data_ptr<float>() + reference.layout().offsets[i];
  return std::vector<float>(p, p + n);
}

// A routing of `rows[e]` rows to each expert e (only the offsets and the row count matter to the
// dispatch).
MoeRouting routing_of(const std::vector<int64_t>& rows) {
  MoeRouting r;
  r.offsets.assign(1, 0);
  for (int64_t n : rows) r.offsets.push_back(r.offsets.back() + n);
  r.row_token = Tensor::zeros({r.offsets.back()}, DType::i32);
  return r;
}

TEST(ExpertDispatch, RowsReachTheirExpertsInSourceOrderAndComeBack) {
  auto w = world();
  const int ep = w->size(), me = w->rank();
  const ExpertParallel group{w.get()};
  const int64_t experts = 2 * ep, width = 3;
  // Rank s routes (s + e) % 4 rows to expert e: some experts get none from some ranks.
  auto rows_of = [&](int s) {
    std::vector<int64_t> rows;
    for (int64_t e = 0; e < experts; ++e) rows.push_back((s + e) % 4);
    return rows;
  };
  const MoeRouting r = routing_of(rows_of(me));
  const int64_t n = r.offsets.back();
  // Row j of rank s holds s·1000 + j in every column.
  Tensor x = Tensor::empty({n, width}, DType::f32);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < width; ++c) x.data_ptr<float>()[j * width + c] = float(me * 1000 + j);

  const ExpertDispatch plan = plan_dispatch(r, group);
  ASSERT_EQ(plan.offsets.size(), size_t(experts / ep + 1));
  const Tensor local = dispatch_rows(x, plan, group);
  ASSERT_EQ(local.size(0), plan.rows());
  // Local expert e's rows: each source's rows of global expert me·2 + e, sources in rank order,
  // each source's in its routed order.
  int64_t at = 0;
  for (int64_t e = 0; e < experts / ep; ++e) {
    EXPECT_EQ(plan.offsets[size_t(e)], at);
    const int64_t global = me * (experts / ep) + e;
    for (int s = 0; s < ep; ++s) {
      const std::vector<int64_t> theirs = rows_of(s);
      int64_t first = 0;
      for (int64_t g = 0; g < global; ++g) first += theirs[size_t(g)];
      for (int64_t j = 0; j < theirs[size_t(global)]; ++j, ++at) {
        for (int64_t c = 0; c < width; ++c)
          ASSERT_EQ(local.data_ptr<float>()[at * width + c], float(s * 1000 + first + j))
              << "local expert " << e << ", source " << s << ", row " << j;
      }
    }
  }
  EXPECT_EQ(at, plan.rows());

  Tensor back = Tensor::zeros({n, width}, DType::f32);
  return_rows(back, local, plan, group);
  for (int64_t i = 0; i < n * width; ++i)
    ASSERT_EQ(back.data_ptr<float>()[i], x.data_ptr<float>()[i]) << "element " << i;
}

// A skewed routing: rank 0 routes every row to the last rank's experts, the others route
// nothing; so the last rank receives everything and the rest receive nothing, and every rank
// but 0 sends nothing - still the counts' all-gather and the (empty) exchanges meet.
TEST(ExpertDispatch, RanksThatSendOrReceiveNothing) {
  auto w = world();
  const int ep = w->size(), me = w->rank();
  const ExpertParallel group{w.get()};
  const int64_t experts = 2 * ep, width = 2;
  std::vector<int64_t> rows(size_t(experts), 0);
  if (me == 0) rows[size_t(experts - 1)] = 5;
  const MoeRouting r = routing_of(rows);
  Tensor x = Tensor::empty({r.offsets.back(), width}, DType::f32);
  for (int64_t i = 0; i < x.numel(); ++i) x.data_ptr<float>()[i] = float(i + 1);
  const ExpertDispatch plan = plan_dispatch(r, group);
  const Tensor local = dispatch_rows(x, plan, group);
  EXPECT_EQ(local.size(0), me == ep - 1 ? 5 : 0);
  EXPECT_EQ(plan.offsets.back(), local.size(0));
  if (me == ep - 1) {
    EXPECT_EQ(plan.offsets[1], 0);  // the first local expert got nothing
    for (int64_t i = 0; i < local.numel(); ++i) EXPECT_EQ(local.data_ptr<float>()[i], float(i + 1));
  }
  Tensor back = Tensor::zeros(x.shape(), DType::f32);
  return_rows(back, local, plan, group);
  for (int64_t i = 0; i < x.numel(); ++i)
    ASSERT_EQ(back.data_ptr<float>()[i], x.data_ptr<float>()[i]);
}

TransformerConfig experts() {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");  // 4 heads, 2 kv heads
  c.hidden_size = 32;
  c.ffn_hidden_size = 48;
  c.vocab_size = 120;
  c.make_vocab_size_divisible_by = 64;
  c.max_position_embeddings = 16;
  c.init_std = 0.1f;
  c.num_experts = 8;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 16;
  c.moe_aux_loss_coeff = 0.1f;
  c.moe_shared_expert_intermediate_size = 32;
  c.moe_shared_expert_gate = true;
  c.moe_layers.assign(size_t(c.num_layers), 1);
  c.moe_layers[0] = 0;  // a dense first layer
  return c;
}

// DeepSeek-V3's router and token dropping by position, with selective recomputation (which
// dispatches the experts' input again in the backward).
TransformerConfig dropping_sigmoid_experts() {
  TransformerConfig c = experts();
  c.moe_router_score_function = MoeScoreFunction::sigmoid;
  c.moe_router_enable_expert_bias = true;
  c.moe_router_bias_update_rate = 0.05f;
  c.moe_router_num_groups = 4;
  c.moe_router_group_topk = 2;
  c.moe_z_loss_coeff = 0.01f;
  c.moe_expert_capacity_factor = 0.75;
  c.moe_token_drop_policy = MoeTokenDropPolicy::position;
  c.recompute = Recompute::selective;
  return c;
}

struct Case {
  const char* name;
  TransformerConfig (*config)();
  int tp;  // TP inside each EP rank; EP is the rest of the world
  // A zero router: every score ties, and ties go to the lowest experts, so every token picks
  // experts 0 and 1 - EP rank 0's: the other ranks receive nothing and send everything.
  bool zero_router = false;
};

class ExpertParallelEqualsOneRank : public ::testing::TestWithParam<Case> {};

// The global value of each of `m`'s parameters, by name.
std::map<std::string, std::vector<float>> globals(const GPTModel& m, const Tensor& flat,
                                                  comm::Communicator* tp) {
  std::map<std::string, std::vector<float>> out;
  for (size_t i = 0; i < m.layout().specs.size(); ++i)
    out[m.layout().specs[i].name] = gather_global(m, i, flat, tp);
  return out;
}

TEST_P(ExpertParallelEqualsOneRank, LossAndGradients) {
  const Case& c = GetParam();
  auto w = world();
  if (w->size() % c.tp != 0 || w->size() / c.tp < 2) GTEST_SKIP() << "needs EP of 2 or more";
  const int tp_rank = w->rank() % c.tp, ep_rank = w->rank() / c.tp;
  // TP groups are neighbours; an EP group holds one TP rank of each.
  std::shared_ptr<comm::Communicator> tp_group = w->split(ep_rank, tp_rank, "tp");
  std::shared_ptr<comm::Communicator> ep_group = w->split(tp_rank, ep_rank, "ep");
  const TransformerConfig config = c.config();
  const uint64_t seed = 99;
  GPTModel reference(config, Device::cpu(), seed);
  GPTModel split(config, Device::cpu(), seed, TensorParallel{tp_group.get(), false}, {}, 0, {},
                 ExpertParallel{ep_group.get()});
  const int64_t per_rank = config.num_experts / ep_group->size();
  EXPECT_EQ(split.layout().chunk.first_expert, ep_rank * per_rank);
  EXPECT_EQ(split.layout().chunk.end_expert, (ep_rank + 1) * per_rank);

  // The same perturbed weights: by name, since the layouts differ.
  auto global = perturbed(reference);
  if (c.zero_router) {
    for (size_t i = 0; i < reference.layout().specs.size(); ++i)
      if (reference.layout().specs[i].name.ends_with("mlp.gate.weight"))
        std::fill(global[i].begin(), global[i].end(), 0.0f);
  }
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < reference.layout().specs.size(); ++i)
    index[reference.layout().specs[i].name] = i;
  std::vector<std::vector<float>> mine;
  for (const ParamSpec& spec : split.layout().specs) mine.push_back(global[index.at(spec.name)]);
  set_from_global(reference, global);
  set_from_global(split, mine);

  // Each EP rank its own batch (TP ranks of one EP rank the same one); two microbatches.
  double loss_ref = 0, loss_ep = 0;
  for (int m = 0; m < 2; ++m) {
    const Batch b = batch(2, 8, config.vocab_size, 10 + 7 * ep_rank + m);
    loss_ref += reference.forward(b.ids, b.targets, m);
    loss_ep += split.forward(b.ids, b.targets, m);
    reference.backward(m, 0.5f);
    split.backward(m, 0.5f);
  }
  reference.finalize_grads();
  split.finalize_grads();
  EXPECT_NEAR(loss_ep, loss_ref, 1e-5 * std::abs(loss_ref));

  // The reference's gradients summed over the EP ranks' batches (once per EP rank: TP rank 0's).
  Tensor summed = reference.flat_grads().clone();
  if (tp_rank != 0) summed.zero_();
  w->all_reduce(summed)->wait();
  const auto got = globals(split, split.flat_grads(), tp_group.get());
  int64_t experts_seen = 0;
  for (const ParamSpec& spec : split.layout().specs) {
    const size_t i = index.at(spec.name);
    const Tensor& source = spec.expert >= 0 ? summed : reference.flat_grads();
    const auto want = global_of_parameter(reference, i, source);
    EXPECT_LE(excess(got.at(spec.name), want, 2e-6, 1e-4), 0.0) << spec.name << " gradient";
    experts_seen +=
        spec.expert >= 0 && std::any_of(want.begin(), want.end(), [](float v) { return v != 0; });
  }
  if (c.zero_router) {
    EXPECT_EQ(experts_seen > 0, ep_rank == 0) << "only EP rank 0's experts take tokens";
  } else {
    EXPECT_GT(experts_seen, 0) << "no expert received a row";
  }

  // The expert biases move alike when both count every EP rank's tokens.
  reference.update_expert_bias(ep_group.get());
  split.update_expert_bias(ep_group.get());
  for (size_t b = 0; b < reference.expert_biases().size(); ++b) {
    const Tensor& want = reference.expert_biases()[b].second;
    const Tensor& have = split.expert_biases()[b].second;
    for (int64_t e = 0; e < want.numel(); ++e)
      EXPECT_EQ(have.data_ptr<float>()[e], want.data_ptr<float>()[e])
          << reference.expert_biases()[b].first << "[" << e << "]";
  }

  // Evaluation logits of each rank's own batch.
  const Batch eval = batch(2, 8, config.vocab_size, 77 + ep_rank);
  const Tensor want = reference.logits(eval.ids), have = split.logits(eval.ids);
  ASSERT_EQ(have.shape(), want.shape());
  const float* wp = want.data_ptr<float>();
  EXPECT_LE(
      excess(std::vector<float>(have.data_ptr<float>(), have.data_ptr<float>() + have.numel()),
             std::vector<float>(wp, wp + want.numel()), 1e-5, 1e-4),
      0.0)
      << "logits";
}

const Case kCases[] = {{"experts", experts, 1},
                       {"dropping_sigmoid_experts", dropping_sigmoid_experts, 1},
                       {"experts_tp2", experts, 2},
                       {"dropping_sigmoid_experts_tp2", dropping_sigmoid_experts, 2},
                       {"one_rank_takes_every_token", experts, 1, true}};

INSTANTIATE_TEST_SUITE_P(Models, ExpertParallelEqualsOneRank, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// KV-cache decoding needs every expert on the rank: refused, alike on every rank, before any
// collective (a rank would otherwise wait for peers that decode other prompts or none).
TEST(ExpertParallelLayout, DecodingIsRefused) {
  auto w = world();
  GPTModel split(experts(), Device::cpu(), 1, {}, {}, 0, {}, ExpertParallel{w.get()});
  KVCache cache = split.kv_cache(1);
  const Tensor ids = Tensor::zeros({1, 3}, DType::i32);
  try {
    split.decode(ids, cache);
    ADD_FAILURE() << "decoding under expert parallelism was not refused";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--expert-model-parallel-size 1"), std::string::npos)
        << e.what();
  }
}

TEST(ExpertParallelLayout, ExpertsMustSplitEvenly) {
  TransformerConfig c = experts();
  c.num_experts = 6;
  EXPECT_THROW(check_expert_parallel(c, 4), ConfigError);
  EXPECT_NO_THROW(check_expert_parallel(c, 3));
  c.num_experts = 0;
  EXPECT_THROW(check_expert_parallel(c, 2), ConfigError);
  EXPECT_NO_THROW(check_expert_parallel(c, 1));
}

}  // namespace
