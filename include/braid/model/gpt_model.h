#pragma once
// GPTModel: embeddings, transformer blocks, final norm and LM head of one model chunk, with
// explicit forward and backward. Parameters live in one flat buffer (params_dtype) and
// their gradients in a mirrored f32 buffer (see parameters.h for the order).
//
// Activations the backward needs are kept per microbatch id, so a pipeline schedule can run
// several forwards before their backwards; backward(m) frees microbatch m's activations.
// config.recompute decides what each block keeps (transformer_layer.h), and with
// Recompute::full config.recompute_method / recompute_num_layers which of this chunk's blocks
// are recomputed, and in groups of how many (Megatron's --recompute-method). Across blocks the
// model keeps, per microbatch: the ids and targets on the device, the logits [B*S, V]
// (overwritten by their gradient in backward) and the cross-entropy statistics, and - with
// Recompute::none, or with MTP depths - the final norm's output and statistics; each MTP depth
// keeps its shifted ids and targets, lookup, [T, 2H] projection input, layer activations (its
// layer follows config.recompute), layer output, output, logits and statistics
// (docs/memory.md).
//
// Precision: parameters and activations have params_dtype (f32; bf16 on CUDA), norm
// statistics, attention log-sum-exp and cross-entropy partials are f32, and every gradient
// is accumulated in f32 by the op that produces it: matmul accumulates dW into the f32
// buffer from bf16 inputs, and bias_backward, the norm backwards and embedding_backward
// take bf16 activations with f32 dweight/dbias. No gradient passes through a bf16 temporary.
// f32 master weights live in the optimizer (engine/adamw.h).
//
// Tensor parallelism (TensorParallel, tensor_parallel.h): every rank of the TP group builds
// the model with the same config and seed and holds its shard of each parameter
// (parameters.h), initialised to exactly its slice of the unsharded model's weights. Ranks
// call forward/backward with the same ids and targets; the embedding and LM head are
// vocab-parallel and the cross-entropy never gathers the logits (it reduces the max, the sum
// of exponentials and the target logit). After the last microbatch's backward,
// finalize_grads() sums over TP the gradients that TP ranks hold partially: with sequence
// parallelism those of the norms and position embeddings; replicated kv heads' always.
//
// Context parallelism (ContextParallel, context_parallel.h): the ranks of a CP group build the
// model alike and are called with the same whole ids and targets; each runs its two chunks of
// every sequence, and forward returns the whole microbatch's mean loss (the group sums the
// chunks' losses). Every parameter gradient is then this rank's chunks' share: the caller sums
// the gradients over the group (the engine's DP×CP reduction does). logits() and decode() need
// the whole sequence and refuse it.
//
// Multi-token prediction (config.h, megatron-core's MultiTokenPredictionBlock): the last chunk
// holds the MTP depths after its layers and its own copy of embed_tokens (summed over the
// embedding group like tied embeddings). Training forwards run them after the main head
// (take_mtp_losses reports their losses); backward adds their gradient to the final norm's output.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "braid/core/tensor.h"
#include "braid/model/config.h"
#include "braid/model/context_parallel.h"
#include "braid/model/expert_parallel.h"
#include "braid/model/kv_cache.h"
#include "braid/model/parameters.h"
#include "braid/model/tensor_parallel.h"
#include "braid/model/transformer_layer.h"

namespace braid::model {

class GPTModel {
 public:
  // Validates the config (ConfigError); bf16 parameters need a CUDA device. Parameters are
  // initialised as init.h describes.
  // With tp.group, ConfigError (before any communication, alike on every rank) when the model
  // does not split over it; then collective over tp.group (replicated kv heads get a group).
  // `chunk`: the layers (and embedding / head) this pipeline stage holds (parameters.h).
  // `buffer_elements`: the flat buffers hold at least this many elements (zeros past the
  // layout's num_elements), so data parallelism can cut them into equal shards (grad_buffer.h).
  // `cp`: the context-parallel group (above). `ep`: the expert-parallel group; the model holds
  // its share of the experts (ExpertParallel::holding: `chunk`'s expert range is replaced).
  GPTModel(const TransformerConfig& config, Device device, uint64_t seed,
           const TensorParallel& tp = {}, const ModelChunk& chunk = {}, int64_t buffer_elements = 0,
           const ContextParallel& cp = {}, const ExpertParallel& ep = {});
  ~GPTModel();
  GPTModel(const GPTModel&) = delete;
  GPTModel& operator=(const GPTModel&) = delete;

