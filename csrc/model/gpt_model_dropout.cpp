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
  // A sequence-parallel shard draws its slice of the whole activation's mask, so every
  // layout drops exactly the elements the single-rank model drops. Context-parallel ranks draw
  // disjoint parts of the microbatch's mask (not the single-rank model's: their tokens are
  // in another order).
  int64_t first_token = mb.first_token + cp_.rank() * tokens_of(mb).count();
  if (tp_.sharded_tokens()) first_token += tp_.rank() * region_tokens(mb);
  d.first_element = first_token * config_.hidden_size;
  return d;
}

Tensor GPTModel::dropout(const Microbatch& mb, Tensor x, uint64_t site, bool training) const {
  const DropoutContext drop = dropout_context(mb, 0, training);
  if (drop.p == 0) return x;
  Tensor dropped = Tensor::empty(x.shape(), x.dtype(), device_);
  ops::dropout_forward(dropped, x, drop.p, drop.seed, site, drop.first_element);
  return dropped;
}

Tensor GPTModel::dropout_backward(const Microbatch& mb, Tensor dx, uint64_t site) const {
  return dropout(mb, dx, site, true);  // d out / d x: the same mask and scale
}

}  // namespace braid::model
