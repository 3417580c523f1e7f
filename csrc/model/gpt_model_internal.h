#pragma once
// What GPTModel's translation units (gpt_model.cpp, multi_token_prediction.cpp) share: the
// activations one microbatch keeps for its backward, and small helpers.

#include <cstdint>
#include <vector>

#include "braid/model/gpt_model.h"

namespace braid::model {

// One LM head pass: the output head's logits and the cross-entropy statistics over one normed
// activation (the main head's, or an MTP depth's).
struct GPTModel::HeadPass {
  Tensor targets;      // [B, S] i32 on the model's device (context parallelism: [2B, L])
  int64_t count = 0;   // non-ignored targets of the whole microbatch
  Tensor logits;       // [T, V_local]; becomes dlogits in backward
  Tensor max, sumexp;  // [T] f32, combined across TP
};

// What MTP depth k keeps for its backward (multi_token_prediction.cpp).
struct GPTModel::MtpDepth {
  Tensor ids;       // the ids shifted left by k, as Microbatch::ids
  HeadPass head;    // its targets: the targets shifted left by k
  Tensor embedded;  // [T_region, H] the lookup of ids: enorm's input
  Tensor hidden;    // [T_region, H] h_{k-1}: hnorm's input
  NormStats enorm_stats, hnorm_stats;
  Tensor projection_input;  // [T_region, 2H] [enorm(embedded) | hnorm(hidden)]
  LayerActivations layer;
  Tensor layer_out;  // [T_region, H] shared_head.norm's input
  NormStats out_stats;
  Tensor out;  // [T_region, H] h_k
};

struct GPTModel::Microbatch {
  Tensor ids;        // [B, S] i32 on the model's device (context parallelism: [2B, L])
  Tensor positions;  // [T_region] i32, learned position embeddings only
  // Document masking (Tokens' fields, GPTModel::set_document_masking): [B, S] i32, and each
  // token's position in its document [B, S] i32 (context parallelism: [2B, L]) on the device and
  // on the host (learned position embeddings read it there). Undefined when the microbatch's
  // sequences hold one document each.
  Tensor key_start, doc_positions, doc_positions_host;
  // Training forwards: the run-wide index of the microbatch's first sequence and of its first
  // token (first_sample × S), the key of its dropout masks (forward_stage's first_sample).
  int64_t first_sample = 0, first_token = 0;
  std::vector<LayerActivations> layers;
  Tensor trunk_out;           // [T_region, H] the last block's output: the final norm's input
  NormStats final_stats;      // Recompute::none, or with MTP
  Tensor final_out;           // Recompute::none, or with MTP
  HeadPass head;              // the main head; its targets are the microbatch's
  std::vector<MtpDepth> mtp;  // training forwards of the last stage with MTP
};

namespace gpt_model_detail {

// The Philox seed of dropout masks: distinct from the parameter streams' seed.
constexpr uint64_t kDropoutSeedSalt = 0xD6E8FEB86659FD93ull;

inline Tensor host_copy(const Tensor& t) { return t.device().is_cpu() ? t : t.to(Device::cpu()); }

// The Philox streams of the dropout sites, each one mask over every token the run trains on
// (its element index: run-wide token × H + channel): the embedding output is stream 0; block
// l's attention and MLP outputs are 2l + 1 and 2l + 2 (MTP depth k's layer is block
// num_layers + k - 1); MTP depth k's embedding output is 2 (num_layers + mtp_num_layers) + k.
// Block l's attention probabilities are stream 2^31 + l (ops::AttentionDropout's, split further
// per sequence and head).
constexpr uint64_t kAttentionProbsSite = uint64_t(1) << 31;

inline Tensor filled(const Shape& shape, float value, Device device) {
  Tensor host = Tensor::empty(shape, DType::f32);
  float* p = host.data_ptr<float>();
  for (int64_t i = 0; i < host.numel(); ++i) p[i] = value;
  return host.to(device);
}

// `value` summed over `group` (through its device, in f32).
inline double sum_over(comm::Communicator& group, double value) {
  Tensor t = filled({1}, float(value), group.device());
  group.all_reduce(t)->wait();
  return t.to(Device::cpu()).item(0);
}

}  // namespace gpt_model_detail

}  // namespace braid::model
