#pragma once
// Shared by the model tests: small configs, batches, and host-side helpers.

#include <cmath>
#include <cstring>
#include <vector>

#include "braid/model/gpt_model.h"
#include "test_devices.h"

namespace braid::model::testing_util {

// GPT-2 style: layernorm, gelu, learned positions, biases, tied embeddings.
inline TransformerConfig small_gpt2() {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 64;
  c.vocab_size = 48;
  c.max_position_embeddings = 16;
  c.init_std = 0.1f;
  return c;
}

// Llama style with grouped-query attention (4 query heads, 2 kv heads), untied.
inline TransformerConfig small_llama() {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.ffn_hidden_size = 48;
  c.vocab_size = 48;
  c.max_position_embeddings = 16;
  c.init_std = 0.1f;
  return c;
}

// DeepSeek-V3's multi-latent attention on small_llama: a query latent of 24 and a key/value
// latent of 16 with their norms, heads of 12 nope + 8 RoPE channels, value heads of 10.
inline TransformerConfig small_latent() {
  TransformerConfig c = small_llama();
  c.num_query_groups = 0;
  c.multi_latent_attention = true;
  c.q_lora_rank = 24;
  c.kv_lora_rank = 16;
  c.qk_head_dim = 12;
  c.qk_pos_emb_head_dim = 8;
  c.v_head_dim = 10;
  c.qk_layernorm = true;
  return c;
}

struct Batch {
  Tensor ids;      // [B, S] i32, CPU
  Tensor targets;  // next tokens; the last position of each row is ignored (-1)
};

inline Batch make_batch(int64_t b, int64_t s, int64_t vocab, uint64_t seed) {
  Batch out{Tensor::empty({b, s}, DType::i32), Tensor::empty({b, s}, DType::i32)};
  const Tensor r = testing::random_tensor({b, s + 1}, seed);
  int32_t* ids = out.ids.data_ptr<int32_t>();
  int32_t* targets = out.targets.data_ptr<int32_t>();
  for (int64_t i = 0; i < b; ++i) {
    std::vector<int32_t> row(size_t(s + 1));
    for (int64_t j = 0; j <= s; ++j)
      row[size_t(j)] = int32_t(std::floor((r.item(i * (s + 1) + j) + 1.0) * 0.5 * double(vocab))) %
                       int32_t(vocab);
    for (int64_t j = 0; j < s; ++j) {
      ids[i * s + j] = row[size_t(j)];
      targets[i * s + j] = j + 1 < s ? row[size_t(j + 1)] : -1;
    }
  }
  return out;
}

// Gives norms and biases non-trivial values (init makes them 1 and 0) so that their
// gradients are exercised in earnest.
inline void perturb_norms_and_biases(GPTModel& model, uint64_t seed) {
  for (Parameter& p : model.parameters()) {
    const bool bias = p.spec.name.ends_with(".bias");
    const bool norm = p.spec.name.find("norm.weight") != std::string::npos;
    if (!bias && !norm) continue;
    Tensor host = p.value.to(Device::cpu());
    const Tensor r = testing::random_tensor(p.spec.shape, seed++, 0.2f);
    for (int64_t i = 0; i < host.numel(); ++i) host.data_ptr<float>()[i] += r.data_ptr<float>()[i];
    p.value.copy_from(host);
  }
}

inline std::vector<float> host_floats(const Tensor& t) {
  const Tensor h = t.to(Device::cpu());
  std::vector<float> out(size_t(h.numel()));
  std::memcpy(out.data(), h.data(), out.size() * sizeof(float));
  return out;
}

// Mean cross-entropy over non-ignored targets, in double on the host, from model.logits().
inline double reference_loss(GPTModel& model, const Batch& batch) {
  const Tensor logits = model.logits(batch.ids);
  const int64_t v = logits.size(2), tokens = batch.ids.numel();
  const float* l = logits.data_ptr<float>();
  const int32_t* t = batch.targets.data_ptr<int32_t>();
  double sum = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < tokens; ++i) {
    if (t[i] < 0) continue;
    double max = -INFINITY, z = 0;
    for (int64_t j = 0; j < v; ++j) max = std::max(max, double(l[i * v + j]));
    for (int64_t j = 0; j < v; ++j) z += std::exp(double(l[i * v + j]) - max);
    sum += std::log(z) + max - double(l[i * v + t[i]]);
    ++count;
  }
  return sum / double(count);
}

}  // namespace braid::model::testing_util