  const TransformerConfig& config() const { return config_; }
  Device device() const { return device_; }
  uint64_t seed() const { return seed_; }
  const ParamLayout& layout() const { return layout_; }
  const TensorParallel& tensor_parallel() const { return tp_; }
  const ContextParallel& context_parallel() const { return cp_; }
  const ExpertParallel& expert_parallel() const { return ep_; }
  const ModelChunk& chunk() const { return layout_.chunk; }

  std::vector<Parameter>& parameters() { return params_; }  // flat-buffer order
  const std::vector<Parameter>& parameters() const { return params_; }
  Parameter& parameter(const std::string& name);  // Error naming the unknown name
  const Tensor& flat_params() const { return flat_params_; }
  const Tensor& flat_grads() const { return flat_grads_; }
  int64_t num_parameters() const { return layout_.num_parameters; }

  // ids, targets: [B, S] i32 on any device (copied to the model's device if needed);
  // targets < 0 are ignored. With sequence parallelism S must be divisible by the TP size (with
  // context parallelism S / cp), with context parallelism by 2 · cp. Returns
  // the mean loss over the non-ignored targets (0 when there are none) and keeps what backward
  // needs under `microbatch`, which must not hold activations already.
  float forward(const Tensor& ids, const Tensor& targets, int microbatch = 0);
  // Adds d(grad_scale * loss)/d(params) into the gradients (dloss = grad_scale / count per
  // non-ignored target) and frees the microbatch's activations.
  void backward(int microbatch = 0, float grad_scale = 1.0f);

  // Pipeline stages. forward_stage: ids (and, on the last stage, targets) as forward takes
  // them — every stage gets the microbatch's ids, for its shape; a chunk without the embedding
  // takes `input`, the previous stage's output activation [T_region, H]. Returns this chunk's
  // output activation, or (the last stage) an undefined tensor and the mean loss in *loss.
  // backward_stage: `dout` is the output activation's gradient (undefined on the last stage);
  // returns the input activation's gradient (undefined on the first stage).
  // training = false (evaluation): no dropout, nothing kept for a backward, and the dropout
  // random state does not advance. first_sample: the run-wide index of the microbatch's first
  // sequence, the key of its dropout masks (Trainer passes the data position); -1 (forward, and
  // the default): the next ids.size(0) of this model's count of training sequences.
  Tensor forward_stage(const Tensor& ids, const Tensor& targets, const Tensor& input,
                       int microbatch, float* loss = nullptr, bool training = true,
                       int64_t first_sample = -1);
  Tensor backward_stage(const Tensor& dout, int microbatch, float grad_scale = 1.0f);
  // The first and last stages of this model's pipeline (tied embeddings): finalize_grads sums
  // the embed_tokens gradients over it. nullptr (the default) or one rank: nothing to sum.
  void set_embedding_group(comm::Communicator* group) { embedding_group_ = group; }
  // Document masking (Megatron's --reset-attention-mask and --reset-position-ids): a document
  // runs up to and including each `eod` token of a sequence. With reset_attention_mask a token
  // attends to its own document's tokens only; with reset_position_ids its position (rope,
  // learned position embeddings) counts from its document's first token. Applies to forward,
  // forward_stage and logits, not to decode (a KV cache's prompt is one document). Off by
  // default; ConfigError unless eod is a token of the vocabulary when either flag is set.
  void set_document_masking(int32_t eod, bool reset_attention_mask, bool reset_position_ids);
  // Completes the gradients of this step's microbatches across TP (see above); a no-op on
  // one rank. Call once after the last backward, before clipping and the optimizer.
  void finalize_grads();
  // [B, S, V] f32 on the CPU; keeps no activations and applies no dropout.
  Tensor logits(const Tensor& ids);
  void zero_grad();

  // Inference with a KV cache (kv_cache.h). kv_cache: an empty cache for `batch` sequences of
  // up to `capacity` positions (0: max_position_embeddings) on the model's device.
  KVCache kv_cache(int64_t batch, int64_t capacity = 0) const;
  // ids [B, n] i32: the next n tokens of the B sequences whose first cache.length() tokens
  // the cache holds (prefill: an empty cache and the prompts; then n = 1 per decoding step).
  // Runs the n positions alone, appends their keys and values to the cache and returns their
  // logits [B, n, V] f32 on the CPU - with last_only, [B, 1, V] of the last position only -
  // equal to those logits() gives for the whole sequence. No dropout. ConfigError when
  // cache.length() + n exceeds max_position_embeddings or the cache's capacity. The whole
  // model only (not a pipeline stage); under TP every rank calls it alike, without sequence
  // parallelism.
  Tensor decode(const Tensor& ids, KVCache& cache, bool last_only = false);

