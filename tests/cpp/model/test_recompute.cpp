// The three recompute policies, and full recomputation's methods (Megatron's uniform groups
// and block): bit-identical gradients, and exactly the activation memory each keeps.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "braid/core/stream.h"
#include "model_test_util.h"

namespace braid::model {
namespace {

using namespace testing_util;

struct Run {
  Tensor grads;  // host copy
  float loss = 0;
  int64_t kept_bytes = 0;  // held between the forward and the backward
  int64_t peak_activation_bytes = 0;
  int64_t leaked_bytes = 0;
  std::vector<double> moe;    // each layer's router losses, counted once whatever the policy
  std::vector<float> biases;  // every expert bias after its update: the tokens counted once
};

Run run_policy(TransformerConfig config, Recompute policy, const Batch& batch,
               RecomputeMethod method = RecomputeMethod::uniform, int64_t layers = 1) {
  config.recompute = policy;
  config.recompute_method = method;
  config.recompute_num_layers = layers;
  const Device device = testing::default_test_device();
  GPTModel model(config, device, 99);
  synchronize(device);
  const int64_t before = memory_stats(device).current_bytes;
  reset_peak_memory(device);
  Run run;
  run.loss = model.forward(batch.ids, batch.targets);
  synchronize(device);
  run.kept_bytes = memory_stats(device).current_bytes - before;
  model.backward();
  synchronize(device);
  const MemoryStats after = memory_stats(device);
  run.peak_activation_bytes = after.peak_bytes - before;
  run.leaked_bytes = after.current_bytes - before;
  run.grads = model.flat_grads().to(Device::cpu());
  for (const auto& [layer, losses] : model.take_moe_losses()) {
    run.moe.push_back(double(layer));
    run.moe.push_back(losses.load_balancing);
    run.moe.push_back(losses.z);
  }
  model.update_expert_bias(nullptr);
  for (const auto& [name, bias] : model.expert_biases()) {
    const Tensor host = bias.to(Device::cpu());
    run.biases.insert(run.biases.end(), host.data_ptr<float>(),
                      host.data_ptr<float>() + host.numel());
  }
  return run;
}

void check_policies(const TransformerConfig& config) {
  const Batch batch = make_batch(4, 32, config.vocab_size, 3);
  const Run none = run_policy(config, Recompute::none, batch);
  const Run selective = run_policy(config, Recompute::selective, batch);
  const Run full = run_policy(config, Recompute::full, batch);
  for (const Run* r : {&none, &selective, &full}) {
    EXPECT_EQ(r->leaked_bytes, 0) << "activations outlive backward";
    EXPECT_EQ(r->loss, none.loss);
    EXPECT_EQ(r->moe, none.moe);
    EXPECT_EQ(r->biases, none.biases);
  }
  const size_t bytes = none.grads.nbytes();
  EXPECT_EQ(0, std::memcmp(selective.grads.data(), none.grads.data(), bytes))
      << "selective recompute changed the gradients";
  EXPECT_EQ(0, std::memcmp(full.grads.data(), none.grads.data(), bytes))
      << "full recompute changed the gradients";
  EXPECT_GT(none.peak_activation_bytes, selective.peak_activation_bytes);
  EXPECT_GT(selective.peak_activation_bytes, full.peak_activation_bytes);
  ::testing::Test::RecordProperty("peak_none", std::to_string(none.peak_activation_bytes));
  ::testing::Test::RecordProperty("peak_selective",
                                  std::to_string(selective.peak_activation_bytes));
  ::testing::Test::RecordProperty("peak_full", std::to_string(full.peak_activation_bytes));
  std::printf("peak activation bytes: none %lld, selective %lld, full %lld\n",
              (long long)none.peak_activation_bytes, (long long)selective.peak_activation_bytes,
              (long long)full.peak_activation_bytes);
}

// Megatron's --recompute-method on a 4-layer chunk. What the forward keeps is exact: with I
// the bytes of one layer's input, full (uniform 1) keeps 4 I and uniform N ceil(4 / N) I;
// block k recomputes the first k layers (their input kept) and keeps everything of the others,
// so each further layer saves the same bytes, and block 4 keeps what full does. The
// gradients are bit-identical to none's for every method.
void check_methods(const TransformerConfig& config) {
  const Batch batch = make_batch(4, 32, config.vocab_size, 5);
  const Run none = run_policy(config, Recompute::none, batch);
  const Run full = run_policy(config, Recompute::full, batch);
  const int64_t layers = config.num_layers;
  const int64_t input = 4 * 32 * config.hidden_size * int64_t(dtype_size(config.params_dtype));
  const size_t bytes = none.grads.nbytes();
  std::vector<int64_t> block_kept;
  for (int64_t n = 1; n <= layers + 1; ++n) {
    SCOPED_TRACE("recompute_num_layers " + std::to_string(n));
    const Run uniform = run_policy(config, Recompute::full, batch, RecomputeMethod::uniform, n);
    const Run block = run_policy(config, Recompute::full, batch, RecomputeMethod::block, n);
    for (const Run* r : {&uniform, &block}) {
      EXPECT_EQ(r->leaked_bytes, 0) << "activations outlive backward";
      EXPECT_EQ(r->loss, none.loss);
      EXPECT_EQ(0, std::memcmp(r->grads.data(), none.grads.data(), bytes))
          << (r == &uniform ? "uniform" : "block") << " recompute changed the gradients";
    }
    const int64_t groups = (layers + n - 1) / n;
    EXPECT_EQ(uniform.kept_bytes, full.kept_bytes - (layers - groups) * input);
    block_kept.push_back(block.kept_bytes);
  }
  const int64_t saved_per_layer = block_kept[0] - block_kept[1];
  EXPECT_GT(saved_per_layer, input);  // a layer keeps much more than its input
  EXPECT_LT(block_kept[0], none.kept_bytes);
  for (size_t k = 1; k + 1 < size_t(layers); ++k)
    EXPECT_EQ(block_kept[k] - block_kept[k + 1], saved_per_layer) << "block " << k + 1;
  EXPECT_EQ(block_kept[size_t(layers) - 1], full.kept_bytes);
  EXPECT_EQ(block_kept[size_t(layers)], full.kept_bytes);  // more than the chunk has: all
}

TEST(Recompute, ExpertPoliciesAgreeAndSaveMemory) {
  // Top-2 of 4 experts with the load-balancing loss: selective keeps the routing, the experts'
  // fc1 rows and outputs, and gathers their input again; full reruns the routing.
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.num_layers = 2;
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_aux_loss_coeff = 0.01f;
  c.moe_shared_expert_intermediate_size = 64;
  c.moe_shared_expert_gate = true;
  check_methods(c);  // each layer keeps as much as the next: experts on every layer
  c.num_layers = 4;
  c.moe_layers = {1, 0, 0, 1};  // dense layers between expert ones
  check_policies(c);
  // DeepSeek-V3's router, the z-loss and the per-sequence loss.
  c.moe_router_score_function = MoeScoreFunction::sigmoid;
  c.moe_router_enable_expert_bias = true;
  c.moe_router_num_groups = 2;
  c.moe_router_group_topk = 1;
  c.moe_router_topk_scaling_factor = 2.5f;
  c.moe_z_loss_coeff = 0.001f;
  c.moe_router_load_balancing_type = MoeLoadBalancing::seq_aux_loss;
  check_policies(c);
  c.moe_expert_capacity_factor = 0.5f;  // token dropping: a zero row among the experts'
  check_policies(c);
}

TEST(Recompute, Gpt2PoliciesAgreeAndSaveMemory) {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  c.num_layers = 4;
  c.hidden_dropout = 0.1f;     // masks must be drawn again identically when recomputing
  c.attention_dropout = 0.1f;  // the probabilities' too
  check_policies(c);
}

TEST(Recompute, LlamaPoliciesAgreeAndSaveMemory) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.num_layers = 4;
  check_policies(c);
}

// Two MTP depths whose layers follow the policy (an expert layer, as the last): their norms,
// projection and dropout masks rerun alike.
TEST(Recompute, MultiTokenPredictionPoliciesAgreeAndSaveMemory) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.num_layers = 3;
  c.mtp_num_layers = 2;
  c.hidden_dropout = 0.1f;
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_aux_loss_coeff = 0.01f;
  c.moe_layers = {0, 0, 1};
  check_policies(c);
}

