// Tensor (and sequence) parallelism as real MPI jobs: with tp = the job's size, GPT-2 and
// Llama (GQA) models give the single-rank model's loss and every gradient (gathered to the
// global shape), and its parameters after 3 AdamW steps, within f32 tolerance; the TP group
// carries exactly the collectives Megatron's design implies; bad layouts fail alike on every
// rank before any collective.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "braid/comm/launch.h"
#include "braid/engine/adamw.h"
#include "tp_test_util.h"

using namespace braid;
using namespace braid::model;
using namespace braid::tp_testing;

namespace {

TransformerConfig gpt2() {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");  // 4 heads, ffn 256
  c.hidden_size = 32;
  c.ffn_hidden_size = 64;
  c.vocab_size = 200;  // 2 ranks' slices hold real rows, 4 ranks' last two only padding
  c.make_vocab_size_divisible_by = 64;
  c.max_position_embeddings = 16;
  c.hidden_dropout = 0.1f;     // sequence-parallel shards must draw the single-rank masks
  c.attention_dropout = 0.2f;  // and each rank its heads' single-rank masks
  c.init_std = 0.1f;
  return c;
}

TransformerConfig llama() {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");  // 4 heads, 2 kv heads
  c.hidden_size = 32;
  c.ffn_hidden_size = 48;
  c.vocab_size = 120;  // with tp > 1 the last rank's vocabulary slice is all padding
  c.make_vocab_size_divisible_by = 64;
  c.max_position_embeddings = 16;
  c.init_std = 0.1f;
  return c;
}

// Qwen3's attention: a norm on each query and key head, whose weights every TP rank holds
// while normalising only its own heads.
TransformerConfig qk_norm() {
  TransformerConfig c = llama();
  c.qk_layernorm = true;
  return c;
}

// Qwen2's: biases on q, k and v alone, split over TP with their weights.
TransformerConfig qkv_bias() {
  TransformerConfig c = llama();
  c.add_qkv_bias = true;
  return c;
}

// Qwen3-0.6B's shape: heads wider than hidden / heads (kv_channels), with q/k norms.
TransformerConfig wide_heads() {
  TransformerConfig c = qk_norm();
  c.kv_channels = 16;  // 4 heads of 16: attention 64 wide on a hidden size of 32
  return c;
}

// Mixtral's MLP: top-2 of 4 experts, each split over TP like the dense MLP, with the
// load-balancing loss and Qwen2-MoE's gated shared expert; and GPT-2 style experts (gelu,
// biases) with the softmax over all first and an ungated shared expert.
TransformerConfig experts() {
  TransformerConfig c = llama();
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 16;
  c.moe_aux_loss_coeff = 0.1f;
  c.moe_shared_expert_intermediate_size = 32;  // split over TP; its gate replicated
  c.moe_shared_expert_gate = true;
  c.moe_layers.assign(size_t(c.num_layers), 1);
  c.moe_layers[0] = 0;  // a dense first layer
  return c;
}

TransformerConfig gelu_experts() {
  TransformerConfig c = gpt2();
  c.num_experts = 3;
  c.moe_router_topk = 1;
  c.moe_router_pre_softmax = true;
  c.moe_aux_loss_coeff = 0.05f;
  c.moe_shared_expert_intermediate_size = 16;
  return c;
}

// DeepSeek-V3's router: sigmoid scores with the auxiliary-loss-free expert bias (moved after
// every step below), the choice among the best of 2 groups, probabilities scaled; the z-loss
// and the per-sequence load-balancing loss.
TransformerConfig sigmoid_experts() {
  TransformerConfig c = experts();
  c.moe_router_score_function = MoeScoreFunction::sigmoid;
  c.moe_router_enable_expert_bias = true;
  c.moe_router_bias_update_rate = 0.05f;
  c.moe_router_num_groups = 2;
  c.moe_router_group_topk = 1;
  c.moe_router_topk_scaling_factor = 2.5f;
  c.moe_z_loss_coeff = 0.01f;
  c.moe_router_load_balancing_type = MoeLoadBalancing::seq_aux_loss;
  c.moe_shared_expert_gate = false;
  return c;
}

// Token dropping: every expert keeps its capacity of the tokens, by probability (and, below,
// by position) - the same tokens on every TP rank, as the whole microbatch is routed alike.
TransformerConfig dropping_experts() {
  TransformerConfig c = experts();
  c.moe_expert_capacity_factor = 0.75f;
  return c;
}

TransformerConfig position_dropping_experts() {
  TransformerConfig c = gelu_experts();
  c.moe_expert_capacity_factor = 0.5f;
  c.moe_token_drop_policy = MoeTokenDropPolicy::position;
  return c;
}

// DeepSeek-V3's multi-latent attention: down projections and latent norms replicated over TP,
// the up projections split by heads, value heads narrower than the query/key heads; with
// DeepSeek's routed experts. And DeepSeek-V2-Lite's, without a query latent or latent norms.
TransformerConfig latent_attention() {
  TransformerConfig c = sigmoid_experts();
  c.num_query_groups = 0;
  c.multi_latent_attention = true;
  c.q_lora_rank = 12;
  c.kv_lora_rank = 10;
  c.qk_head_dim = 6;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 8;
  c.qk_layernorm = true;
  return c;
}

TransformerConfig latent_attention_no_q_latent() {
  TransformerConfig c = llama();
  c.num_query_groups = 0;
  c.multi_latent_attention = true;
  c.q_lora_rank = 0;
  c.kv_lora_rank = 12;
  c.qk_head_dim = 8;
  c.qk_pos_emb_head_dim = 8;
  c.v_head_dim = 16;
  c.hidden_dropout = 0.1f;
  c.attention_dropout = 0.2f;
  return c;
}

// GPT-OSS's layer: learnable attention sinks split by heads, biases on the router and the
// experts, quick GEGLU with the offset and a clamp that some activations reach, alternating
// windowed and full layers.
TransformerConfig gpt_oss() {
  TransformerConfig c = experts();
  c.add_bias_linear = true;
  c.softmax_type = SoftmaxType::learnable;
  c.activation = Activation::quick_geglu;
  c.glu_linear_offset = 1.0f;
  c.activation_clamp = 0.3f;
  c.moe_shared_expert_intermediate_size = 0;
  c.moe_shared_expert_gate = false;
  c.window_size = 3;
  c.window_layers = std::vector<int64_t>(size_t(c.num_layers), 0);
  c.window_layers[0] = 1;
  return c;
}

std::vector<float> global_of_reference(const GPTModel& reference, size_t i, const Tensor& flat) {
  const int64_t n = reference.layout().specs[i].shape.numel();
  const float* p = flat.data_ptr<float>() + reference.layout().offsets[i];
  return std::vector<float>(p, p + n);
}

struct Case {
  const char* name;
  TransformerConfig (*config)();
  bool sequence_parallel;
};

const Case kCases[] = {{"gpt2", gpt2, false},
                       {"gpt2_sp", gpt2, true},
                       {"llama_gqa", llama, false},
                       {"llama_gqa_sp", llama, true},
                       {"qk_norm", qk_norm, false},
                       {"qk_norm_sp", qk_norm, true},
                       {"qkv_bias", qkv_bias, false},
                       {"wide_heads_sp", wide_heads, true},
                       {"experts", experts, false},
                       {"experts_sp", experts, true},
                       {"gelu_experts_sp", gelu_experts, true},
                       {"sigmoid_experts_sp", sigmoid_experts, true},
                       {"dropping_experts_sp", dropping_experts, true},
                       {"position_dropping_experts", position_dropping_experts, false},
                       {"latent_attention", latent_attention, false},
                       {"latent_attention_sp", latent_attention, true},
                       {"latent_attention_no_q_latent_sp", latent_attention_no_q_latent, true},
                       {"gpt_oss", gpt_oss, false},
                       {"gpt_oss_sp", gpt_oss, true}};

class TensorParallelEqualsOneRank : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallelEqualsOneRank, LossGradientsAndThreeSteps) {
  const Case& c = GetParam();
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  const TransformerConfig config = c.config();
  const uint64_t seed = 1234;
  GPTModel reference(config, Device::cpu(), seed);
  GPTModel sharded(config, Device::cpu(), seed, TensorParallel{world.get(), c.sequence_parallel});
  const auto global = perturbed(reference);
  set_from_global(reference, global);
  set_from_global(sharded, global);
  const auto& specs = reference.layout().specs;

