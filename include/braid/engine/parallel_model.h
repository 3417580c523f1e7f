#pragma once
// ParallelModel: this rank's share of a GPT model under a (tp, pp, dp) layout - its model
// chunks, one per virtual pipeline stage, and their data-parallel gradient buffers (the role
// of Megatron's DistributedDataParallel wrapper).
//
// Every rank builds from the same config and seed and holds exactly its slice of the weights
// the single-rank model would have (parameters.h, init.h), so a layout never changes the
// model. Chunk c of pipeline rank r holds model chunk c·pp + r (Megatron's interleaving),
// with the layers engine::stage_layers gives it. Under expert parallelism (ep > 1) a chunk
// holds its EP rank's experts only (model/expert_parallel.h), whose gradients its buffer
// reduces over the expert-DP group (grad_buffer.h).

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "braid/comm/parallel_state.h"
#include "braid/comm/progress.h"
#include "braid/engine/grad_buffer.h"
#include "braid/engine/schedule.h"
#include "braid/model/gpt_model.h"

namespace braid::engine {

struct ParallelConfig {
  bool sequence_parallel = false;  // --sequence-parallel
  int virtual_stages = 1;          // model chunks per pipeline rank (interleaved 1F1B when > 1)
  DDPConfig ddp;
  // Uneven pipeline stages (--decoder-first-pipeline-num-layers / --decoder-last-...): the
  // layers of the first / last pipeline rank; the other ranks split the rest evenly. Unset:
  // every rank holds num_layers / pp. Lightening the last stage offsets its LM head and loss.
  std::optional<int> first_stage_layers = std::nullopt;
  std::optional<int> last_stage_layers = std::nullopt;
  // Every model chunk's layers (stage_layers' model_chunk_layers): Megatron's
  // --pipeline-model-parallel-layout, --account-for-embedding/loss-in-pipeline-split. Empty: the
  // rule above.
  std::vector<int> model_chunk_layers = {};

  // ConfigError (same on every rank, before any communication) unless the model splits over
  // the layout: the TP rules (check_tensor_parallel), the layers over pp × virtual_stages
  // (stage_layers), virtual stages only with pp > 1, the DDP options, and the experts over ep
  // (check_expert_parallel) with a bucket boundary between experts' parameters and the others
  // (make_buckets' split_experts).
  void validate(const model::TransformerConfig& config, const comm::RankGrid& grid) const;
  // stage_layers under this config: [pp rank][chunk].
  std::vector<std::vector<LayerRange>> layers(int num_layers, int pp) const;
};

// What chunk c of pipeline rank pp_rank holds, given every rank's layers (stage_layers):
// model chunk c·pp + pp_rank's layers, the embeddings if it is model chunk 0, the head if it
// is the last one.
model::ModelChunk pipeline_chunk(const std::vector<std::vector<LayerRange>>& layers, int pp_rank,
                                 int chunk);

class ParallelModel {
 public:
  // Collective over state.world(). The communicators must work on `device`.
  ParallelModel(const model::TransformerConfig& config, Device device, uint64_t seed,
                const comm::ParallelState& state, const ParallelConfig& parallel);
  // One process: wraps `model` (not owned); no communication, nothing to reduce.
  explicit ParallelModel(model::GPTModel& model);
  ~ParallelModel();
  ParallelModel(const ParallelModel&) = delete;
  ParallelModel& operator=(const ParallelModel&) = delete;

  const comm::ParallelState* state() const { return state_; }  // nullptr: one process
  const ParallelConfig& parallel() const { return parallel_; }
  const model::TransformerConfig& config() const { return chunks_.front()->config(); }
  Device device() const { return chunks_.front()->device(); }
  int num_chunks() const { return int(chunks_.size()); }
  model::GPTModel& chunk(int c) const { return *chunks_[size_t(c)]; }
  std::vector<model::GPTModel*> chunks() const { return chunks_; }
  GradBuffer& grad_buffer(int c) const { return *buffers_[size_t(c)]; }
  bool is_last_stage() const { return state_ == nullptr || state_->is_last_stage(); }

  void zero_grad();
  // Around one step's backwards: arm the buckets, then wait for every reduction and complete
  // the gradients across TP and the embedding group (GPTModel::finalize_grads).
  void start_grad_sync(int microbatches);
  void finish_grad_sync();
  // ZeRO: share the updated parameter shards (GradBuffer::start_param_gather); wait for them.
  void start_param_gather();
  void finish_param_gather();

  // Every parameter's global value, from all TP shards and pipeline stages, into `whole` - a
  // one-process GPTModel of the same config (for evaluation and tests; it holds the whole model
  // on every rank). Collective over the world.
  void gather_into(model::GPTModel& whole);

 private:
  const comm::ParallelState* state_ = nullptr;
  ParallelConfig parallel_;
  std::vector<std::unique_ptr<model::GPTModel>> owned_;
  std::vector<model::GPTModel*> chunks_;
  std::unique_ptr<comm::ProgressThread> progress_;
  std::vector<std::unique_ptr<GradBuffer>> buffers_;
};

}  // namespace braid::engine
