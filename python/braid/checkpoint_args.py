"""A checkpoint's model config (metadata.json, docs/checkpoints.md) against pretrain_gpt.py's
arguments: Megatron's --use-checkpoint-args takes the model arguments from it, and a run whose
numerics differ from it is told so. The model is what the parameters compute with, the router's
choice included, and its multi-token prediction layers; the training objective's knobs (the
load-balancing and z-loss coefficients, the expert-bias update rate, the MTP loss's scaling
factor) stay the command line's."""

from __future__ import annotations

import struct

from braid.attention_args import YARN_DEFAULTS, YARN_FIELDS, YARN_FIXED, YARN_FLAGS


# The checkpoint's metadata.json "config" key -> [(argument, its value)]
FROM_CHECKPOINT = {
    "num_layers": lambda v: [("num_layers", v)],
    "hidden_size": lambda v: [("hidden_size", v)],
    "num_attention_heads": lambda v: [("num_attention_heads", v)],
    "num_query_groups": lambda v: [("num_query_groups", v)],
    "kv_channels": lambda v: [("kv_channels", v)],
    "ffn_hidden_size": lambda v: [("ffn_hidden_size", v)],
    "vocab_size": lambda v: [("vocab_size", v)],
    "max_position_embeddings": lambda v: [("max_position_embeddings", v)],
    "normalization": lambda v: [("normalization", {"layernorm": "LayerNorm",
                                                   "rmsnorm": "RMSNorm"}[v])],
    "activation": lambda v: [("swiglu", v == "swiglu"), ("quick_geglu", v == "quick_geglu"),
                             ("squared_relu", v == "squared_relu")],
    "glu_linear_offset": lambda v: [("glu_linear_offset", _f32(v) or None)],
    "activation_clamp": lambda v: [("activation_func_clamp_value", _f32(v) or None)],
    "softmax_type": lambda v: [("softmax_type", v)],
    "position_embedding": lambda v: [("position_embedding_type",
                                      {"rope": "rope", "learned": "learned_absolute"}[v])],
    "add_bias_linear": lambda v: [("disable_bias_linear", not v)],
    "add_qkv_bias": lambda v: [("add_qkv_bias", v)],
    "qk_layernorm": lambda v: [("qk_layernorm", v)],
    "multi_latent_attention": lambda v: [("multi_latent_attention", v)],
    "q_lora_rank": lambda v: [("q_lora_rank", v or None)],
    "kv_lora_rank": lambda v: [("kv_lora_rank", v)],
    "qk_head_dim": lambda v: [("qk_head_dim", v)],
    "qk_pos_emb_head_dim": lambda v: [("qk_pos_emb_head_dim", v)],
    "v_head_dim": lambda v: [("v_head_dim", v)],
    "zero_centered_gamma": lambda v: [("apply_layernorm_1p", v)],
    "tie_embeddings": lambda v: [("untie_embeddings_and_output_weights", not v)],
    "rope_theta": lambda v: [("rotary_base", v)],
    "rotary_percent": lambda v: [("rotary_percent", v)],
    "rotary_interleaved": lambda v: [("rotary_interleaved", v)],
    "rope_scaling_factor": lambda v: [("use_rope_scaling", v > 0),
                                      ("rope_scaling_factor", v if v > 0 else None)],
    # Megatron's flags set the factor only; the rest of Llama 3.1's rule is fixed.
    "rope_linear_factor": lambda v: [("rotary_seq_len_interpolation_factor", _interpolation(v))],
    "rope_low_freq_factor": lambda v: _megatron_rope_constant("rope_low_freq_factor", v),
    "rope_high_freq_factor": lambda v: _megatron_rope_constant("rope_high_freq_factor", v),
    "norm_eps": lambda v: [("norm_epsilon", v)],
    "window_size": lambda v: [("window_size", v if v >= 0 else None)],
    "window_layers": lambda v: [("window_attn_skip_freq", list(v) or None)],
    "num_experts": lambda v: [("num_experts", v or None)],
    "moe_ffn_hidden_size": lambda v: [("moe_ffn_hidden_size", v or None)],
    "moe_router_topk": lambda v: [("moe_router_topk", v)],
    "moe_router_pre_softmax": lambda v: [("moe_router_pre_softmax", v)],
    "moe_router_score_function": lambda v: [("moe_router_score_function", v)],
    "moe_router_num_groups": lambda v: [("moe_router_num_groups", v or None)],
    "moe_router_group_topk": lambda v: [("moe_router_group_topk", v or None)],
    "moe_router_topk_scaling_factor": lambda v: [("moe_router_topk_scaling_factor",
                                                  None if v == 1.0 else v)],
    "moe_router_enable_expert_bias": lambda v: [("moe_router_enable_expert_bias", v)],
    "moe_expert_capacity_factor": lambda v: [("moe_expert_capacity_factor", v or None)],
    "moe_token_drop_policy": lambda v: [("moe_token_drop_policy", None if v == "probs" else v)],
    "moe_shared_expert_intermediate_size": lambda v: [("moe_shared_expert_intermediate_size",
                                                       v or None)],
    "moe_shared_expert_gate": lambda v: [("moe_shared_expert_gate", v)],
    "moe_layers": lambda v: [("moe_layer_freq", list(v) or 1)],
    "mtp_num_layers": lambda v: [("mtp_num_layers", v or None)],
}