  // One step's loss and gradients, two microbatches.
  double loss_ref = 0, loss_tp = 0;
  for (int m = 0; m < 2; ++m) {
    const Batch b = batch(2, 8, config.vocab_size, 10 + m);
    loss_ref += reference.forward(b.ids, b.targets, m);
    loss_tp += sharded.forward(b.ids, b.targets, m);
    reference.backward(m, 0.5f);
    sharded.backward(m, 0.5f);
  }
  reference.finalize_grads();
  sharded.finalize_grads();
  EXPECT_NEAR(loss_tp, loss_ref, 1e-5 * std::abs(loss_ref));
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto want = global_of_reference(reference, i, reference.flat_grads());
    const auto got = gather_global(sharded, i, sharded.flat_grads(), world.get());
    EXPECT_LE(excess(got, want, 2e-6, 1e-4), 0.0) << specs[i].name << " gradient";
  }

  // Three AdamW steps (global-norm clipping on, so the norm must count every parameter once).
  // Adam divides by sqrt(v): where the true gradient is 0 or nearly (k_proj.bias: softmax
  // ignores it; an embedding row whose tokens' terms cancel) the rounding noise of either run
  // becomes a step of up to lr of random sign. eps bounds that amplification to lr·|dg|/eps;
  // the gradients' noise here is ~1e-7 absolute (sums of terms ~0.05, in another order under
  // TP), so eps = 1e-4 keeps it to ~1e-6 and the parameters compare at 1e-5 (they differ by
  // 1.2e-7 at most here, whichever OpenBLAS kernels; with eps = 1e-6, by 2.2e-5 in an embedding
  // row with the AVX-512 ones, 3e-6 over the tolerance). The larger eps
  // also keeps Adam from being blind to the gradients' scale: a wrong clipping factor moves
  // the parameters by ~lr·(change of c·|g| / (c·|g| + eps)), visible at 1e-5.
  engine::AdamWConfig opt;
  opt.lr = 1e-3f;
  opt.eps = 1e-4f;
  opt.clip_grad = 0.5f;
  engine::AdamW adam_ref(reference, opt), adam_tp(sharded, opt);
  int64_t moved_biases = 0;
  for (int step = 0; step < 3; ++step) {
    if (step > 0) {
      reference.zero_grad();
      sharded.zero_grad();
      const Batch b = batch(4, 8, config.vocab_size, 100 + step);
      // Sequences that start with the same token have bit-identical states there, so their
      // probabilities tie exactly and the drop policy's order decides; under sequence
      // parallelism the reduce-scatter sums their shards in different orders, which breaks
      // the tie by a last bit either way (step 1's batch has two sequences starting with 106).
      // Distinct first tokens keep the dropping cases' choices well apart.
      for (int64_t i = 0; i < b.ids.size(0); ++i)
        b.ids.data_ptr<int32_t>()[i * b.ids.size(1)] = int32_t(i);
      loss_ref = reference.forward(b.ids, b.targets);
      loss_tp = sharded.forward(b.ids, b.targets);
      EXPECT_NEAR(loss_tp, loss_ref, 1e-5 * std::abs(loss_ref)) << "step " << step;
      reference.backward();
      sharded.backward();
      reference.finalize_grads();
      sharded.finalize_grads();
    }
    const float norm_ref = adam_ref.clip_and_step();
    const float norm_tp = adam_tp.clip_and_step();
    EXPECT_NEAR(norm_tp, norm_ref, 1e-5 * norm_ref) << "step " << step;
    // Every TP rank counts the tokens of the whole batch: the biases move alike.
    reference.update_expert_bias(nullptr);
    sharded.update_expert_bias(nullptr);
    auto values = [](const Tensor& t) {
      return std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
    };
    for (size_t b = 0; b < reference.expert_biases().size(); ++b) {
      const std::vector<float> want = values(reference.expert_biases()[b].second);
      EXPECT_EQ(values(sharded.expert_biases()[b].second), want)
          << reference.expert_biases()[b].first << " after step " << step;
      moved_biases += std::count_if(want.begin(), want.end(), [](float v) { return v != 0; });
    }
  }
  EXPECT_EQ(moved_biases > 0, config.moe_router_enable_expert_bias);
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto want = global_of_reference(reference, i, reference.flat_params());
    const auto got = gather_global(sharded, i, sharded.flat_params(), world.get());
    EXPECT_LE(excess(got, want, 1e-5, 1e-4), 0.0) << specs[i].name << " after 3 steps";
  }
  // Evaluation logits, gathered from the vocabulary slices (padding dropped).
  const Batch eval = batch(2, 8, config.vocab_size, 77);
  const Tensor want = reference.logits(eval.ids), got = sharded.logits(eval.ids);
  ASSERT_EQ(got.shape(), want.shape());
  const float* w = want.data_ptr<float>();
  EXPECT_LE(excess(std::vector<float>(got.data_ptr<float>(), got.data_ptr<float>() + got.numel()),
                   std::vector<float>(w, w + want.numel()), 1e-5, 1e-4),
            0.0)
      << "logits";
}

