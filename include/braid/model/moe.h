#pragma once
// Mixture-of-experts routing and dispatch (config.h's num_experts). A microbatch's T tokens are
// routed to k experts each (ops::moe_router_forward); the T·k (token, choice) pairs become N = T·k
// rows grouped by expert, in token order within an expert, so that each expert's MLP runs as
// ordinary GEMMs on a contiguous block of rows:
//
//   expert_in = gather_rows(h, row_token)                     [N, H]
//   expert e: rows [offsets[e], offsets[e + 1]) through its fc1, activation, fc2
//   out       = combine_rows(expert_out, token_rows, probs)   [T, H]
//
// The plan is built on the host from the chosen experts (a device-to-host copy of [T, k] ints per
// layer and microbatch, as Megatron's sequential experts read their token counts): the GEMM
// shapes depend on it.
//
// Load balancing (moe_aux_loss_coeff > 0): Megatron's aux_loss, the Switch Transformer loss of a
// microbatch, coeff · E / (k · T²) · sum over e of count_e · sum over t of score_t,e, where the
// scores are softmax(logits_t) (or, with the sigmoid router, sigmoid normalised by its sum) and
// T counts the tokens of the whole sequences (with context parallelism, every CP rank's: the
// counts are summed over the group, and each rank adds its own tokens' scores). seq_aux_loss
// takes the same loss over each sequence alone (T its length) and averages it over the
// microbatch's sequences (Megatron's, DeepSeek-V3's).
// The z-loss (moe_z_loss_coeff > 0): coeff · the mean over the microbatch's tokens (every CP
// rank's) of logsumexp(logits_t)².

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "braid/core/tensor.h"
#include "braid/kernels/ops.h"
#include "braid/model/config.h"
#include "braid/model/context_parallel.h"
#include "braid/model/tensor_parallel.h"

namespace braid::model {

struct MoeRouting {
  Tensor probs;                  // [T, k] f32
  Tensor experts;                // [T, k] i32
  Tensor row_token;              // [N] i32: the token of each row
  Tensor row_prob;               // [N] f32: the router probability of each row
  Tensor token_rows;             // [T, k] i32: the row of each (token, choice)
  std::vector<int64_t> offsets;  // [E + 1], host: expert e's rows are [offsets[e], offsets[e+1])
  // (token, choice) pairs dropped past an expert's capacity: their token_rows are N, a row of
  // zeros the layer appends to the experts' outputs and their inputs' gradients.
  int64_t dropped = 0;
  // The load-balancing loss's gradient with respect to each score, per unit of loss, per
  // balancing group (1, or the microbatch's sequences) - coeff · E · count_g,e / (k · T_g²) / G
  // - and this rank's share of the loss without its coefficient (what Megatron logs as
  // load_balancing_loss). Undefined and 0 without the loss.
  Tensor aux_grad;  // [G, E] f32
  double aux_loss = 0;
  // The z-loss: this rank's share without its coefficient (Megatron's z_loss), and the
  // gradient factor for ops::moe_router_backward per unit of loss (2 · coeff / T). 0 without it.
  double z_loss = 0;
  float z_grad = 0;
};

// The router losses of a layer (or summed over layers and microbatches), without coefficients.
struct MoeLosses {
  double load_balancing = 0;
  double z = 0;
};

// ConfigError unless, when each TP rank routes its own tokens (whole experts) under the
// per-sequence balancing loss, every rank's share of a microbatch of `rows` sequences holds
// whole sequences (under CP whole chunks: 2·rows of them) or lies within one. Checked before a
// step (Trainer), on every rank alike, so that route_tokens never meets such a shard.
void check_sequence_shards(const TransformerConfig& config, int64_t rows, const TensorParallel& tp,
                           bool tp_shards_tokens, const ContextParallel& cp);

// The router arithmetic `config` asks for (ops.h).
ops::MoeRouterSpec router_spec(const TransformerConfig& config);

// Routes the tokens of `logits` [T, E] f32 (`rows` runs of T / rows consecutive tokens: the
// microbatch's sequences, or under context parallelism their local chunks) by `config`'s router,
// with `expert_bias` [E] f32 when it has one, and plans their dispatch; with `training`, also the
// load-balancing loss (when moe_aux_loss_coeff > 0; counts summed over `cp`) and the z-loss (when
// moe_z_loss_coeff > 0). Under tensor parallelism every rank routes the same tokens with its copy
// of the router; the choices and probabilities of TP rank 0 are broadcast to the group, so that the
// ranks' partial expert outputs always belong to the same experts, even if the copies' bits drift
// apart. With `tp_shards_tokens` (whole experts, expert_parallel.h) each TP rank instead routes its
// own sequence-parallel shard: `rows` still counts the runs of the TP group's tokens, the balancing
// counts are summed over TP too, the capacity is the TP group's (the same pairs are dropped as when
// every rank routes every token), and the losses are each rank's shares.
// With `drop` (not KV-cache decoding), experts keep at most their capacity of the tokens
// (moe_expert_capacity_factor > 0).
MoeRouting route_tokens(const Tensor& logits, int64_t rows, const Tensor& expert_bias,
                        const TransformerConfig& config, const TensorParallel& tp,
                        bool tp_shards_tokens, const ContextParallel& cp, bool training, bool drop);

// The name of layer `layer`'s expert bias (HF's DeepSeek-V3 name).
std::string expert_bias_name(int64_t layer);

// Megatron's auxiliary-loss-free update of one layer's expert bias [E] f32: with the tokens
// each expert took summed over each of `groups` in turn (nullptr: none), bias += rate ×
// sign(mean − tokens), in f32; then zeroes `tokens`.
void move_expert_bias(Tensor bias, std::vector<int64_t>& tokens, float rate,
                      std::initializer_list<comm::Communicator*> groups);

}  // namespace braid::model
