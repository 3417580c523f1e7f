// Expert parallelism in the engine: a small mixture-of-experts model trained by the Trainer with
// its experts split over EP ranks (alone, and with data, tensor, pipeline and context parallelism
// around them; ZeRO-1 on and off; bucket reductions overlapped with the backward or not) equals the
// one-process model on the same global batch - every step's loss and gradient norm (which clips),
// and every parameter afterwards, gathered from all shards, stages and EP ranks. Expert buckets are
// reduced over the expert-DP group and dense ones over DP × CP, so the layouts where the two differ
// (expert-DP of 1 and of 2 ranks) test both.

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "braid/comm/launch.h"
#include "braid/comm/parallel_state.h"
#include "braid/engine/trainer.h"
#include "dp/parallel_test_models.h"
#include "tp/tp_test_util.h"

using namespace braid;
using namespace braid::engine;
using model::GPTModel;
using model::TransformerConfig;

namespace {

constexpr int kSteps = 4;
constexpr int64_t kGlobalRows = 24;  // splits over 1, 2, 3, 4, 6 and 8 DP ranks
constexpr int64_t kSeq = 16;

// 4 experts of which each token takes 2, a gated shared expert, the Switch load-balancing loss;
// layer 0 dense and layers 1..3 experts, so the flat buffer alternates dense and expert runs.
TransformerConfig moe() {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");  // 4 heads, 2 kv heads
  c.num_layers = 4;
  c.hidden_size = 32;
  c.ffn_hidden_size = 48;
  c.vocab_size = 96;
  c.make_vocab_size_divisible_by = 32;
  c.max_position_embeddings = kSeq;
  c.init_std = 0.1f;
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 24;
  c.moe_aux_loss_coeff = 0.01f;
  c.moe_z_loss_coeff = 0.01f;
  c.moe_shared_expert_intermediate_size = 16;
  c.moe_shared_expert_gate = true;
  c.moe_layers.assign(size_t(c.num_layers), 1);
  c.moe_layers[0] = 0;
  return c;
}

// DeepSeek-V3's router: sigmoid scores, the expert bias moved after every step by the token
// counts of every DP rank (the routing's, over all experts, on every EP rank alike).
TransformerConfig biased_moe() {
  TransformerConfig c = moe();
  c.moe_router_score_function = model::MoeScoreFunction::sigmoid;
  c.moe_router_enable_expert_bias = true;
  c.moe_router_bias_update_rate = 0.05f;
  return c;
}

// DeepSeek-V3's per-sequence balancing loss at two rows per microbatch, so that sequence-
// parallel shards hold whole sequences (tp 2; under cp 2 whole chunks) or part of one (tp 4).
TransformerConfig sequence_moe() {
  TransformerConfig c = moe();
  c.moe_router_load_balancing_type = model::MoeLoadBalancing::seq_aux_loss;
  return c;
}

// And token dropping (capacity factor 1, the first tokens kept), whose capacity is the
// microbatch's. (By position: dropping by probability would compare different tokens'
// probabilities at each capacity, where the layouts' last-bit differences may break a near tie
// the other way.)
TransformerConfig dropping_moe() {
  TransformerConfig c = sequence_moe();
  c.moe_expert_capacity_factor = 1.0;
  c.moe_token_drop_policy = model::MoeTokenDropPolicy::position;
  return c;
}

// An MTP depth after the last layer: an expert layer of its own, with its expert bias.
TransformerConfig mtp_moe() {
  TransformerConfig c = biased_moe();
  c.mtp_num_layers = 1;
  return c;
}

// GPT-OSS's layers: biases everywhere, the router's too (with whole experts each TP rank's share
// of its gradient, summed over TP), learnable attention sinks, quick GEGLU with offset and clamp.
TransformerConfig gpt_oss_moe() {
  TransformerConfig c = moe();
  c.add_bias_linear = true;
  c.softmax_type = model::SoftmaxType::learnable;
  c.activation = model::Activation::quick_geglu;
  c.glu_linear_offset = 1.0f;
  c.activation_clamp = 0.3f;
  return c;
}

TransformerConfig config_named(const std::string& name) {
  if (name == "gpt_oss") return gpt_oss_moe();
  if (name == "mtp") return mtp_moe();
  if (name == "dropping") return dropping_moe();
  if (name == "sequence") return sequence_moe();
  return name == "biased" ? biased_moe() : moe();
}

int64_t microbatch_rows(const std::string& name) {
  return name == "dropping" || name == "sequence" ? 2 : 1;
}

TrainerConfig trainer_config() { return parallel_testing::trainer_config(kSteps); }

// Step s's global batch; row r ignores its last (r % 3) targets.
tp_testing::Batch global_batch(int64_t vocab, int step) {
  tp_testing::Batch b = tp_testing::batch(kGlobalRows, kSeq, vocab, 300 + uint64_t(step));
  int32_t* t = b.targets.data_ptr<int32_t>();
  for (int64_t r = 0; r < kGlobalRows; ++r)
    for (int64_t j = kSeq - r % 3; j < kSeq; ++j) t[r * kSeq + j] = -1;
  return b;
}

std::vector<float> floats(const Tensor& t) {
  const Tensor f = t.to(Device::cpu());
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

struct Run {
  std::vector<float> losses, grad_norms;
  std::vector<double> balancing_losses, z_losses;  // the router losses the step reports
  std::vector<std::vector<double>> mtp_losses;     // per step, per MTP depth
  std::vector<float> params;                       // the whole model's flat buffer after the steps
  float params_norm = 0;
};

// The one-process trainer, one row per microbatch (computed once per model, on every rank).
const Run& reference(const std::string& name) {
  static std::map<std::string, Run> cache;
  if (cache.count(name) > 0) return cache[name];
  Run& run = cache[name];
  const TransformerConfig config = config_named(name);
  GPTModel model(config, Device::cpu(), 7);
  const TrainerConfig t = trainer_config();
  Trainer trainer(model, t.optimizer, t.schedule);
  for (int s = 0; s < kSteps; ++s) {
    const tp_testing::Batch b = global_batch(config.vocab_size, s);
    const StepStats stats =
        trainer.train_step(b.ids, b.targets, int(kGlobalRows / microbatch_rows(name)));
    run.losses.push_back(stats.loss);
    run.grad_norms.push_back(stats.grad_norm);
    run.balancing_losses.push_back(stats.load_balancing_loss);
    run.z_losses.push_back(stats.z_loss);
    run.mtp_losses.push_back(stats.mtp_losses);
    // The clip engages: the norm decides the step.
    EXPECT_GT(stats.grad_norm, t.optimizer.clip_grad) << "step " << s + 1;
  }
  run.params = floats(model.flat_params());
  run.params_norm = trainer.optimizer().params_norm();
  return run;
}

struct Layout {
  int tp = 1, pp = 1, dp = 1, cp = 1, ep = 1;
  int etp = 0;  // 0: tp (experts split over TP); 1: whole experts
  bool zero = false;
  bool overlap = false;
  std::string str() const {
    return "tp " + std::to_string(tp) + " pp " + std::to_string(pp) + " dp " + std::to_string(dp) +
           " cp " + std::to_string(cp) + " ep " + std::to_string(ep) + (etp == 1 ? " etp 1" : "") +
           (zero ? " zero" : "") + (overlap ? " overlap" : "");
  }
};

// The buckets keep experts apart and each is reduced over its own group.
void check_buckets(const ParallelModel& model, const comm::ParallelState& state, const Layout& l) {
  for (int c = 0; c < model.num_chunks(); ++c) {
    SCOPED_TRACE("chunk " + std::to_string(c));
    const GradBuffer& buffer = model.grad_buffer(c);
    const model::ParamLayout& layout = model.chunk(c).layout();
    int experts = 0;
    for (const Bucket& b : buffer.buckets()) {
      for (size_t p : b.params)
        EXPECT_EQ(layout.specs[p].expert >= 0, b.expert)
            << layout.specs[p].name << " in bucket [" << b.range.begin << ", " << b.range.end
            << ")";
      experts += b.expert;
      EXPECT_EQ(buffer.group(b), b.expert
                                     ? (state.grid().expert_dp() > 1 ? &state.expert_dp() : nullptr)
                                     : (l.dp * l.cp > 1 ? &state.dp_cp() : nullptr));
    }
    // Every chunk but the first pipeline stage's holds expert layers (layer 0 is dense).
    if (model.chunk(c).chunk().end_layer > 1) {
      EXPECT_GT(experts, 0);
    }
    // Every bucket with a group was reduced once; with overlap, each posted by the backward.
    size_t reduced = 0;
    for (const Bucket& b : buffer.buckets()) reduced += buffer.group(b) != nullptr;
    EXPECT_EQ(buffer.reduce_spans().size(), reduced);
    for (const GradBuffer::Span& span : buffer.reduce_spans())
      EXPECT_EQ(span.during_backward, l.overlap) << "bucket " << span.bucket;
    // ZeRO: expert buckets are sharded over the expert-DP ranks.
    if (l.zero) {
      const std::vector<ElementRange> owned = buffer.owned_ranges();
      ASSERT_EQ(owned.size(), buffer.buckets().size());
      for (size_t i = 0; i < owned.size(); ++i) {
        const Bucket& b = buffer.buckets()[buffer.buckets().size() - 1 - i];
        EXPECT_EQ(owned[i].size() * (b.expert ? state.grid().expert_dp() : l.dp * l.cp),
                  b.range.size());
      }
    }
  }
}

void check_layout(const std::string& name, const Layout& l) {
  SCOPED_TRACE(name + " " + l.str());
  const TransformerConfig config = config_named(name);
  const Run& want = reference(name);
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  ASSERT_EQ(world->size(), l.tp * l.pp * l.dp * l.cp);
  comm::ParallelState state(
      world, {.tp = l.tp, .pp = l.pp, .dp = l.dp, .cp = l.cp, .ep = l.ep, .etp = l.etp});
  ParallelConfig parallel;
  parallel.sequence_parallel = l.tp > 1;
  parallel.ddp.use_distributed_optimizer = l.zero;
  parallel.ddp.overlap_grad_reduce = l.overlap;
  parallel.ddp.overlap_param_gather = l.zero && l.overlap;
  parallel.ddp.bucket_size = l.overlap ? 1500 : 0;  // several buckets of each kind when overlapped
  ParallelModel model(config, Device::cpu(), 7, state, parallel);
  for (int c = 0; c < model.num_chunks(); ++c) {
    const int per_rank = int(config.num_experts) / l.ep;
    EXPECT_EQ(model.chunk(c).chunk().first_expert, state.ep_rank() * per_rank);
    EXPECT_EQ(model.chunk(c).chunk().end_expert, (state.ep_rank() + 1) * per_rank);
    EXPECT_EQ(model.chunk(c).chunk().whole_experts, l.etp == 1 && l.tp > 1);
  }
  Trainer trainer(model, trainer_config());

  const int64_t rows = kGlobalRows / l.dp;  // this DP rank's share
  for (int s = 0; s < kSteps; ++s) {
    const tp_testing::Batch b = global_batch(config.vocab_size, s);
    const int64_t first = state.dp_rank() * rows;
    const StepStats stats =
        trainer.train_step(b.ids.narrow(first, rows).clone(), b.targets.narrow(first, rows).clone(),
                           int(rows / microbatch_rows(name)));
    EXPECT_FALSE(stats.skipped);
    if (s == 0) check_buckets(model, state, l);
    EXPECT_NEAR(stats.loss, want.losses[size_t(s)], 2e-5 * std::abs(want.losses[size_t(s)]))
        << "step " << s + 1;
    EXPECT_NEAR(stats.grad_norm, want.grad_norms[size_t(s)], 1e-5 * want.grad_norms[size_t(s)])
        << "step " << s + 1;
    EXPECT_NEAR(stats.load_balancing_loss, want.balancing_losses[size_t(s)],
                1e-5 * want.balancing_losses[size_t(s)])
        << "step " << s + 1;
    EXPECT_NEAR(stats.z_loss, want.z_losses[size_t(s)], 1e-5 * want.z_losses[size_t(s)])
        << "step " << s + 1;
    ASSERT_EQ(stats.mtp_losses.size(), want.mtp_losses[size_t(s)].size());
    for (size_t k = 0; k < stats.mtp_losses.size(); ++k) {
      const double w = want.mtp_losses[size_t(s)][k];
      EXPECT_NEAR(stats.mtp_losses[k], w, 2e-5 * w) << "step " << s + 1 << " MTP depth " << k + 1;
    }
  }
  EXPECT_NEAR(trainer.optimizer().params_norm(), want.params_norm, 1e-5 * want.params_norm);
  GPTModel whole(config, Device::cpu(), 1);
  model.gather_into(whole);
  const std::vector<float> got = floats(whole.flat_params());
  ASSERT_EQ(got.size(), want.params.size());
  const auto& layout = whole.layout();
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    const size_t at = size_t(layout.offsets[i]), n = size_t(layout.specs[i].shape.numel());
    const std::vector<float> a(got.begin() + long(at), got.begin() + long(at + n));
    const std::vector<float> b(want.params.begin() + long(at), want.params.begin() + long(at + n));
    // k_proj's bias: see test_data_parallel.cpp (its true gradient is 0; llama has none).
    EXPECT_LE(tp_testing::excess(a, b, 1e-5, 1e-4), 0.0)
        << layout.specs[i].name << " after " << kSteps << " steps";
  }
  world->barrier()->wait();
}

void check_layout(const Layout& l) {
  check_layout("moe", l);
  check_layout("biased", l);
  // Under CP each rank drops by its own tokens' capacity, as Megatron does: not the one process's.
  if (kGlobalRows / l.dp % microbatch_rows("dropping") == 0)
    check_layout(l.cp == 1 ? "dropping" : "sequence", l);
}

int world_size() { return comm::init_distributed().world->size(); }

// Two EP ranks, each its own expert-DP group: experts' gradients are not summed at all.
TEST(ExpertParallelEqualsOneRank, TwoRanks) {
  if (world_size() != 2) GTEST_SKIP() << "runs on 2 ranks";
  for (bool zero : {false, true})
    for (bool overlap : {false, true})
      check_layout({.dp = 2, .ep = 2, .zero = zero, .overlap = overlap});
}

TEST(ExpertParallelEqualsOneRank, FourRanks) {
  if (world_size() != 4) GTEST_SKIP() << "runs on 4 ranks";
  for (bool zero : {false, true}) {
    // Expert-DP groups of 2 ranks ([0, 2] and [1, 3]) beside the DP group of 4.
    for (bool overlap : {false, true})
      check_layout({.dp = 4, .ep = 2, .zero = zero, .overlap = overlap});
    check_layout({.dp = 4, .ep = 4, .zero = zero, .overlap = true});
    // Tensor parallelism inside each EP rank; pipeline stages around them.
    check_layout({.tp = 2, .dp = 2, .ep = 2, .zero = zero, .overlap = zero});
    check_layout({.pp = 2, .dp = 2, .ep = 2, .zero = zero, .overlap = true});
    // Context parallelism: an EP group takes the CP ranks first (ep 2: the CP pair, which reads
    // the same rows), and ep 4 spans both DP ranks' CP pairs.
    check_layout({.dp = 2, .cp = 2, .ep = 2, .zero = zero, .overlap = true});
    check_layout({.dp = 2, .cp = 2, .ep = 4, .zero = zero, .overlap = !zero});
  }
}

TEST(ExpertParallelEqualsOneRank, EightRanks) {
  if (world_size() != 8) GTEST_SKIP() << "runs on 8 ranks";
  check_layout({.tp = 2, .pp = 2, .dp = 2, .ep = 2, .zero = true, .overlap = true});
  check_layout({.tp = 2, .dp = 4, .ep = 2, .zero = false, .overlap = true});
  check_layout({.dp = 8, .ep = 4, .zero = true, .overlap = true});
  check_layout({.tp = 2, .dp = 2, .cp = 2, .ep = 2, .zero = true, .overlap = true});
}

// Whole experts (--expert-tensor-parallel-size 1): each TP rank routes its sequence-parallel
// tokens through whole experts, EP groups span TP ranks, and expert-DP groups (the TP pair with
// ep 1) differ from the DP ones, down to a DP group of one rank.
TEST(ExpertParallelEqualsOneRank, WholeExpertsTwoRanks) {
  if (world_size() != 2) GTEST_SKIP() << "runs on 2 ranks";
  for (bool zero : {false, true}) {
    check_layout({.tp = 2, .ep = 2, .etp = 1, .zero = zero, .overlap = !zero});
    check_layout({.tp = 2, .ep = 1, .etp = 1, .zero = zero, .overlap = zero});
  }
}

TEST(ExpertParallelEqualsOneRank, WholeExpertsFourRanks) {
  if (world_size() != 4) GTEST_SKIP() << "runs on 4 ranks";
  for (bool zero : {false, true}) {
    check_layout({.tp = 2, .dp = 2, .ep = 4, .etp = 1, .zero = zero, .overlap = true});
    check_layout({.tp = 2, .dp = 2, .ep = 2, .etp = 1, .zero = zero, .overlap = !zero});
    check_layout({.tp = 2, .pp = 2, .ep = 2, .etp = 1, .zero = zero, .overlap = true});
    check_layout({.tp = 2, .cp = 2, .ep = 4, .etp = 1, .zero = zero, .overlap = zero});
    check_layout({.tp = 4, .ep = 2, .etp = 1, .zero = zero, .overlap = true});
  }
  check_layout("gpt_oss", {.tp = 2, .dp = 2, .ep = 2, .etp = 1, .zero = true, .overlap = true});
  check_layout("gpt_oss", {.tp = 2, .cp = 2, .ep = 4, .etp = 1, .zero = false, .overlap = false});
}

// An MTP depth whose layer has experts (and an expert bias): on the last stage, its experts
// spread over the EP ranks like the others', split over TP or whole.
TEST(ExpertParallelEqualsOneRank, MultiTokenPredictionFourRanks) {
  if (world_size() != 4) GTEST_SKIP() << "runs on 4 ranks";
  check_layout("mtp", {.pp = 2, .dp = 2, .ep = 2, .zero = true, .overlap = true});
  check_layout("mtp", {.tp = 2, .dp = 2, .ep = 2, .zero = false, .overlap = true});
  check_layout("mtp", {.tp = 2, .dp = 2, .ep = 4, .etp = 1, .zero = true, .overlap = true});
  check_layout("mtp", {.dp = 2, .cp = 2, .ep = 4, .zero = true, .overlap = false});
}

TEST(ExpertParallelEqualsOneRank, WholeExpertsEightRanks) {
  if (world_size() != 8) GTEST_SKIP() << "runs on 8 ranks";
  check_layout({.tp = 2, .pp = 2, .dp = 2, .ep = 4, .etp = 1, .zero = true, .overlap = true});
  check_layout({.tp = 4, .dp = 2, .ep = 4, .etp = 1, .zero = false, .overlap = true});
}

// Whole experts are refused where their gradients could not be summed (a one-process Trainer
// over a TP model), and a per-sequence loss whose TP shards would split sequences unevenly is a
// ConfigError before the step's first collective; a dense model ignores expert TP 1.
TEST(WholeExperts, RefusedWhereTheyCannotWork) {
  if (world_size() != 2) GTEST_SKIP() << "runs on 2 ranks";
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  GPTModel direct(moe(), Device::cpu(), 7, model::TensorParallel{world.get(), true}, {}, 0, {},
                  model::ExpertParallel{nullptr, true});
  EXPECT_THROW(Trainer(direct, trainer_config().optimizer, trainer_config().schedule),
               braid::Error);

  comm::ParallelState state(world, {.tp = 2, .ep = 2, .etp = 1});
  ParallelConfig parallel;
  parallel.sequence_parallel = true;
  {
    ParallelModel model(dropping_moe(), Device::cpu(), 7, state, parallel);
    Trainer trainer(model, trainer_config());
    const tp_testing::Batch b = global_batch(model.config().vocab_size, 0);
    try {  // 3 sequences a microbatch: rank 0's 24 tokens end in the middle of the second
      trainer.train_step(b.ids.narrow(0, 3).clone(), b.targets.narrow(0, 3).clone(), 1);
      ADD_FAILURE() << "no ConfigError";
    } catch (const braid::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--micro-batch-size 3 gives 3 sequences"),
                std::string::npos)
          << e.what();
    }
  }
  TransformerConfig dense = moe();
  dense.num_experts = 0;
  dense.moe_layers.clear();
  dense.moe_shared_expert_intermediate_size = 0;
  dense.moe_shared_expert_gate = false;
  dense.moe_aux_loss_coeff = dense.moe_z_loss_coeff = 0;
  parallel.sequence_parallel = false;  // whole experts would need it
  comm::ParallelState folded(world, {.tp = 2, .etp = 1});
  ParallelModel model(dense, Device::cpu(), 7, folded, parallel);
  EXPECT_FALSE(model.chunk(0).expert_parallel().whole_experts);
  EXPECT_FALSE(model.chunk(0).chunk().whole_experts);
  world->barrier()->wait();
}

// Six ranks: dp·cp does not divide the 64-element parameter alignment, so only the expert
// alignment (ModelChunk::expert_alignment) gives the buckets a boundary between the kinds.
TEST(ExpertParallelEqualsOneRank, SixRanks) {
  if (world_size() != 6) GTEST_SKIP() << "runs on 6 ranks";
  check_layout({.dp = 6, .ep = 2, .zero = true, .overlap = true});
  check_layout({.dp = 3, .cp = 2, .ep = 2, .zero = false, .overlap = true});
}

}  // namespace