INSTANTIATE_TEST_SUITE_P(Models, TensorParallelEqualsOneRank, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The collectives of one forward and backward, in order, against Megatron's analytic count:
// per layer 2 all-reduces of b·s·h forward and 2 backward; with sequence parallelism the same
// volume as all-gathers and reduce-scatters (backward also re-gathers the two norm outputs
// that forward kept as shards).
// Every TP rank routes with its own copy of the router; rank 0's choices are the group's. With
// every other rank's router negated (their own choices would be other experts), the loss is
// still the one-rank model's.
TEST(TensorParallelExperts, RoutingFollowsRankZero) {
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  if (world->size() == 1) GTEST_SKIP() << "one rank routes alone";
  TransformerConfig config = experts();
  config.moe_aux_loss_coeff = 0;
  GPTModel reference(config, Device::cpu(), 7);
  GPTModel sharded(config, Device::cpu(), 7, TensorParallel{world.get(), true});
  const auto global = perturbed(reference);
  set_from_global(reference, global);
  set_from_global(sharded, global);
  if (world->rank() != 0) {
    for (Parameter& p : sharded.parameters()) {
      if (!p.spec.name.ends_with("mlp.gate.weight")) continue;
      Tensor negated = p.value.clone();
      float* v = negated.data_ptr<float>();
      for (int64_t i = 0; i < negated.numel(); ++i) v[i] = -v[i];
      p.value.copy_from(negated);
    }
  }
  const Batch b = batch(2, 8, config.vocab_size, 31);
  const float want = reference.forward(b.ids, b.targets);
  EXPECT_NEAR(sharded.forward(b.ids, b.targets), want, 1e-5 * std::abs(want));
}

// The TP collectives of one forward and one backward of `config` on a [2, 8] batch, in order.
using Call = CountingCommunicator::Call;
std::pair<std::vector<Call>, std::vector<Call>> tp_calls(const TransformerConfig& config, bool sp) {
  auto counted = std::make_shared<CountingCommunicator>(comm::init_distributed().world);
  GPTModel model(config, Device::cpu(), 7, TensorParallel{counted.get(), sp});
  const Batch data = batch(2, 8, config.vocab_size, 3);
  counted->calls.clear();
  model.forward(data.ids, data.targets);
  const std::vector<Call> forward = counted->calls;
  counted->calls.clear();
  model.backward();
  return {forward, counted->calls};
}

TEST(TensorParallelCommunication, MatchesTheAnalyticCount) {
  if (comm::init_distributed().world->size() == 1) GTEST_SKIP() << "one rank communicates nothing";
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
    TransformerConfig config = gpt2();
    config.num_layers = 3;
    const auto [forward, backward] = tp_calls(config, sp);
    const int64_t t = 2 * 8, h = config.hidden_size;
    const size_t act = size_t(t * h) * 4, row = size_t(t) * 4;  // f32 bytes
    const Call ar{"all_reduce", act}, ag{"all_gather", act}, rs{"reduce_scatter", act};
    std::vector<Call> want_fwd{sp ? rs : ar};  // vocab-parallel embedding
    std::vector<Call> want_bwd;
    if (sp) want_bwd = {ag, rs};  // re-gather the final norm's output; dLoss/dh back to shards
    if (!sp) want_bwd = {ar};
    for (int l = 0; l < config.num_layers; ++l) {
      if (sp) {
        want_fwd.insert(want_fwd.end(), {ag, rs, ag, rs});
        want_bwd.insert(want_bwd.end(), {ag, ag, rs, ag, ag, rs});
      } else {
        want_fwd.insert(want_fwd.end(), {ar, ar});
        want_bwd.insert(want_bwd.end(), {ar, ar});
      }
    }
    if (sp) want_fwd.push_back(ag);  // the LM head's input
    want_fwd.insert(want_fwd.end(),
                    {{"all_reduce", row}, {"all_reduce", row}, {"all_reduce", row}});
    if (sp) want_bwd.push_back(ag);  // the embedding's output gradient
    EXPECT_EQ(forward, want_fwd);
    EXPECT_EQ(backward, want_bwd);
  }
}

