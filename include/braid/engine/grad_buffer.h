#pragma once
// Data parallelism over one model chunk's flat buffers: gradient buckets reduced across the
// DP group as soon as the backward has finished them, and (ZeRO-1) each DP rank's shard.
//
// Buckets. The f32 gradient buffer (GPTModel::flat_grads) is cut into contiguous buckets,
// built from the last parameter back, since the backward finishes gradients in that order.
// A bucket closes once it holds at least `bucket_size` elements (Megatron's rule: default
// max(40M, 1M·dp) elements; one bucket for the whole chunk without --overlap-grad-reduce, and
// for every model chunk but the first, as Megatron disables bucketing there). Boundaries
// are multiples of dp, so every bucket splits into dp equal shards; the model's buffers are
// padded at the end for the last one (GPTModel's buffer_elements). With ZeRO under pipeline
// parallelism and tied embeddings, embed_tokens (offset 0 on both the first and the last
// stage) is a bucket of its own, so both stages shard it alike and the embedding group's
// all-reduce after the reduce-scatter sums matching rows.
//
// Reduction. The model reports each parameter's gradient as done after each microbatch's
// backward (GPTModel::set_grads_done_hook); when every parameter of a bucket has seen all of
// the step's microbatches and --overlap-grad-reduce is on, the bucket's reduction is posted
// at once, while the backward goes on with earlier layers. Without ZeRO it is an all-reduce
// (sum), with ZeRO a reduce-scatter that leaves rank r's shard summed. Gradients are summed,
// not averaged: the trainer scales each microbatch by its share of the global batch's tokens.
// On CUDA the reductions run on a stream of their own, ordered after the compute stream's
// work by an event; on the CPU a ProgressThread keeps MPI moving while the main thread
// computes. finish_grad_sync() posts whatever is left and waits for everything.
//
// Expert parallelism. An EP rank holds only its experts (model/expert_parallel.h), and their
// gradients already hold every EP peer's tokens' contributions (the token all-to-all brought
// them). So buckets never mix expert parameters with the others (make_buckets' split_experts),
// and an expert bucket is reduced, sharded and gathered over the expert-data-parallel group -
// the ranks holding the same experts - instead of the DP group; its sum is again the whole
// batch's gradient. Bucket boundaries stay multiples of dp, which the expert-DP size divides.
//
// --grad-reduce-in-bf16. Each bucket is rounded to bf16 into a staging buffer of its own
// (half the bucket's bytes, kept from step to step), reduced as bf16 - through NCCL half the
// bytes on the wire, each step of its ring rounding to bf16; through MPI (CPU) widened to f32,
// summed and rounded once - and widened back into the f32 buffer (the shard of it with ZeRO).
// Megatron keeps the whole gradient buffer in bf16 instead, accumulating the microbatches in
// bf16 too; braid accumulates in f32 and rounds once per step, before the reduction.
//
// ZeRO-1. After the optimizer has updated this rank's shards, start_param_gather()
// all-gathers every bucket's parameters. With --overlap-param-gather the gathers run during
// the next forward: before a piece of the model reads its parameters
// (GPTModel::set_param_use_hook) the buckets holding them are waited for.

#include <cstdint>
#include <memory>
#include <vector>

#include "braid/comm/communicator.h"
#include "braid/comm/progress.h"
#include "braid/core/stream.h"
#include "braid/model/gpt_model.h"

namespace braid::engine {

struct DDPConfig {
  int64_t bucket_size = 0;                 // --ddp-bucket-size, elements; 0: Megatron's default
  bool overlap_grad_reduce = false;        // --overlap-grad-reduce
  bool use_distributed_optimizer = false;  // --use-distributed-optimizer (ZeRO-1)
  bool overlap_param_gather = false;       // --overlap-param-gather (needs ZeRO)
  bool grad_reduce_in_bf16 = false;        // --grad-reduce-in-bf16: reduce bf16 copies

