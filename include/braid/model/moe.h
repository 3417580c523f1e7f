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
// microbatch, coeff · E / (k · T²) · sum over e of count_e · sum over t of softmax(logits_t)_e,
// where T counts the tokens of the whole sequences (with context parallelism, every CP rank's:
// the counts are summed over the group, and each rank adds its own tokens' scores).

#include <cstdint>
#include <vector>

#include "braid/core/tensor.h"
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
  // The load-balancing loss's gradient with respect to each softmax score, per unit of loss
  // (coeff · E · count_e / (k · T²)), and this rank's share of the loss without its coefficient
  // (what Megatron logs as load_balancing_loss). Undefined and 0 without the loss.
  Tensor aux_grad;  // [E] f32
  double aux_loss = 0;
};

// Routes the tokens of `logits` [T, E] f32 by `config`'s router and plans their dispatch; with
// `load_balancing` (training, moe_aux_loss_coeff > 0) also the loss (counts summed over `cp`).
// Under tensor parallelism every rank routes the same tokens with its copy of the router; the
// choices and probabilities of TP rank 0 are broadcast to the group, so that the ranks' partial
// expert outputs always belong to the same experts, even if the copies' bits drift apart.
MoeRouting route_tokens(const Tensor& logits, const TransformerConfig& config,
                        const TensorParallel& tp, const ContextParallel& cp, bool load_balancing);

}  // namespace braid::model
