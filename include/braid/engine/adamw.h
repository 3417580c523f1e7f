#pragma once
// AdamW over model chunks' flat buffers, with global-norm gradient clipping; with ZeRO-1 over
// this data-parallel rank's shard of them only.
//
// State is f32, kept per owned range of a flat buffer (Segment): the master weights (the
// model's own buffer when its parameters are f32; an f32 copy when they are bf16, written
// back to the model after every step) and the two moments. Only parameters' elements are
// updated, never the alignment or vocabulary padding between them. Weight decay is decoupled
// (torch.optim.AdamW) and applies to parameters whose spec says weight_decay (linear
// weights, lm_head), plus the embeddings when decay_embeddings; never to norms or biases.

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "braid/core/tensor.h"
#include "braid/engine/grad_buffer.h"
#include "braid/kernels/ops.h"
#include "braid/model/gpt_model.h"

namespace braid::engine {

struct AdamWConfig {
  float lr = 1e-3f;  // used by clip_and_step() without an explicit lr
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  float clip_grad = 1.0f;  // max global gradient norm; 0: no clipping
  bool decay_embeddings = false;

  void validate() const;  // ConfigError naming the field
};

// What the optimizer updates in one model chunk: the ranges of its flat buffers this rank owns
// (ascending, disjoint). Data parallelism without ZeRO: everything; ZeRO-1: this DP rank's
// shard of every bucket (GradBuffer::owned_ranges).
// The copies: how many ranks of the norm group own each of these elements (the norm counts
// each once), for the experts' parameters (spec.expert >= 0) and for the others. 1 where the
// norm group is chosen so that one rank owns each; expert parallelism without ZeRO sums the
// norm over the world, where dp·cp ranks hold each dense element and expert-DP ranks each
// expert's.
struct OptimizerChunk {
  model::GPTModel* model = nullptr;
  std::vector<ElementRange> owned;
  int dense_copies = 1;
  int expert_copies = 1;
};

class AdamW {
 public:
  // The whole of one model; with tensor parallelism the norm is summed over its TP group.
  AdamW(model::GPTModel& model, AdamWConfig config);
  // The owned ranges of every chunk this rank holds; `norm_group` sums the squares of the
  // global norm (nullptr: this rank's are the whole). The caller picks a group in which every
  // parameter element is owned once, or says by the chunks' copies how often: the
  // model-parallel group without ZeRO (DP replicas hold the same sums), every rank with ZeRO,
  // and every rank with copies under expert parallelism without ZeRO.
  AdamW(std::vector<OptimizerChunk> chunks, AdamWConfig config, comm::Communicator* norm_group);

  // The global L2 norm of the gradients as they are in the buffers: every parameter counted
  // once - a shard that k TP ranks hold adds 1/k of its squares on each (1/(k·copies) when
  // `copies` ranks of the norm group own it), and the last stage's copy of tied embeddings none
  // (the first stage's counts).
  float grad_norm() const;
  // The same global L2 norm of the parameters, from the f32 master weights (Megatron's
  // --log-params-norm). Collective over the norm group, like grad_norm.
  float params_norm() const;
  // How many gradient elements are zero, every parameter element counted once as in
  // grad_norm (Megatron's --log-num-zeros-in-grad). Collective over the norm group.
  int64_t num_zeros_in_grads() const;
  // Computes the global norm, scales the gradients by clip_grad / (norm + 1e-6) when that is
  // below 1 (Megatron), and takes one AdamW step with `lr`. Returns the norm before clipping.
  // A non-finite norm throws Error and leaves parameters and state untouched.
  float clip_and_step(float lr);
  float clip_and_step() { return clip_and_step(config_.lr); }
  // One AdamW step on gradients multiplied by `grad_scale` (clipping and loss unscaling,
  // decided by the caller). The embedding's and output layer's parameters
  // (model::is_embedding_or_output) take `decoupled_lr` when given (--decoupled-lr), `lr`
  // otherwise.
  void step_with(float lr, float grad_scale, std::optional<float> decoupled_lr = std::nullopt);

  // The weight decay of the parameters that decay (not norms and biases; embeddings with
  // decay_embeddings) from the next step on: a weight-decay schedule's value.
  void set_weight_decay(float weight_decay);

  int64_t step() const { return step_; }  // steps taken so far
  void set_step(int64_t steps);           // a loaded checkpoint's count (bias correction)
  const AdamWConfig& config() const { return config_; }
  float weight_decay_of(const model::ParamSpec& spec) const;

  // f32 state of one owned range. master is the model's own buffer when parameters are f32,
  // an f32 copy (written back to the model after every step) when they are bf16: with bf16,
  // load weights into the model before creating the optimizer (or the Trainer), or they are
  // overwritten by the first step.
  struct Segment {
    int chunk;
    ElementRange range;  // elements of the chunk's flat buffers
    Tensor master, exp_avg, exp_avg_sq;
  };
  const std::vector<Segment>& segments() const { return segments_; }
  // Bytes of optimizer state this rank allocated (f32 moments, and the bf16 case's masters).
  int64_t state_bytes() const { return state_bytes_; }
  // The one segment's state, for the single-model constructor (Error otherwise).
  const Tensor& master_params() const { return only_segment().master; }
  const Tensor& exp_avg() const { return only_segment().exp_avg; }
  const Tensor& exp_avg_sq() const { return only_segment().exp_avg_sq; }

 private:
  const Segment& only_segment() const;

  std::vector<OptimizerChunk> chunks_;
  AdamWConfig config_;
  comm::Communicator* norm_group_;
  int64_t step_ = 0;
  int64_t state_bytes_ = 0;
  std::vector<Segment> segments_;
  // One per (parameter, owned range); the embedding's and output layer's from
  // decoupled_begin_ on.
  std::vector<ops::AdamWGroup> groups_;
  std::vector<bool> decays_;  // groups_[i] takes the weight decay
  size_t decoupled_begin_ = 0;
  bool decays(const model::ParamSpec& spec) const;
  // The global norm of `by_copies` (a shard that k ranks of the norm group hold - TP replicas
  // times data copies - adds 1/k of its squares).
  float global_norm(const std::map<int, std::vector<Tensor>>& by_copies) const;
  std::map<int, std::vector<Tensor>> grads_by_copies_;   // norm inputs by copies held
  std::map<int, std::vector<Tensor>> params_by_copies_;  // the master weights alike
  Device device_;
};

}  // namespace braid::engine
