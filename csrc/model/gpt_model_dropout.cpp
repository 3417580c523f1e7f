// GPTModel's dropout: where each training forward's masks lie in the run's Philox streams (hidden
// dropout on the embedding output and the blocks' outputs, attention dropout on their
// probabilities), and the embedding output's dropout. A mask is a function of the seed, the site
// and the run-wide sample and position, so every layout and micro-batch size drops the same
// elements of the same sample.
#include "braid/kernels/ops.h"
#include "braid/model/gpt_model.h"
#include "model/gpt_model_internal.h"

namespace braid::model {

using namespace gpt_model_detail;

DropoutContext GPTModel::dropout_context(const Microbatch& mb, int layer, bool training) const {
  DropoutContext d;
  if (!training) return d;
  d.seed = seed_ ^ kDropoutSeedSalt;
  if (config_.attention_dropout > 0.0f) {
    // The mask of the unsplit model: under TP this rank's heads are heads from first_head on.
    d.attention_probs.p = config_.attention_dropout;
    d.attention_probs.seed = d.seed;
    d.attention_probs.stream = kAttentionProbsSite + uint64_t(layer);
    d.attention_probs.first_sequence = mb.first_sample;
    d.attention_probs.first_head = tp_.rank() * (config_.num_attention_heads / tp_.size());
  }
  if (config_.hidden_dropout == 0.0f) return d;
  d.p = config_.hidden_dropout;
  d.attention_offset = 2 * uint64_t(layer) + 1;
  d.mlp_offset = 2 * uint64_t(layer) + 2;
  // The rows of mb.ids are whole sequences, or under context parallelism this rank's two
  // chunks of each ([2B, L]); a sequence-parallel shard holds region_tokens of their tokens.
  const int64_t region = region_tokens(mb);
  d.token_runs = DropoutContext::token_runs_of(
      mb.ids.size(0), mb.ids.size(1), cp_.rank(), cp_.size(),
      tp_.sharded_tokens() ? tp_.rank() * region : 0, region, mb.first_token);
  return d;
}

Tensor GPTModel::dropout(const Microbatch& mb, Tensor x, uint64_t site, bool training) const {
  return dropout_context(mb, 0, training).apply(x, site);
}

Tensor GPTModel::dropout_backward(const Microbatch& mb, Tensor dx, uint64_t site) const {
  return dropout(mb, dx, site, true);  // d out / d x: the same mask and scale
}

}  // namespace braid::model