# Llama 3.1's RoPE scaling as Megatron's --use-rope-scaling applies it: only the factor is a flag.
MEGATRON_ROPE_SCALING = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                         "rope_original_max_position_embeddings": 8192}


# What checkpoints from before these fields mean by lacking them.
BEFORE_THEM = {"add_qkv_bias": False, "qk_layernorm": False, "zero_centered_gamma": False,
               "rope_scaling_factor": 0.0,
               "rotary_percent": 1.0, "window_size": -1, "window_layers": [],
               "num_experts": 0, "moe_ffn_hidden_size": 0, "moe_router_topk": 2,
               "moe_router_pre_softmax": False, "moe_shared_expert_intermediate_size": 0,
               "moe_shared_expert_gate": False, "moe_layers": [],
               "moe_router_score_function": "softmax", "moe_router_num_groups": 0,
               "moe_router_group_topk": 0, "moe_router_topk_scaling_factor": 1.0,
               "moe_router_enable_expert_bias": False, "moe_expert_capacity_factor": 0.0,
               "moe_token_drop_policy": "probs", "mtp_num_layers": 0,
               "multi_latent_attention": False, "q_lora_rank": 0, "kv_lora_rank": 32,
               "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128,
               "rope_yarn_factor": 0.0, "rope_yarn_beta_fast": 32.0, "rope_yarn_beta_slow": 1.0,
               "rope_yarn_mscale": 1.0, "rope_yarn_mscale_all_dim": 0.0,
               "rope_linear_factor": 0.0, "rotary_interleaved": False, "rope_yarn_truncate": True,
               "softmax_type": "vanilla", "glu_linear_offset": 0.0, "activation_clamp": 0.0,
               **MEGATRON_ROPE_SCALING}

# Arguments only a model with multi-latent attention has: none (not given) for the others.
LATENT_ATTENTION_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                         "v_head_dim")


def _megatron_rope_constant(key, value, fixed=MEGATRON_ROPE_SCALING,
                            flags="--use-rope-scaling"):
    if value != fixed[key]:
        raise ValueError(f"the checkpoint's {key} is {_f32(value)}; Megatron's {flags} fixes it "
                         f"at {_f32(fixed[key])}")
    return []


def _interpolation(factor):
    """--rotary-seq-len-interpolation-factor of a linear factor (0: none); Megatron's flag is
    an integer."""
    if factor == 0:
        return None
    if factor != int(factor):
        raise ValueError(f"the checkpoint's rope_linear_factor is {_f32(factor)}; Megatron's "
                         "--rotary-seq-len-interpolation-factor is an integer")
    return int(factor)


def _f32(value):
    """The shortest decimal of an f32 config value (0.707, not the 0.7070000171661377 its
    double is), or an integer as it is."""
    if isinstance(value, int):
        return value
    bits = struct.pack("<f", value)
    for digits in range(6, 10):
        short = float(f"{value:.{digits}g}")
        if struct.pack("<f", short) == bits:
            return short
    return value


def _rope_args(config: dict) -> list[tuple[str, object]]:
    """--rope-type and YaRN's flags for the checkpoint's RoPE (older checkpoints: no YaRN); the
    original context Llama 3.1's scaling uses, and with multi-latent attention YaRN's beta fast
    and slow, original context and rounding, must be the ones Megatron fixes."""
    if config["rope_yarn_factor"] <= 0:
        if config["rope_scaling_factor"] > 0:
            _megatron_rope_constant("rope_original_max_position_embeddings",
                                    config["rope_original_max_position_embeddings"])
        return [("rope_type", "rope")] + [(dest, None) for dest in (*YARN_DEFAULTS, *YARN_FLAGS)]
    yarn = [("rope_type", "yarn"), ("rotary_scaling_factor", _f32(config["rope_yarn_factor"])),
            ("mscale", _f32(config["rope_yarn_mscale"])),
            ("mscale_all_dim", _f32(config["rope_yarn_mscale_all_dim"]))]
    if config["multi_latent_attention"]:
        for key, value in {**YARN_FIXED, "rope_yarn_truncate": True}.items():
            _megatron_rope_constant(key, config[key], {key: value},
                                    "--rope-type yarn (megatron-core's MLATransformerConfig)")
        return yarn + [(dest, None) for dest in YARN_FLAGS]
    # The GPT model's YaRN (--position-embedding-type yarn): newer Megatron's --yarn-* flags.
    return yarn + [(dest, _f32(config[field])) for dest, field in YARN_FIELDS.items()]


