#pragma once
// Trainer: one training step of this rank's share of a model under any (tp, pp, dp) layout -
// the pipeline schedule over the microbatches, the data-parallel reduction of the gradients,
// global-norm clipping, loss scaling, AdamW (ZeRO-1 when the DDP config says so) with the
// learning-rate schedule, and the step's figures.
//
// The loss is the mean over every non-ignored target of the global batch (all microbatches of
// all DP ranks): microbatch m of DP rank d is weighted by its share of the global token count
// in backward, and DP reductions sum. A step whose loss or gradient norm is not finite is
// skipped - no parameter or optimizer state changes, and a warning says so - and with a
// dynamic loss scaler the scale is lowered (loss_scaler.h).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "braid/core/tensor.h"
#include "braid/engine/adamw.h"
#include "braid/engine/loss_scaler.h"
#include "braid/engine/lr_schedule.h"
#include "braid/engine/parallel_model.h"
#include "braid/engine/pipeline.h"
#include "braid/model/gpt_model.h"

namespace braid::engine {

struct TrainerConfig {
  AdamWConfig optimizer;
  LRSchedule schedule;
  // --start/end-weight-decay: the decay of every step from this schedule (over the same
  // iterations as the learning rate's); none: optimizer.weight_decay throughout.
  std::optional<WeightDecaySchedule> weight_decay_schedule;
  LossScaleConfig loss_scale;
  // "1f1b" (interleaved 1F1B with virtual stages) or "gpipe"; used when pp > 1.
  std::string pipeline_schedule = "1f1b";
  // The schedules' iteration in samples (--global-batch-size). Megatron's schedules count the
  // samples of the updates, so an update of b samples (over all DP ranks) advances them by
  // b / global_batch_size iterations - one for a full batch, less for a ramped-up one
  // (--rampup-batch-size). 0: every update counts one iteration.
  int64_t global_batch_size = 0;
  // Megatron's --log-num-zeros-in-grad: StepStats::num_zeros_in_grads every step (one count
  // over the gradients and one collective more).
  bool log_num_zeros_in_grad = false;
};

struct StepStats {
  float loss = 0;          // mean over the global batch's non-ignored targets
  float grad_norm = 0;     // global gradient norm before clipping (unscaled)
  float lr = 0;            // learning rate of this step
  float decoupled_lr = 0;  // the embedding's and output layer's (LRSchedule::decoupled_lr_at)
  // Zero gradient elements (AdamW::num_zeros_in_grads) with log_num_zeros_in_grad, else -1.
  int64_t num_zeros_in_grads = -1;
  float loss_scale = 1;
  bool skipped = false;  // non-finite loss or gradients: no update
  int64_t tokens = 0;    // non-ignored targets of the global batch
  double seconds = 0;
  double tokens_per_second = 0;   // global batch tokens (ids) per second
  int64_t peak_memory_bytes = 0;  // the device allocator's peak during the step
  // Mixture of experts, each router loss without its coefficient, its mean over the expert
  // layers and the global batch's microbatches, 0 without the loss: with moe_aux_loss_coeff > 0
  // the load-balancing loss (1 when the tokens spread evenly; Megatron's load_balancing_loss or
  // seq_load_balancing_loss), with moe_z_loss_coeff > 0 the z-loss (Megatron's z_loss).
  double load_balancing_loss = 0;
  double z_loss = 0;
  // The same per layer (num_layers + mtp_num_layers entries - the MTP depths' layers last -, 0
  // on dense layers; Megatron's --moe-per-layer-logging): each layer's mean over the global
  // batch's microbatches.
  std::vector<double> layer_load_balancing_loss, layer_z_loss;
  // Multi-token prediction: per depth, the mean cross-entropy over the global batch's
  // non-ignored shifted targets (Megatron's "mtp_1 loss", ...); empty without MTP.
  std::vector<double> mtp_losses;

  // Where this rank's step time went, from the spans of the trace given to set_trace (all 0
  // without one). The waits are the time this rank's thread was blocked on communication,
  // by group (core/trace.h); compute is the rest: seconds - the waits.
  double compute_seconds = 0;        // forward, backward, optimizer, and host work between
  double pipeline_wait_seconds = 0;  // pipeline p2p: the bubble, the transfers, imbalance
  double tp_wait_seconds = 0;        // tensor-parallel collectives ("tp", "tp_kv")
  double dp_wait_seconds = 0;        // DP reductions and ZeRO gathers the step did not hide
  double ep_wait_seconds = 0;        // expert parallelism's token all-to-alls and counts ("ep")
  // The loss, gradient norm and tied embeddings (other groups). These wait for the slowest
  // rank, so they also hold the skew at the step's end - under pp, stages waiting for the
  // first stage's last backwards.
  double other_wait_seconds = 0;
};

class Trainer {
 public:
  // One process, the whole model.
  Trainer(model::GPTModel& model, AdamWConfig optimizer, LRSchedule schedule);
  Trainer(ParallelModel& model, TrainerConfig config);
  ~Trainer();