TEST(Recompute, QkNormPoliciesAgreeAndSaveMemory) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.num_layers = 4;
  c.qk_layernorm = true;
  check_policies(c);
}

// Four layers of multi-latent attention on llama-tiny: a query latent of 32, a key/value latent
// of 16, heads of 8 + 8 RoPE channels, value heads of 12.
TransformerConfig latent_attention() {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.num_layers = 4;
  c.num_query_groups = 0;
  c.multi_latent_attention = true;
  c.q_lora_rank = 32;
  c.kv_lora_rank = 16;
  c.qk_head_dim = 8;
  c.qk_pos_emb_head_dim = 8;
  c.v_head_dim = 12;
  return c;
}

TEST(Recompute, LatentAttentionPoliciesAgreeAndSaveMemory) {
  // None and selective keep the latents and q, k, v; full reruns them.
  TransformerConfig c = latent_attention();
  c.qk_layernorm = true;
  c.hidden_dropout = 0.1f;
  c.attention_dropout = 0.1f;
  check_policies(c);
}

// megatron-core's --recompute-modules mla_up_proj on top of selective: q, k and v (every head,
// the values padded to D) are projected again from the kept latents and the rotated k_pe, with
// and without a query latent and with YaRN's q scale; gradients bit-identical to none's, and the
// forward keeps exactly those three tensors less per layer (k_pe, [T, Dr], more).
void check_up_projection_recompute(int64_t q_lora_rank) {
  SCOPED_TRACE("q_lora_rank " + std::to_string(q_lora_rank));
  TransformerConfig c = latent_attention();
  c.q_lora_rank = q_lora_rank;
  c.qk_layernorm = true;
  c.rope_yarn_factor = 40;
  c.rope_original_max_position_embeddings = 4096;
  const Batch batch = make_batch(4, 32, c.vocab_size, 7);
  const Run none = run_policy(c, Recompute::none, batch);
  const Run selective = run_policy(c, Recompute::selective, batch);
  c.recompute_mla_up_proj = true;
  const Run up = run_policy(c, Recompute::selective, batch);
  EXPECT_EQ(up.leaked_bytes, 0);
  EXPECT_EQ(up.loss, none.loss);
  EXPECT_EQ(0, std::memcmp(up.grads.data(), none.grads.data(), none.grads.nbytes()))
      << "recomputing the up projections changed the gradients";
  const int64_t t = 4 * 32, bytes = int64_t(dtype_size(c.params_dtype));
  const int64_t qkv = 3 * t * c.num_attention_heads * c.head_dim() * bytes;
  const int64_t k_pe = t * c.qk_pos_emb_head_dim * bytes;
  EXPECT_EQ(selective.kept_bytes - up.kept_bytes, c.num_layers * (qkv - k_pe));
}

