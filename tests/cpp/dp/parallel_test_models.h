#pragma once
// The two small models the data-parallel, 3D and checkpoint tests train: 8 layers, so every
// (pp, virtual stages) of the test matrices divides them, and 8 heads, so every tp <= 8 does.

#include <cstdint>

#include "braid/data/batch_layout.h"
#include "braid/engine/trainer.h"
#include "braid/model/config.h"

namespace braid::parallel_testing {

constexpr int64_t kSeq = 16;

// Untied, GQA: 4 kv heads, replicated in pairs at tp = 8; a 96-token vocabulary padded to
// multiples of 32 · tp, so at tp = 8 ranks 3..7 hold only padding rows.
inline model::TransformerConfig llama(float dropout = 0.0f) {
  model::TransformerConfig c = model::TransformerConfig::preset("llama-tiny");
  c.num_layers = 8;
  c.hidden_size = 64;
  c.num_attention_heads = 8;
  c.num_query_groups = 4;
  c.ffn_hidden_size = 96;
  c.vocab_size = 96;
  c.make_vocab_size_divisible_by = 32;
  c.max_position_embeddings = kSeq;
  c.init_std = 0.1f;
  c.hidden_dropout = dropout;
  return c;
}

// Tied embeddings (two copies under pipeline parallelism), learned positions, biases.
inline model::TransformerConfig gpt2(float dropout = 0.0f) {
  model::TransformerConfig c = model::TransformerConfig::preset("gpt2-tiny");
  c.num_layers = 8;
  c.hidden_size = 64;
  c.num_attention_heads = 8;
  c.num_query_groups = 8;
  c.ffn_hidden_size = 128;
  c.vocab_size = 96;
  c.make_vocab_size_divisible_by = 32;
  c.max_position_embeddings = kSeq;
  c.init_std = 0.1f;
  c.hidden_dropout = dropout;
  return c;
}

// llama() with two multi-token prediction depths: the last stage holds its own embed_tokens
// (untied: the depths' lookup table) and, with `tied`, reads it as the output weight too.
inline model::TransformerConfig llama_mtp(bool tied = false, float dropout = 0.0f) {
  model::TransformerConfig c = llama(dropout);
  c.mtp_num_layers = 2;
  c.mtp_loss_scaling_factor = 0.3f;
  c.tie_embeddings = tied;
  return c;
}

// DP rank d's share of a global batch [rows, S] as braid's DataLoader gives it out
// (data::BatchLayout::sample, Megatron's sampler's order), which engine::Trainer::train_step
// assumes: the rows' indices key the dropout masks.
inline Tensor dp_share(const Tensor& global, int dp, int d, int64_t mbs = 1) {
  const data::BatchLayout layout{
      .micro_batch_size = mbs, .global_batch_size = global.size(0), .dp_rank = d, .dp_size = dp};
  Tensor share = Tensor::empty({layout.rows_per_step(), global.size(1)}, global.dtype());
  for (int64_t m = 0; m < layout.num_microbatches(); ++m)
    for (int64_t r = 0; r < mbs; ++r)
      share.narrow(m * mbs + r, 1).copy_from(global.narrow(layout.sample(0, m, r), 1));
  return share;
}

// AdamW with weight decay and a clip that engages (the global norm must be right too), a
// warmup-cosine schedule over `decay_iters`.
inline engine::TrainerConfig trainer_config(int64_t decay_iters) {
  engine::TrainerConfig t;
  t.optimizer.lr = 1e-3f;
  t.optimizer.weight_decay = 0.1f;
  t.optimizer.clip_grad = 0.5f;
  t.schedule.lr = 1e-3f;
  t.schedule.min_lr = 1e-4f;
  t.schedule.warmup_iters = 2;
  t.schedule.decay_iters = decay_iters;
  return t;
}

}  // namespace braid::parallel_testing