  // Hooks for data parallelism (engine/grad_buffer.h). Parameters are named by their index in
  // parameters(). The model runs in pieces - the embeddings, each layer, the head (final norm
  // and output weight) - and calls
  //   param_use(params)             before a forward (or logits) reads a piece's parameters;
  //   grads_done(microbatch, params) after backward_stage(microbatch) has added its last
  //                                 contribution to them (each parameter once per call: a tied
  //                                 embedding that both ends use is reported with the embeddings).
  // An MTP depth is a piece of its own (its norms, eh_proj and layer), after the head.
  using ParamUseHook = std::function<void(std::span<const size_t> params)>;
  using GradsDoneHook = std::function<void(int microbatch, std::span<const size_t> params)>;
  void set_param_use_hook(ParamUseHook hook) { param_use_ = std::move(hook); }
  void set_grads_done_hook(GradsDoneHook hook) { grads_done_ = std::move(hook); }

  bool has_activations(int microbatch) const { return activations_.count(microbatch) > 0; }
  // The tokens of a residual-stream region (a pipeline stage's input and output activation
  // rows) for a microbatch of `tokens`: this rank's share under context and sequence
  // parallelism.
  int64_t region_tokens(int64_t tokens) const {
    return tokens / cp_.size() / (tp_.sharded_tokens() ? tp_.size() : 1);
  }

  // Mixture of experts: the router losses (moe.h, without their coefficients) of each expert
  // layer this chunk holds, by global layer index, summed over the microbatches whose backward
  // ran since the last call (this rank's tokens' share under context parallelism); resets them.
  std::vector<std::pair<int64_t, MoeLosses>> take_moe_losses();
  // Multi-token prediction (config.h): per depth, the sum of its cross-entropies over the
  // non-ignored shifted targets and their count, summed over the training forwards of this
  // chunk (the last stage) since the last call; the whole microbatches' under TP and CP. Empty
  // without MTP depths; resets them.
  struct MtpLoss {
    double sum = 0;
    int64_t count = 0;
  };
  std::vector<MtpLoss> take_mtp_losses();
  // Auxiliary-loss-free balancing (moe_router_enable_expert_bias): the bias [E] f32 (on the
  // device, zeros at first) of each expert layer this chunk holds, in layer order, named as HF
  // names DeepSeek-V3's: model.layers.{i}.mlp.gate.e_score_correction_bias. Not parameters:
  // no gradient, no optimizer; checkpoints save them.
  const std::vector<std::pair<std::string, Tensor>>& expert_biases() const {
    return expert_biases_;
  }
  // Megatron's update, after a step's backwards: each bias moves by moe_router_bias_update_rate
  // × sign(mean − tokens) per expert, for the tokens its experts took in the backwards since the
  // last call, summed over `group` (the data × context parallel ranks; nullptr: this rank's);
  // resets the counts. Collective over `group` when the chunk has biases.
  void update_expert_bias(comm::Communicator* group);

  // Dropout's random state: each mask is a Philox stream of (seed, site) at its sequences'
  // run-wide indices (forward_stage's first_sample), or, for forwards without one, at this
  // model's count of the training sequences it forwarded. Checkpoints save the seed and set it
  // back (the Trainer the data position); setting it does not re-initialise the parameters.
  int64_t dropout_samples() const { return dropout_samples_; }
  void set_dropout_seed(uint64_t seed) { seed_ = seed; }

 private:
  // What one forward keeps for its backward (model/gpt_model_internal.h).
  struct HeadPass;
  struct MtpDepth;
  struct Microbatch;

