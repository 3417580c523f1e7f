#pragma once
// Parameter initialisation as a pure function of (seed, global parameter name, global
// element index): element i of parameter `name` is
//   std * normal_from_words(random_words(seed, philox::stream_of(name), i))
// for weights, with std = init_std, and init_std / sqrt(2 * num_layers) for the output
// projections o_proj and down_proj (Megatron's scaled init), embedding_init_std for the word and
// position embeddings when it is set, init_std for the attention sinks and the router's bias
// (megatron-core's); the other biases are 0 and norm weights 1.
// A TP/PP shard therefore initialises to exactly its slice of the unsharded weights.

#include <cstdint>
#include <span>

#include "braid/core/tensor.h"
#include "braid/model/config.h"
#include "braid/model/parameters.h"

namespace braid::model {

enum class InitKind { normal, zeros, ones };

struct InitRule {
  InitKind kind = InitKind::normal;
  float std = 0.0f;  // for InitKind::normal
};

InitRule init_rule(const ParamSpec& spec, const TransformerConfig& config);

// Elements [start, start + out.size()) of the parameter, flattened row-major in its global
// shape, into host memory.
void init_values(std::span<float> out, const ParamSpec& spec, const TransformerConfig& config,
                 uint64_t seed, int64_t start = 0);

// The same numbers into `value` (any device; f32, or bf16 rounded to nearest even): element
// j of `value` gets global element start + j. Computed on the host and copied.
void init_parameter(Tensor value, const ParamSpec& spec, const TransformerConfig& config,
                    uint64_t seed, int64_t start = 0);

}  // namespace braid::model