// Multi-latent attention under SP runs its replicated down projections on each rank's tokens and
// all-gathers the latents, [q latent | kv latent | k_pe] (26 channels here against the hidden
// state's 32), in place of the hidden state; its backward reduce-scatters their gradients and
// needs no other TP collective (megatron-core's MLA under SP).
TEST(TensorParallelCommunication, LatentAttentionGathersItsLatents) {
  if (comm::init_distributed().world->size() == 1) GTEST_SKIP() << "one rank communicates nothing";
  TransformerConfig config = llama();
  config.num_layers = 2;
  config.num_query_groups = 0;
  config.multi_latent_attention = true;
  config.q_lora_rank = 12;
  config.kv_lora_rank = 10;
  config.qk_head_dim = 6;
  config.qk_pos_emb_head_dim = 4;
  config.v_head_dim = 8;
  config.qk_layernorm = true;
  const auto [forward, backward] = tp_calls(config, true);
  const int64_t t = 2 * 8, h = config.hidden_size;
  const size_t act = size_t(t * h) * 4, row = size_t(t) * 4;  // f32 bytes
  const size_t latents = size_t(t * (12 + 10 + 4)) * 4;
  const Call ag{"all_gather", act}, rs{"reduce_scatter", act};
  const Call ag_latents{"all_gather", latents}, rs_latents{"reduce_scatter", latents};
  std::vector<Call> want_fwd{rs}, want_bwd{ag, rs};
  for (int l = 0; l < config.num_layers; ++l) {
    want_fwd.insert(want_fwd.end(), {ag_latents, rs, ag, rs});
    want_bwd.insert(want_bwd.end(), {ag, ag, rs, ag, rs_latents});
  }
  want_fwd.insert(want_fwd.end(),
                  {ag, {"all_reduce", row}, {"all_reduce", row}, {"all_reduce", row}});
  want_bwd.push_back(ag);
  EXPECT_EQ(forward, want_fwd);
  EXPECT_EQ(backward, want_bwd);
}

