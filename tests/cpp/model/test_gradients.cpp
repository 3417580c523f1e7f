// Finite-difference checks of the whole model's loss gradient, and the loss itself against a
// host computation from the logits.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <vector>

#include "model_test_util.h"

namespace braid::model {
namespace {

using namespace testing_util;

// Sets parameter `p` to host values `v`.
void set_values(Parameter& p, const std::vector<float>& v) {
  Tensor host =
      Tensor::from_blob(const_cast<float*>(v.data()), p.spec.shape, DType::f32, Device::cpu());
  p.value.copy_from(host);
}

// Central difference of the loss along `direction` (same size as the parameter).
double central_difference(GPTModel& model, Parameter& p, const std::vector<float>& base,
                          const std::vector<float>& direction, double h, const Batch& batch) {
  std::vector<float> shifted(base.size());
  double loss[2];
  for (int side = 0; side < 2; ++side) {
    const double sign = side == 0 ? 1.0 : -1.0;
    for (size_t i = 0; i < base.size(); ++i)
      shifted[i] = float(double(base[i]) + sign * h * double(direction[i]));
    set_values(p, shifted);
    loss[side] = reference_loss(model, batch);
  }
  set_values(p, base);
  return (loss[0] - loss[1]) / (2 * h);
}

// Richardson extrapolation of two central differences: the O(h^2) truncation error cancels,
// which matters for the strongly curved directions of a tiny model.
double fd_derivative(GPTModel& model, Parameter& p, const std::vector<float>& base,
                     const std::vector<float>& direction, double h, const Batch& batch) {
  const double coarse = central_difference(model, p, base, direction, h, batch);
  const double fine = central_difference(model, p, base, direction, h / 2, batch);
  return (4 * fine - coarse) / 3;
}

void check_gradients(const TransformerConfig& config) {
  GPTModel model(config, testing::default_test_device(), 21);
  perturb_norms_and_biases(model, 5);
  const Batch batch = make_batch(2, 16, config.vocab_size, 77);
  model.zero_grad();
  const float loss = model.forward(batch.ids, batch.targets);
  EXPECT_NEAR(loss, reference_loss(model, batch), 1e-5 * std::abs(loss));
  model.backward();

  int checked = 0;
  double worst = 0;
  for (Parameter& p : model.parameters()) {
    const std::vector<float> base = host_floats(p.value);
    const std::vector<float> grad = host_floats(p.grad);
    const std::string& name = p.spec.name;
    // Along a random +-1 direction: sums many elements, so it is well above f32 noise. The
    // absolute floor is that noise (loss rounding / h): k_proj.bias has a zero gradient in
    // exact arithmetic (a shift of every key leaves the softmax unchanged).
    const Tensor r = testing::random_tensor(p.spec.shape, 1000 + uint64_t(checked));
    std::vector<float> dir(base.size());
    double analytic = 0, gnorm = 0;
    for (size_t i = 0; i < dir.size(); ++i) {
      dir[i] = r.data_ptr<float>()[i] >= 0 ? 1.0f : -1.0f;
      analytic += double(dir[i]) * grad[i];
      gnorm += double(grad[i]) * grad[i];
    }
    gnorm = std::sqrt(gnorm);
    ASSERT_GT(gnorm, 0) << name << " has a zero gradient";
    const double numeric = fd_derivative(model, p, base, dir, 2e-3, batch);
    const double tol = 1e-2 * std::abs(analytic) + 5e-5;
    EXPECT_NEAR(numeric, analytic, tol) << name << " along a random direction";
    // The two elements with the largest gradient.
    std::vector<size_t> order(base.size());
    std::iota(order.begin(), order.end(), size_t(0));
    std::partial_sort(order.begin(), order.begin() + 2, order.end(),
                      [&](size_t a, size_t b) { return std::abs(grad[a]) > std::abs(grad[b]); });
    for (int j = 0; j < 2; ++j) {
      std::vector<float> unit(base.size(), 0.0f);
      unit[order[size_t(j)]] = 1.0f;
      const double fd = fd_derivative(model, p, base, unit, 1e-2, batch);
      const double g = grad[order[size_t(j)]];
      const double element_tol = 1e-2 * std::abs(g) + 5e-5;
      EXPECT_NEAR(fd, g, element_tol) << name << " element " << order[size_t(j)];
      worst = std::max(worst, std::abs(fd - g) / element_tol);
    }
    worst = std::max(worst, std::abs(numeric - analytic) / tol);
    ++checked;
  }
  std::printf("largest finite-difference error: %.2f of its tolerance\n", worst);
  EXPECT_EQ(size_t(checked), model.parameters().size());
}

TEST(Gradients, Gpt2MatchesFiniteDifferences) { check_gradients(small_gpt2()); }

TEST(Gradients, LlamaWithGqaMatchesFiniteDifferences) { check_gradients(small_llama()); }

TEST(Gradients, MixtureMatchesFiniteDifferences) {
  // rmsnorm + gelu + rope + biases + tied embeddings + GQA: every switch crossed.
  TransformerConfig c = small_gpt2();
  c.normalization = Normalization::rmsnorm;
  c.position_embedding = PositionEmbedding::rope;
  c.num_query_groups = 1;
  check_gradients(c);
}

TEST(Gradients, QkNormsMatchFiniteDifferences) {
  // Per-head norms on q and k (qk_layernorm): rmsnorm with GQA and llama3 RoPE scaling, and
  // layernorm (weight and bias) with learned positions.
  TransformerConfig llama = small_llama();
  llama.qk_layernorm = true;
  llama.rope_scaling_factor = 8.0f;
  llama.rope_original_max_position_embeddings = 16;
  check_gradients(llama);
  TransformerConfig gpt2 = small_gpt2();
  gpt2.qk_layernorm = true;
  check_gradients(gpt2);
}

TEST(Gradients, PartialRotaryMatchesFiniteDifferences) {
  // RoPE on the first half of each head (rotary_percent), the rest unrotated, with layernorm
  // and q/k/v biases: StableLM's attention.
  TransformerConfig c = small_llama();
  c.rotary_percent = 0.5;
  c.normalization = Normalization::layernorm;
  c.add_qkv_bias = true;
  check_gradients(c);
}

TEST(Gradients, LatentAttentionMatchesFiniteDifferences) {
  // DeepSeek-V3's attention (query and key/value latents with their norms, interleaved RoPE on
  // a part of each head shared by every head's key, narrower value heads), then
  // DeepSeek-V2-Lite's (queries straight from the hidden state, no latent norms).
  TransformerConfig c = small_latent();
  check_gradients(c);
  c.q_lora_rank = 0;
  c.qk_layernorm = false;
  check_gradients(c);
}

TEST(Gradients, YarnMatchesFiniteDifferences) {
  // YaRN from DeepSeek-V3's 4096 positions (every regime occurs on 8 and 16 rope channels:
  // frequencies kept, blended, divided by the factor). With multi-latent attention and
  // mscale = mscale_all_dim = 1: cos and sin unscaled, the softmax scale times g(1)^2 (q's
  // factor, and dq's). Without it, Qwen's (mscale 1, mscale_all_dim 0): cos and sin times
  // g(1) = 1.37, the softmax scale unchanged.
  TransformerConfig c = small_latent();
  c.rope_yarn_factor = 40;
  c.rope_original_max_position_embeddings = 4096;
  c.rope_yarn_mscale_all_dim = 1;
  ASSERT_GT(c.softmax_scale_factor(), 1.8f);
  check_gradients(c);
  TransformerConfig llama = small_llama();
  llama.rope_yarn_factor = 40;
  llama.rope_original_max_position_embeddings = 4096;
  ASSERT_GT(llama.rope_attention_factor(), 1.3f);
  check_gradients(llama);
}

TEST(Gradients, SquaredReluMatchesFiniteDifferences) {
  // Nemotron-4's block: layernorm with zero-centered weights, squared relu (ungated), RoPE on
  // half of each head, biases.
  TransformerConfig c = small_gpt2();
  c.activation = Activation::squared_relu;
  c.zero_centered_gamma = true;
  c.position_embedding = PositionEmbedding::rope;
  c.rotary_percent = 0.5;
  check_gradients(c);
}

TEST(Gradients, ZeroCenteredNormsMatchFiniteDifferences) {
  // Norms scaling by 1 + weight (--apply-layernorm-1p): rmsnorm with q/k norms, and layernorm.
  TransformerConfig llama = small_llama();
  llama.zero_centered_gamma = true;
  llama.qk_layernorm = true;
  check_gradients(llama);
  TransformerConfig gpt2 = small_gpt2();
  gpt2.zero_centered_gamma = true;
  check_gradients(gpt2);
}

TEST(Gradients, WideHeadsMatchFiniteDifferences) {
  // kv_channels: heads wider than hidden / heads (Qwen3-0.6B's), so q and the attention
  // output are wider than the hidden size; with GQA and with tied GPT-2 numerics.
  TransformerConfig llama = small_llama();
  llama.kv_channels = 2 * llama.head_dim();
  check_gradients(llama);
  TransformerConfig gpt2 = small_gpt2();
  gpt2.kv_channels = gpt2.head_dim() / 2;
  check_gradients(gpt2);
}

TEST(Gradients, ExpertsMatchFiniteDifferences) {
  // Mixture of experts with every expert chosen (k = E), so that no perturbation can change the
  // selection (which has no derivative): dispatch, each expert, the weighted combine and the
  // router's softmax. Routing to k < E is checked against torch autograd (transformers' Mixtral
  // and OLMoE) and one-rank parity, where the selection is the same on both sides.
  TransformerConfig llama = small_llama();
  llama.num_experts = 3;
  llama.moe_router_topk = 3;
  llama.moe_ffn_hidden_size = 24;
  llama.moe_shared_expert_intermediate_size = 40;  // Qwen2-MoE's gated shared expert
  llama.moe_shared_expert_gate = true;
  llama.moe_layers = {0, 1};  // a dense first layer (DeepSeek's)
  check_gradients(llama);
  TransformerConfig gpt2 = small_gpt2();  // gelu experts with biases, softmax over all first
  gpt2.num_experts = 2;
  gpt2.moe_router_topk = 2;
  gpt2.moe_router_pre_softmax = true;
  gpt2.moe_shared_expert_intermediate_size = 16;  // ungated (Megatron's default)
  check_gradients(gpt2);
  // DeepSeek-V3's router: sigmoid scores normalised over the chosen ones, scaled (with the
  // expert bias, which only chooses).
  TransformerConfig sigmoid = small_llama();
  sigmoid.num_experts = 3;
  sigmoid.moe_router_topk = 3;
  sigmoid.moe_ffn_hidden_size = 24;
  sigmoid.moe_router_score_function = MoeScoreFunction::sigmoid;
  sigmoid.moe_router_topk_scaling_factor = 2.5f;
  sigmoid.moe_router_enable_expert_bias = true;
  check_gradients(sigmoid);
}

TEST(Gradients, GptOssMatchesFiniteDifferences) {
  // GPT-OSS's block: learnable attention sinks, biases on q, k, v, o, the router and the
  // experts, quick GEGLU experts with the linear offset and a clamp (not reached at this scale:
  // the kernels' tests check it), a windowed layer then a full one, YaRN without truncation.
  // Then the off-by-one softmax (sinks of 0, no parameter).
  TransformerConfig c = small_llama();
  c.add_bias_linear = true;
  c.softmax_type = SoftmaxType::learnable;
  c.activation = Activation::quick_geglu;
  c.glu_linear_offset = 1.0f;
  c.activation_clamp = 7.0f;
  c.num_experts = 3;
  c.moe_router_topk = 3;
  c.moe_ffn_hidden_size = 24;
  c.window_size = 5;
  c.window_layers = {1, 0};
  c.rope_yarn_factor = 32;
  c.rope_original_max_position_embeddings = 4096;
  c.rope_yarn_truncate = false;
  check_gradients(c);
  c.softmax_type = SoftmaxType::off_by_one;
  check_gradients(c);
}

}  // namespace
}  // namespace braid::model