def model_args(config: dict) -> list[tuple[str, object]]:
    """[(argument dest, value)] that make the run's model the checkpoint's; ValueError naming a
    field the config lacks or Megatron's flags cannot express."""
    config = {**BEFORE_THEM, **config}
    if "kv_channels" not in config and {"hidden_size", "num_attention_heads"} <= config.keys():
        config["kv_channels"] = config["hidden_size"] // config["num_attention_heads"]
    latent = config["multi_latent_attention"]
    out = []
    for key, convert in FROM_CHECKPOINT.items():
        if key not in config:
            raise ValueError(f"the checkpoint's config has no {key}")
        if key in LATENT_ATTENTION_ONLY and not latent:
            out.append((key, None))
        elif key == "kv_channels" and latent:  # saved as qk_head_dim + qk_pos_emb_head_dim
            out.append((key, None))
        else:
            out += convert(config[key])
    return out + _gelu_args(config) + _rope_args(config)


def _gelu_args(config: dict) -> list[tuple[str, object]]:
    """GELU's form by Megatron's flags where its rule would not give the checkpoint's: the tanh
    form ("gelu") without biases needs --openai-gelu, the exact one with biases
    --no-bias-gelu-fusion."""
    biases = config["add_bias_linear"]
    return [("openai_gelu", config["activation"] == "gelu" and not biases),
            ("no_bias_gelu_fusion", config["activation"] == "gelu_exact" and biases)]


# Numerics a run may change on purpose (a longer context's RoPE base, say): loading under other
# values is allowed but said. Key -> the flags that set it.
NUMERICS = {"rope_theta": "--rotary-base",
            "rope_scaling_factor": "--use-rope-scaling --rope-scaling-factor",
            "rope_low_freq_factor": "--use-rope-scaling",
            "rope_high_freq_factor": "--use-rope-scaling",
            "rope_original_max_position_embeddings": "--use-rope-scaling or "
                                                     "--yarn-original-max-position-embeddings",
            "rope_yarn_factor": "--rope-type yarn --rotary-scaling-factor",
            "rope_yarn_beta_fast": "--yarn-beta-fast",
            "rope_yarn_beta_slow": "--yarn-beta-slow",
            "rope_yarn_truncate": "--[no-]yarn-correction-range-round-to-int",
            "rope_yarn_mscale": "--rope-type yarn --mscale",
            "rope_yarn_mscale_all_dim": "--rope-type yarn --mscale-all-dim",
            "rope_linear_factor": "--rotary-seq-len-interpolation-factor",
            "norm_eps": "--norm-epsilon",
            "glu_linear_offset": "--glu-linear-offset",
            "activation_clamp": "--activation-func-clamp-value",
            "window_size": "--window-size",
            "window_layers": "--window-attn-skip-freq",
            "moe_router_topk": "--moe-router-topk",
            "moe_router_pre_softmax": "--moe-router-pre-softmax",
            "moe_router_score_function": "--moe-router-score-function",
            "moe_router_num_groups": "--moe-router-num-groups",
            "moe_router_group_topk": "--moe-router-group-topk",
            "moe_router_topk_scaling_factor": "--moe-router-topk-scaling-factor",
            "moe_expert_capacity_factor": "--moe-expert-capacity-factor",
            "moe_token_drop_policy": "--moe-token-drop-policy"}


def numerics_warnings(saved: dict, cfg) -> list[str]:
    """A warning per numerics field in which the run's model (a TransformerConfig) differs
    from the checkpoint's config."""
    saved = {**BEFORE_THEM, **saved}
    lines = []
    for key, flags in NUMERICS.items():
        if key in saved and saved[key] != getattr(cfg, key):
            lines.append(f"braid: warning: the checkpoint's model has {key} {saved[key]}, this "
                         f"run's {getattr(cfg, key)} ({flags}); it will compute otherwise than it "
                         "was trained to")
    return lines