  void build_parameters(int64_t buffer_elements);
  void param_use(const std::vector<size_t>& params) const {
    if (param_use_) param_use_(params);
  }
  void grads_done(int microbatch, const std::vector<size_t>& params) const {
    if (grads_done_) grads_done_(microbatch, params);
  }
  // Checks ids (and targets, when defined) and puts them on the device; with their documents'
  // Tokens::key_start and positions when set_document_masking asks and `documents` is true.
  Microbatch prepare(const Tensor& ids, const Tensor& targets, bool documents = true) const;
  // Sets mb's document tables (document_masking.cpp) from the host ids [b, s] of the whole
  // sequences, when set_document_masking asks for them.
  void prepare_documents(Microbatch& mb, const int32_t* ids, int64_t b, int64_t s) const;
  Tensor final_norm(const Tensor& x, NormStats& stats) const;
  LayerTensors layer_tensors(const Tensor& flat, int layer) const;
  Tensor view_of(const Tensor& flat, const std::string& name) const;
  // A run of adjacent parameters starting at `first` as one [rows, cols] (or [rows]) view.
  Tensor fused_view(const Tensor& flat, const std::string& first, int64_t rows, int64_t cols) const;
  const ParamShard& shard_of(const std::string& name) const;
  int64_t vocab_start() const;  // first vocabulary row of this rank's slice
  Tokens tokens_of(const Microbatch& mb) const;
  int64_t region_tokens(const Microbatch& mb) const;  // tokens a residual-stream region holds
  // The vocab-parallel cross-entropy's partials, combined across TP.
  void cross_entropy_partials(HeadPass& pass, Tensor& target_logit) const;
  // The output head and cross-entropy on a final norm's output hf [T_region, H]: keeps the
  // logits and statistics in `pass` and returns the sum of the losses of this rank's tokens
  // (all of them under TP; this rank's chunks under CP).
  double head_forward(HeadPass& pass, const Tensor& hf);
  // Its backward for dloss per non-ignored target: adds to the output weight's gradient, frees
  // the logits and returns d(hf) [T_region, H].
  Tensor head_backward(HeadPass& pass, const Tensor& hf, float dloss);
  // The vocab-parallel lookup of ids [B, S] (their region's rows [T_region, H]), and its backward
  // into embed_tokens' gradient.
  Tensor lookup_tokens(const Tensor& ids) const;
  void lookup_tokens_backward(const Tensor& dx, const Tensor& ids);
  // Hidden dropout on the residual stream at dropout site `site` (none when not training), and
  // its backward.
  Tensor dropout(const Microbatch& mb, Tensor x, uint64_t site, bool training) const;
  Tensor dropout_backward(const Microbatch& mb, Tensor dx, uint64_t site) const;
  // Multi-token prediction (multi_token_prediction.cpp), on the last stage of a training
  // forward: the shifted ids and targets of each depth, the depths' forward from the final
  // norm's output h0, and their backward, which returns d(h0).
  void mtp_prepare(Microbatch& mb, const Tensor& ids, const Tensor& targets) const;
  void mtp_forward(Microbatch& mb, const Tensor& h0);
  Tensor mtp_backward(Microbatch& mb, int microbatch, float grad_scale);
  // The main layers this chunk holds (layers_ holds the MTP depths' after them).
  size_t trunk_layers() const { return size_t(layout_.chunk.end_layer - first_layer_); }
  DropoutContext dropout_context(const Microbatch& mb, int layer, bool training) const;
  // [T_region, H]; learned positions start at position_offset (decode: the cache's length).
  Tensor embed(Microbatch& mb, bool training, int64_t position_offset = 0);
  Tensor run_layers(Microbatch& mb, Tensor x, bool training);
  // The policy block l of this chunk runs under, and the blocks of one uniform recompute group
  // (1 unless Recompute::full with RecomputeMethod::uniform): a group keeps its first block's
  // input alone, and its backward first reruns the whole group's forward (rerun_group).
  Recompute layer_policy(size_t l) const;
  size_t recompute_group() const;
  void rerun_group(Microbatch& mb, size_t begin, size_t end) const;
  // The LM head over the final norm's output hf [B * S, H]: [B, S, V] f32 on the CPU, the
  // vocabulary slices of the TP ranks gathered.
  Tensor head_logits(const Tensor& hf, int64_t batch, int64_t seq);
  const Tensor& output_weight() const;
  Tensor& output_grad();

  TransformerConfig config_;
  Device device_;
  uint64_t seed_;
  TensorParallel tp_;
  ContextParallel cp_;
  ExpertParallel ep_;
  std::shared_ptr<comm::Communicator> kv_group_;  // TP ranks that share a replicated kv head
  comm::Communicator* embedding_group_ = nullptr;
  int32_t eod_ = -1;  // set_document_masking's
  bool reset_attention_mask_ = false, reset_position_ids_ = false;
  int first_layer_ = 0;
  ParamLayout layout_;
  Tensor flat_params_;
  Tensor flat_grads_;
  std::vector<Parameter> params_;
  std::unordered_map<std::string, size_t> index_;
  std::vector<TransformerLayer> layers_;
  // The pieces' parameters (hooks above): embeddings, each held layer, head.
  std::vector<size_t> embedding_params_, head_params_;
  std::vector<std::vector<size_t>> layer_params_;
  ParamUseHook param_use_;
  GradsDoneHook grads_done_;
  std::map<int, std::unique_ptr<Microbatch>> activations_;
  int64_t dropout_samples_ = 0;      // training sequences forwarded without a first_sample
  std::vector<MoeStats> moe_stats_;  // per held layer
  std::vector<std::pair<std::string, Tensor>> expert_biases_;
  std::vector<MtpLoss> mtp_losses_;  // per MTP depth, since take_mtp_losses
};

}  // namespace braid::model
