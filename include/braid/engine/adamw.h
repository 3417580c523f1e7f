#pragma once
// AdamW over a model's flat buffers, with global-norm gradient clipping.
//
// State is f32 and sits at the flat buffer's element offsets: the master weights (the
// model's own buffer when its parameters are f32; an f32 copy when they are bf16, written
// back to the model after every step) and the two moments. Weight decay is decoupled
// (torch.optim.AdamW) and applies to parameters whose spec says weight_decay (linear
// weights, lm_head), plus the embeddings when decay_embeddings; never to norms or biases.

#include <cstdint>
#include <map>
#include <vector>

#include "braid/core/tensor.h"
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

class AdamW {
 public:
  AdamW(model::GPTModel& model, AdamWConfig config);

  // The global L2 norm of all gradients (ops::sum_of_squares, then sqrt on the host), over
  // the whole model when it is tensor-parallel (each parameter counted once).
  float grad_norm() const;
  // Computes the global norm, scales the gradients by clip_grad / (norm + 1e-6) when that is
  // below 1 (Megatron), and takes one AdamW step with `lr`. Returns the norm before clipping.
  // A non-finite norm throws Error and leaves parameters and state untouched.
  float clip_and_step(float lr);
  float clip_and_step() { return clip_and_step(config_.lr); }

  int64_t step() const { return step_; }  // steps taken so far
  const AdamWConfig& config() const { return config_; }
  float weight_decay_of(const model::ParamSpec& spec) const;

  // With bf16 parameters the f32 master copy is taken here, at construction, and written
  // back to the model after every step: load weights into the model before creating the
  // optimizer (or the Trainer), or they are overwritten by the first step.
  // f32 state over the whole flat buffer (padding included), for checkpoints.
  const Tensor& master_params() const { return master_; }
  const Tensor& exp_avg() const { return exp_avg_; }
  const Tensor& exp_avg_sq() const { return exp_avg_sq_; }

 private:
  model::GPTModel& model_;
  AdamWConfig config_;
  int64_t step_ = 0;
  Tensor master_;
  Tensor exp_avg_;
  Tensor exp_avg_sq_;
  std::vector<ops::AdamWGroup> groups_;                   // one per parameter
  std::map<int, std::vector<Tensor>> grads_by_replicas_;  // gradient views by TP copies held
};

}  // namespace braid::engine