TEST(TensorParallelLayout, BadSplitsFailAlikeOnEveryRankBeforeAnyCollective) {
  std::shared_ptr<comm::MpiCommunicator> world = comm::init_distributed().world;
  const int tp = world->size();
  if (tp == 1) GTEST_SKIP() << "every layout fits one rank";
  auto message = [&](TransformerConfig config, bool sp, int64_t seq) -> std::string {
    try {
      GPTModel model(config, Device::cpu(), 1, TensorParallel{world.get(), sp});
      const Batch b = batch(1, seq, config.vocab_size, 1);
      model.forward(b.ids, b.targets);
    } catch (const ConfigError& e) {
      return e.message();
    }
    return "";
  };
  TransformerConfig heads = gpt2();
  heads.num_attention_heads = 2 * tp + 1;
  heads.hidden_size = 8 * heads.num_attention_heads;
  EXPECT_NE(message(heads, false, 8).find("num_attention_heads"), std::string::npos);
  TransformerConfig ffn = gpt2();
  ffn.ffn_hidden_size = 64 * tp + 1;
  EXPECT_NE(message(ffn, false, 8).find("ffn_hidden_size"), std::string::npos);
  TransformerConfig kv = llama();
  kv.num_attention_heads = 6 * tp;
  kv.hidden_size = 4 * kv.num_attention_heads;
  kv.num_query_groups = 3;  // neither divides the other for tp = 2 or 4
  if (tp % 3 != 0) {
    EXPECT_NE(message(kv, false, 8).find("num_query_groups"), std::string::npos);
  }
  EXPECT_NE(message(gpt2(), true, tp + 1).find("sequence length"), std::string::npos);
  world->barrier()->wait();  // every rank got here: nothing was left half-communicated
}

}  // namespace
