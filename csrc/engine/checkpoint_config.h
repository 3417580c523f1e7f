#pragma once
// A checkpoint's model config (metadata.json "config", docs/checkpoints.md): what a save writes,
// and the check that a load's model is the saved one.

#include <nlohmann/json.hpp>
#include <string>

#include "braid/model/config.h"

namespace braid::engine {

nlohmann::json config_json(const model::TransformerConfig& config);

// The format version a checkpoint of `config` is written as (checkpoint.h): 3 for a model with
// multi-latent attention or YaRN RoPE, 2 for one with the MoE router features version-1 readers
// do not know, else 1.
int format_version(const model::TransformerConfig& config);

// ConfigError naming the first field that makes the checkpoint (its saved config `saved`, read
// from `where`) a different model from `config`. Numerics (RoPE base and scaling, norm epsilon)
// may differ: a run may change them on purpose.
void check_same_model(const nlohmann::json& saved, const model::TransformerConfig& config,
                      const std::string& where);

}  // namespace braid::engine
