#pragma once
// Distributed checkpoints: a Trainer's whole state saved under one (tp, pp, dp, ep, ZeRO,
// virtual stages) layout and loaded under any other, optimizer state included.
//
// On disk (Megatron's names):
//   <dir>/latest_checkpointed_iteration.txt   the last complete iteration, replaced by rename
//   <dir>/iter_0000100/metadata.json          format version, iteration, model config, the
//                                             layout it was saved from, trainer, loss-scaler
//                                             and RNG state, consumed samples, tensor index
//   <dir>/iter_0000100/mp_rank_TT_PPP.safetensors   one per (tp, pp) position
//   <dir>/iter_0000100/mp_rank_TT_PPP_EEE.safetensors   instead, under expert parallelism
//                                                        (ep > 1): one per (tp, pp, ep)
//
// Tensors are stored at their global names with the layout taken out: a file holds, for each
// parameter its (tp, pp) position owns, the rows (or columns) of its TP shard without
// vocabulary padding - tied embeddings once, from the first stage; kv heads that TP ranks
// share once, from the first of them - and with the optimizer `optimizer.exp_avg.<name>`,
// `optimizer.exp_avg_sq.<name>` and (bf16 parameters) `optimizer.master.<name>`, f32, the same
// slice. ZeRO shards are gathered over the DP group first; DP rank 0 writes. Under expert
// parallelism EP rank e's file holds experts [e·E/ep, (e+1)·E/ep) of every expert layer (their
// ZeRO shards gathered over the expert-DP group; expert-DP rank 0 writes), and EP rank 0's also
// everything else. The index in metadata.json gives each tensor's global shape, split dimension
// and the slice each file holds, so a loader takes from each file the part its own shard
// overlaps - and each expert from whichever file holds it.
//
// Atomic: every rank writes into a temporary beside <dir>/iter_0000100 and fsyncs its file; rank 0
// writes metadata.json last, renames the directory into place, fsyncs <dir>, then replaces the
// tracker file by rename. A process killed at any moment leaves the previous checkpoint and
// a tracker naming a complete one. Loading reads safetensors and JSON only: nothing in a
// checkpoint is executed.

#include <cstdint>
#include <memory>
#include <string>

#include "braid/engine/trainer.h"

namespace braid::engine {

// The newest format this braid reads. Version 2 marks a model that version-1 readers would
// compute differently (MoE routers other than Mixtral's softmax: sigmoid scores, expert biases,
// groups, a scaling factor, a capacity), version 3 one with multi-latent attention or YaRN RoPE,
// version 4 one with multi-token prediction depths, version 5 one with linear RoPE
// interpolation, version 6 one with interleaved RoPE pairs outside multi-latent attention,
// version 7 one with attention sinks, the quick GEGLU, a GLU offset or clamp, untruncated YaRN or
// a router bias (experts with add_bias_linear); every other checkpoint is written as version 1.
constexpr int kCheckpointFormatVersion = 7;

struct SaveOptions {
  bool save_optim = true;  // not --no-save-optim
  bool save_rng = true;    // not --no-save-rng
};

struct LoadOptions {
  bool load_optim = true;  // not --no-load-optim
  bool load_rng = true;    // not --no-load-rng
  bool finetune = false;   // --finetune: parameters only; iteration, optimizer and RNG start anew
  int64_t iteration = -1;  // --ckpt-step; -1: the tracker file's
};

// What the training loop keeps besides the Trainer.
struct LoopState {
  // The data loader's position, over all DP ranks. Saving -1: the Trainer's count
  // (Trainer::consumed_samples, where the dropout masks stand).
  int64_t consumed_samples = -1;
  // Device time the run has used up to this save, over every job that led to it (seconds x
  // devices): what pretrain_gpt.py's cost meter and --exit-cost count on. 0 after --finetune
  // and in checkpoints that predate it.
  double device_seconds = 0;
  // Samples of the batches Megatron's --iterations-to-skip dropped, over every job
  // (Megatron's skipped_train_samples); 0 in checkpoints that predate it.
  int64_t skipped_train_samples = 0;
  // The validation data's position: samples its evaluations have read, over every job
  // (Megatron's consumed_valid_samples). -1: not counted (metadata.json then has none, and
  // pretrain_gpt.py derives it from the iteration, as it does for checkpoints that predate it).
  int64_t consumed_valid_samples = -1;
};

// The iteration the tracker file in `dir` names; -1 when there is no checkpoint yet.
int64_t latest_iteration(const std::string& dir);
std::string iteration_directory(const std::string& dir, int64_t iteration);

// Collective over the model's world (every rank, the same arguments). Saves the trainer at its
// current iteration; returns the checkpoint's directory. Files go to a shared file system.
std::string save_checkpoint(const std::string& dir, Trainer& trainer, const LoopState& loop,
                            const SaveOptions& options = {});

// Saves into one directory, synchronously or (--async-save) in the background: save() gathers
// the state (ZeRO shards over DP: collective), copies what this rank writes to host memory and
// returns; a thread writes and fsyncs the files while training goes on. The save becomes the
// latest - directory renamed into place, tracker replaced - only when poll() (call it once
// per iteration, on every rank: one small all-reduce) sees every rank's files written, or at
// wait(). A save while one is in flight waits for it first. Destroying the saver with a save
// in flight joins the thread but commits nothing: the previous checkpoint stays the latest.
class CheckpointSaver {
 public:
  CheckpointSaver(std::string dir, bool async);
  ~CheckpointSaver();
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  std::string save(Trainer& trainer, const LoopState& loop, const SaveOptions& options = {});
  bool poll(const ParallelModel& model);  // true when it committed a save just now
  void wait(const ParallelModel& model);  // commits the save in flight, if any

  bool in_flight() const { return pending_ != nullptr; }
  int64_t last_committed() const { return last_committed_; }  // -1: none yet
  // How long the last save() kept the caller (the whole save when synchronous).
  double last_blocked_seconds() const { return last_blocked_seconds_; }

 private:
  struct Pending;
  void commit(const ParallelModel& model);

  std::string dir_;
  bool async_;
  std::unique_ptr<Pending> pending_;
  int64_t last_committed_ = -1;
  double last_blocked_seconds_ = 0;
};

// Collective. Loads the latest (or options.iteration) checkpoint of `dir` into the trainer -
// parameters, and unless told otherwise optimizer state, iteration counters, loss scale and
// dropout RNG - and returns the loop state it saved. ConfigError naming the file and tensor
// for anything that does not fit: no checkpoint, a missing or truncated file, a different
// model, a shape that disagrees with the config, a format version from the future.
LoopState load_checkpoint(const std::string& dir, Trainer& trainer,
                          const LoadOptions& options = {});

// Collective. Loads only the parameters of the latest (or `iteration`'s) checkpoint of `dir`
// into `model`, saved under any layout - for generation or evaluation: no optimizer state is
// read, and none need exist (no Trainer). Errors as load_checkpoint's.
void load_parameters(const std::string& dir, ParallelModel& model, int64_t iteration = -1);

}  // namespace braid::engine