  void validate() const;  // ConfigError naming the flag
  // The bucket size the rule above gives for `dp` ranks (bucket_size when set).
  int64_t bucket_elements(int dp) const;
};

struct ElementRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

struct Bucket {
  ElementRange range;          // elements of the chunk's flat buffers; size divisible by dp
  std::vector<size_t> params;  // parameters with elements in it, flat order
  bool expert = false;         // experts' parameters only: reduced, sharded over expert-DP
  ElementRange shard(int dp_rank, int dp_size) const;
};

// The buckets of a chunk with `layout`, bucket 0 holding the last parameters. `bucketed`:
// cut at bucket_size (else one bucket, and the separate embedding bucket where needed).
// `separate_embedding`: embed_tokens gets a bucket of its own (ZeRO + pp > 1 + tied).
// `split_experts` (expert parallelism): a bucket also closes wherever the parameters change
// between experts' (spec.expert >= 0) and the others, and expert buckets are marked; ConfigError
// when such a change has no multiple of dp_size between the two parameters' elements (a layout
// with ModelChunk::expert_alignment = dp_size always has one, as ParallelModel builds them).
std::vector<Bucket> make_buckets(const model::ParamLayout& layout, int dp_size, int64_t bucket_size,
                                 bool bucketed, bool separate_embedding,
                                 bool split_experts = false);
// Elements the flat buffers need for these buckets (the end of the last).
int64_t buffer_elements(const std::vector<Bucket>& buckets);

class GradBuffer {
 public:
  // `dp`: the DP group (nullptr or one rank: no communication). `expert_dp`: the expert
  // buckets' group (nullptr: `dp`; one rank: no communication). `progress`: the thread that
  // progresses CPU collectives (nullptr on CUDA). Installs the model's hooks; the model's
  // flat buffers must hold buffer_elements(buckets).
  GradBuffer(model::GPTModel& model, comm::Communicator* dp, comm::Communicator* expert_dp,
             const DDPConfig& config, std::vector<Bucket> buckets, comm::ProgressThread* progress);
  ~GradBuffer();  // waits for what is in flight, removes the hooks
  GradBuffer(const GradBuffer&) = delete;
  GradBuffer& operator=(const GradBuffer&) = delete;

  model::GPTModel& model() const { return model_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  int dp_size() const { return dp_ != nullptr ? dp_->size() : 1; }
  int dp_rank() const { return dp_ != nullptr ? dp_->rank() : 0; }
  // The group a bucket is reduced, sharded and gathered over: the expert-DP group for expert
  // buckets, else the DP group; nullptr where it has one rank.
  comm::Communicator* group(const Bucket& b) const { return b.expert ? expert_dp_ : dp_; }
  int group_size(const Bucket& b) const { return group(b) != nullptr ? group(b)->size() : 1; }
  int group_rank(const Bucket& b) const { return group(b) != nullptr ? group(b)->rank() : 0; }
  bool sharded() const { return config_.use_distributed_optimizer; }
  // Whether any bucket has a group to be reduced over.
  bool communicates() const { return dp_ != nullptr || expert_dp_ != nullptr; }
  // The elements this rank's optimizer updates: its shard (over the bucket's group) of every
  // bucket with ZeRO, else the whole of every bucket.
  std::vector<ElementRange> owned_ranges() const;

  // Before the step's first backward: the step runs `microbatches` backwards per parameter.
  void start_grad_sync(int microbatches);
  // After the last backward: posts the buckets not posted yet, in bucket order, and waits for
  // every one. Then the owned ranges hold the DP sums.
  void finish_grad_sync();
  // ZeRO: after the optimizer step, all-gathers every bucket's parameters (first layers
  // first); waits for them unless --overlap-param-gather.
  void start_param_gather();
  // Waits for every gather in flight (also done piecewise by the forward's hook).
  void finish_param_gather();

  // The reductions of the last step, for tests and the overlap benchmark: when each was
  // posted and when finish_grad_sync's wait for it returned (steady_clock nanoseconds), and
  // whether the backward's hook posted it (overlapped) or finish_grad_sync did.
  struct Span {
    int bucket;
    int64_t posted_ns;
    int64_t done_ns;
    bool during_backward;
  };
  const std::vector<Span>& reduce_spans() const { return spans_; }

 private:
  void on_grads_done(int microbatch, std::span<const size_t> params);
  void on_param_use(std::span<const size_t> params);
  void post_reduce(size_t bucket, bool during_backward);
  void wait(comm::WorkPtr& work);
  Stream comm_stream() const { return comm_stream_ ? comm_stream_->get() : Stream{}; }

  model::GPTModel& model_;
  comm::Communicator* dp_;
  comm::Communicator* expert_dp_;
  DDPConfig config_;
  std::vector<Bucket> buckets_;
  comm::ProgressThread* progress_;
  std::unique_ptr<SideStream> comm_stream_;
  std::vector<std::vector<size_t>> buckets_of_param_;  // param -> buckets holding it
  // This step: backwards seen per parameter, parameters not yet done per bucket.
  int microbatches_ = 0;
  std::vector<int> backwards_seen_;
  std::vector<int> params_pending_;
  std::vector<comm::WorkPtr> reduce_work_;  // per bucket, while in flight
  std::vector<Tensor> bf16_grads_;          // per bucket with --grad-reduce-in-bf16
  // Widens bucket b's reduced bf16 gradients (its shard with ZeRO) into the f32 buffer.
  void widen_reduced(size_t b);
  std::vector<comm::WorkPtr> gather_work_;  // per bucket, while in flight
  std::vector<Span> spans_;
};

}  // namespace braid::engine