  // ids, targets [B, S] i32 (any device): this DP rank's share of the global batch, the same
  // on every TP and PP rank of it. B splits into num_microbatches equal microbatches. The
  // global batch is samples consumed_samples() on, in Megatron's sampler's order
  // (data::BatchLayout::sample: microbatch m of DP rank d holds rows (m·dp + d)·B/M on), and
  // its sequences' indices key their dropout masks: any layout and micro-batch size drops the
  // same elements of each sample.
  StepStats train_step(const Tensor& ids, const Tensor& targets, int num_microbatches = 1);
  // The loss of a batch without training on it (validation): the mean over the global batch's
  // non-ignored targets, on every rank, like train_step's. Forwards only (Megatron's
  // forward_only schedule under pp > 1), no dropout; parameters, optimizer, counters and the
  // dropout random state stay as they are.
  float evaluate(const Tensor& ids, const Tensor& targets, int num_microbatches = 1);

  int64_t iteration() const { return iteration_; }  // steps attempted (skipped ones included)
  int64_t skipped_iterations() const { return skipped_; }
  int64_t update_samples() const { return update_samples_; }  // samples of the updates taken
  // Samples of every step so far, over all DP ranks: skipped and passed ones too (Megatron's
  // consumed_train_samples); a loaded checkpoint's consumed_samples.
  int64_t consumed_samples() const { return consumed_samples_; }
  // Where the LR and weight-decay schedules stand: the updates taken, each counted as its
  // share of a full global batch (TrainerConfig::global_batch_size).
  double schedule_iterations() const;
  ParallelModel& model() { return model_; }
  AdamW& optimizer() { return *optimizer_; }
  const LRSchedule& schedule() const { return config_.schedule; }
  const LossScaler& loss_scaler() const { return scaler_; }
  LossScaler& loss_scaler() { return scaler_; }
  const TrainerConfig& config() const { return config_; }
  // A loaded checkpoint's counters (checkpoint.h).
  void set_iterations(int64_t iteration, int64_t skipped, int64_t update_samples,
                      int64_t consumed_samples);
  // Counts an iteration that trains on nothing (Megatron's --iterations-to-skip: its batch of
  // `samples`, over all DP ranks, is read and dropped): the iteration and consumed_samples
  // advance; parameters, optimizer state, the schedules' position (update_samples) and the
  // skipped count stay. Needs schedules that count samples (TrainerConfig::global_batch_size),
  // since an iteration count would take it as an update.
  void pass_iteration(int64_t samples);

  // Records each train_step on `trace` (null: none, the default): a "step" span on lane
  // "step", forwards, backwards and the optimizer on "compute", the pipeline's exchanges on
  // "p2p" and every communication wait on "comm:<group>" (core/trace.h); StepStats then
  // carries the step's breakdown. On CUDA the spans synchronize the device (Trace), which
  // serializes the overlapped communication. The trace must outlive the steps it records.
  void set_trace(Trace* trace);
  Trace* trace() const { return trace_; }

 private:
  // A batch cut into microbatches; scales[m] = loss scale × microbatch m's share of the
  // global batch's non-ignored targets (`tokens`, summed over DP).
  struct Microbatches {
    std::vector<Tensor> ids, targets;
    std::vector<float> scales;
    std::vector<int64_t> first_samples;  // the run-wide index of each one's first row
    int64_t tokens = 0;
  };
  Microbatches split(const Tensor& ids, const Tensor& targets, int num_microbatches,
                     float loss_scale, const char* what) const;
  PipelineExecutor& executor(int microbatches, bool forward_only);
  // Runs the forwards (and unless forward_only the backwards); returns sum_m scales[m] · loss_m
  // on the last stage.
  float run_microbatches(const Microbatches& batch, bool forward_only);
  // Sums the last stages' losses over the job: the global batch's loss on every rank.
  float global_loss(float local_loss) const;
  // Fills StepStats' router losses of the step whose microbatches just ran (collective over the
  // job when the model has either loss).
  void moe_losses(int num_microbatches, StepStats& stats) const;
  void mtp_losses(StepStats& stats) const;

  std::unique_ptr<ParallelModel> owned_;  // the one-process constructor's wrapper
  ParallelModel& model_;
  TrainerConfig config_;
  std::unique_ptr<AdamW> optimizer_;
  LossScaler scaler_;
  std::unique_ptr<PipelineExecutor> executor_, eval_executor_;
  Trace* trace_ = nullptr;
  int64_t iteration_ = 0;
  int64_t skipped_ = 0;
  int64_t update_samples_ = 0;
  int64_t consumed_samples_ = 0;
};

}  // namespace braid::engine