TEST(Recompute, LatentUpProjectionsRecomputedUnderSelective) {
  check_up_projection_recompute(32);
  check_up_projection_recompute(0);
  TransformerConfig dense = TransformerConfig::preset("llama-tiny");
  dense.recompute_mla_up_proj = true;
  EXPECT_THROW(dense.validate(), ConfigError);
}

TEST(Recompute, YarnLatentAttentionPoliciesAgree) {
  // YaRN's softmax factor on q (and on dq) and its cos and sin factor: full recompute projects
  // and scales q again, selective keeps the scaled q.
  TransformerConfig c = latent_attention();
  c.rope_yarn_factor = 40;
  c.rope_original_max_position_embeddings = 4096;
  c.rope_yarn_mscale = 0.707f;
  c.rope_yarn_mscale_all_dim = 1;
  check_policies(c);
}

TEST(Recompute, WideHeadsKeepTheirWiderQkvAndAttentionOutput) {
  // kv_channels doubles each head (16 -> 32 on hidden 64, 4 query and 2 kv heads): none and
  // selective keep q, k, v and the attention output, so each layer keeps
  // T x (2 x 4 x 16 + 2 x 2 x 16) values more (the planner's layer_activation_bytes term);
  // full keeps only the layers' inputs, so nothing more.
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.num_layers = 4;
  TransformerConfig wide = c;
  wide.kv_channels = 32;
  check_policies(wide);
  const Batch batch = make_batch(4, 32, c.vocab_size, 3);
  const int64_t tokens = 4 * 32, elem = int64_t(dtype_size(c.params_dtype));
  const int64_t extra = c.num_layers * tokens * (2 * 4 * 16 + 2 * 2 * 16) * elem;
  for (Recompute policy : {Recompute::none, Recompute::selective, Recompute::full}) {
    SCOPED_TRACE(to_string(policy));
    const int64_t more =
        run_policy(wide, policy, batch).kept_bytes - run_policy(c, policy, batch).kept_bytes;
    EXPECT_EQ(more, policy == Recompute::full ? 0 : extra);
  }
}

TEST(Recompute, UniformGroupsAndBlockAgreeAndKeepWhatTheySay) {
  TransformerConfig gpt2 = TransformerConfig::preset("gpt2-tiny");
  gpt2.num_layers = 4;
  gpt2.hidden_dropout = 0.1f;  // a rerun group draws every block's masks again
  gpt2.attention_dropout = 0.1f;
  check_methods(gpt2);
  TransformerConfig llama = TransformerConfig::preset("llama-tiny");
  llama.num_layers = 4;
  check_methods(llama);
}

}  // namespace
}  // namespace braid::model
