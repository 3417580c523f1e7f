// KV-cache inference: GPTModel::decode against GPTModel::logits, and the op it rests on,
// attention_cached_forward, against attention_forward. Every present device (CPU, and CUDA
// where there is one), f32.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "braid/core/error.h"
#include "braid/kernels/ops.h"
#include "model_test_util.h"

namespace braid::model {
namespace {

using namespace testing_util;

constexpr float kTol = 1e-5f;

// The rows [first, first + n) of dim 1 of a [B, S, ...] host tensor, as [B, n, ...].
Tensor positions(const Tensor& t, int64_t first, int64_t n) {
  const Tensor h = t.to(Device::cpu());
  const int64_t b = h.size(0), s = h.size(1), row = h.numel() / (b * s);
  Shape shape = h.shape();
  std::vector<int64_t> dims(shape.begin(), shape.end());
  dims[1] = n;
  Tensor out = Tensor::empty(Shape(std::span<const int64_t>(dims)), h.dtype());
  for (int64_t i = 0; i < b; ++i)
    out.slice(i * n * row, {n * row}).copy_from(h.slice((i * s + first) * row, {n * row}));
  return out;
}

float max_abs_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const std::vector<float> x = host_floats(a), y = host_floats(b);
  float m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

class KVCacheTest : public ::testing::TestWithParam<Device> {};

void check_cached_attention(Device dev, int64_t window) {
  const int64_t b = 2, s = 37, hq = 6, hkv = 2, d = 40, cap = 45;
  const Tensor q = testing::random_tensor({b, s, hq, d}, 1).to(dev);
  const Tensor k = testing::random_tensor({b, s, hkv, d}, 2).to(dev);
  const Tensor v = testing::random_tensor({b, s, hkv, d}, 3).to(dev);
  Tensor out = Tensor::empty({b, s, hq, d}, DType::f32, dev);
  Tensor lse = Tensor::empty({b, hq, s}, DType::f32, dev);
  ops::attention_forward(out, lse, q, k, v, window);
  // The cache: capacity 45, positions [0, 37) filled with k, v, the rest garbage it must skip.
  Tensor kc = testing::random_tensor({b, cap, hkv, d}, 4, 100.0f);
  Tensor vc = testing::random_tensor({b, cap, hkv, d}, 5, 100.0f);
  const int64_t row = hkv * d;
  for (int64_t i = 0; i < b; ++i) {
    kc.slice(i * cap * row, {s * row}).copy_from(k.to(Device::cpu()).slice(i * s * row, {s * row}));
    vc.slice(i * cap * row, {s * row}).copy_from(v.to(Device::cpu()).slice(i * s * row, {s * row}));
  }
  kc = kc.to(dev);
  vc = vc.to(dev);
  for (int64_t n : {int64_t(1), int64_t(3), s}) {
    const Tensor qn = positions(q, s - n, n).to(dev);
    Tensor got = Tensor::empty({b, n, hq, d}, DType::f32, dev);
    ops::attention_cached_forward(got, qn, kc, vc, s, window);
    EXPECT_LT(max_abs_diff(got, positions(out, s - n, n)), kTol) << n << " new positions";
  }
  Tensor bad = Tensor::empty({b, 3, hq, d}, DType::f32, dev);
  EXPECT_THROW(ops::attention_cached_forward(bad, positions(q, 0, 3).to(dev), kc, vc, cap + 1),
               Error);
  EXPECT_THROW(ops::attention_cached_forward(bad, positions(q, 0, 3).to(dev), kc, vc, s, -2),
               Error);
}

// Query rows of the last positions over the whole cache equal those rows of causal attention,
// with and without a sliding window (7: inside a 32-key tile; 33: across two).
TEST_P(KVCacheTest, CachedAttentionIsTheLastRowsOfCausalAttention) {
  for (int64_t window : {int64_t(-1), int64_t(7), int64_t(33)}) {
    SCOPED_TRACE(::testing::Message() << "window " << window);
    check_cached_attention(GetParam(), window);
  }
}

void check_decode(const TransformerConfig& config, Device dev) {
  GPTModel model(config, dev, 17);
  perturb_norms_and_biases(model, 5);
  const int64_t b = 3, p = 5, total = config.max_position_embeddings;
  const Batch batch = make_batch(b, total, config.vocab_size, 8);
  KVCache cache = model.kv_cache(b);
  EXPECT_EQ(cache.capacity(), total);
  // Prefill, then one token per step, then the last positions two at a time.
  std::vector<std::pair<int64_t, int64_t>> steps{{0, p}};
  for (int64_t i = p; i < total - 4; ++i) steps.push_back({i, 1});
  steps.push_back({total - 4, 2});
  steps.push_back({total - 2, 2});
  for (auto [first, n] : steps) {
    const Tensor got = model.decode(positions(batch.ids, first, n), cache);
    EXPECT_EQ(cache.length(), first + n);
    const Tensor want = positions(model.logits(positions(batch.ids, 0, first + n)), first, n);
    EXPECT_LT(max_abs_diff(got, want), kTol) << "positions " << first << ".." << first + n - 1;
  }
  // Full: one more position is past max_position_embeddings.
  try {
    model.decode(positions(batch.ids, 0, 1), cache);
    ADD_FAILURE() << "decode past max_position_embeddings did not throw";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("exceed max_position_embeddings"), std::string::npos)
        << e.what();
  }
  // reset: the same cache decodes a new batch from position 0, last position only.
  cache.reset();
  const Tensor last = model.decode(positions(batch.ids, 0, 7), cache, true);
  EXPECT_EQ(last.shape(), (Shape{b, 1, config.vocab_size}));
  EXPECT_LT(max_abs_diff(last, positions(model.logits(positions(batch.ids, 0, 7)), 6, 1)), kTol);
}

TEST_P(KVCacheTest, DecodeEqualsFullLogitsGpt2) { check_decode(small_gpt2(), GetParam()); }
TEST_P(KVCacheTest, DecodeEqualsFullLogitsLlamaGqa) { check_decode(small_llama(), GetParam()); }
TEST_P(KVCacheTest, DecodeEqualsFullLogitsWithPartialRotaryAndWideHeads) {
  // RoPE on a quarter of each head (StableLM's), heads twice hidden / heads wide (Qwen3's
  // kv_channels): decoding turns each new position's leading channels at its offset.
  TransformerConfig c = small_llama();
  c.kv_channels = 2 * c.head_dim();
  c.rotary_percent = 0.25;
  check_decode(c, GetParam());
}

TEST_P(KVCacheTest, DecodeEqualsFullLogitsWithSlidingWindows) {
  // Mistral-style windows on the first and last layers, full attention between; the window (3)
  // is shorter than the prompt, so decoding must drop the cache's oldest keys from view.
  TransformerConfig c = small_llama();
  c.num_layers = 3;
  c.window_size = 3;
  c.window_layers = {1, 0, 1};
  check_decode(c, GetParam());
}

TEST_P(KVCacheTest, DecodeEqualsFullLogitsWithLatentAttention) {
  // Multi-latent attention caches every head's key (its shared RoPE part turned at the new
  // positions' offsets) and padded value; with and without the query latent.
  TransformerConfig c = small_latent();
  check_decode(c, GetParam());
  c.q_lora_rank = 0;
  check_decode(c, GetParam());
}

TEST_P(KVCacheTest, DecodeEqualsFullLogitsWithYarn) {
  // YaRN with multi-latent attention (DeepSeek-V3's mscale = mscale_all_dim = 1: decoding's
  // queries get the softmax factor too, the cached keys none; then mscale 0.707 for cos and sin
  // times g(0.707) / g(1) as well), and without it (cos and sin times g(1)).
  TransformerConfig c = small_latent();
  c.rope_yarn_factor = 40;
  c.rope_original_max_position_embeddings = 4096;
  c.rope_yarn_mscale_all_dim = 1;
  check_decode(c, GetParam());
  c.rope_yarn_mscale = 0.707f;
  check_decode(c, GetParam());
  TransformerConfig llama = small_llama();
  llama.rope_yarn_factor = 40;
  llama.rope_original_max_position_embeddings = 4096;
  check_decode(llama, GetParam());
}

TEST_P(KVCacheTest, DecodeEqualsFullLogitsWithExperts) {
  // Top-2 of 4 experts: the positions of a decoding step route alone, as they do in the whole
  // sequence (routing is per token).
  TransformerConfig c = small_llama();
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 32;
  c.moe_shared_expert_intermediate_size = 16;
  c.moe_shared_expert_gate = true;
  check_decode(c, GetParam());
}

TEST_P(KVCacheTest, DecodeEqualsFullLogitsWithAttentionSinks) {
  // GPT-OSS's layers: learnable sinks (each decoding step's softmax has them too), windows on
  // every other layer, quick GEGLU experts with biases; then off-by-one's sinks of 0.
  TransformerConfig c = small_llama();
  c.num_layers = 3;
  c.window_size = 3;
  c.window_layers = {1, 0, 1};
  c.softmax_type = SoftmaxType::learnable;
  c.add_bias_linear = true;
  c.activation = Activation::quick_geglu;
  c.glu_linear_offset = 1.0f;
  c.activation_clamp = 0.5f;
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 32;
  check_decode(c, GetParam());
  c.softmax_type = SoftmaxType::off_by_one;
  check_decode(c, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Devices, KVCacheTest, ::testing::ValuesIn(testing::test_devices()),
                         testing::device_test_name);

}  // namespace
}  // namespace braid::model
