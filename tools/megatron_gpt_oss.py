"""What GPT-OSS-style models add between Megatron-LM and braid (docs/convert_megatron.md): the
attention softmax's type (--softmax-type; learnable sinks are the tensor
self_attention.core_attention.softmax_offset [heads] under both the local and Transformer Engine
specs, braid's self_attn.sinks), the quick GEGLU (--quick-geglu) and the gated activations'
--glu-linear-offset and --activation-func-clamp-value, and YaRN outside multi-latent attention
(--position-embedding-type yarn: GPTModel's YarnRotaryEmbedding, --rotary-scaling-factor,
--yarn-original-max-position-embeddings, --yarn-beta-fast, --yarn-beta-slow, --mscale,
--mscale-all-dim, --[no-]yarn-correction-range-round-to-int). The router's bias
(mlp.router.bias, with --add-bias-linear) is megatron_mlp.py's.

megatron-core reads the non-MLA YaRN from its config's yarn_* attributes
(yarn_rotary_scaling_factor, yarn_original_max_position_embeddings, yarn_beta_fast,
yarn_beta_slow, yarn_mscale, yarn_mscale_all_dim, yarn_correction_range_round_to_int); import
takes those names or Megatron-LM's flags', export writes both."""

import math

from hf_configs import GATED, ConvertError, as_f32, f32_value
from megatron_mlp import arg

SINKS = {"self_attn.sinks": ("self_attention.core_attention.softmax_offset",)}
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
# braid's YaRN field -> (Megatron's names, first the config attribute's, the default where the
# args hold none: YarnRotaryEmbedding's; None: required)
YARN_ARGS = {
    "rope_yarn_factor": (("yarn_rotary_scaling_factor", "rotary_scaling_factor"), None),
    "rope_original_max_position_embeddings": (("yarn_original_max_position_embeddings",
                                               "original_max_position_embeddings"), None),
    "rope_yarn_beta_fast": (("yarn_beta_fast", "beta_fast"), 32.0),
    "rope_yarn_beta_slow": (("yarn_beta_slow", "beta_slow"), 1.0),
    "rope_yarn_mscale": (("yarn_mscale", "mscale"), 1.0),
    "rope_yarn_mscale_all_dim": (("yarn_mscale_all_dim", "mscale_all_dim"), 0.0),
}


def refuse(name, value, why, where):
    raise ConvertError(f"{where}: args.{name} = {value!r} is not supported ({why})")


def first_arg(args, names, default):
    for name in names:
        if arg(args, name) is not None:
            return name, getattr(args, name)
    return names[-1], default


# ---- Megatron-LM's arguments -> braid's config -------------------------------------------------

def glu_and_softmax_from_args(args, activation, where):
    """braid's softmax_type, glu_linear_offset and activation_clamp for Megatron-LM's args and the
    activation braid's config takes from them (megatron-core offsets and clamps gated activations
    alone)."""
    softmax = arg(args, "softmax_type", "vanilla")
    if softmax not in SOFTMAX_TYPES:
        refuse("softmax_type", softmax, f"braid's softmax types are {', '.join(SOFTMAX_TYPES)}",
               where)
    if softmax != "vanilla" and arg(args, "multi_latent_attention", False):
        refuse("softmax_type", softmax, "braid's multi-latent attention has the usual softmax",
               where)
    offset, clamp = arg(args, "glu_linear_offset", 0.0), arg(args, "activation_func_clamp_value")
    if activation not in GATED:
        return {"softmax_type": softmax}
    for name, value in (("glu_linear_offset", offset), ("activation_func_clamp_value", clamp)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
            refuse(name, value, "a finite number", where)
    if clamp is not None and clamp <= 0:
        refuse("activation_func_clamp_value", clamp, "megatron-core then clamps the gate below "
               "0; braid's activation_clamp is a positive limit (0: none)", where)
    fused = activation == "swiglu" and arg(args, "bias_swiglu_fusion", True)
    if fused and (offset or clamp is not None):
        name = "glu_linear_offset" if offset else "activation_func_clamp_value"
        refuse(name, getattr(args, name), "megatron-core's fused bias-SwiGLU "
               "(bias_swiglu_fusion) ignores it; braid's SwiGLU applies it", where)
    return {"softmax_type": softmax, "glu_linear_offset": as_f32(offset),
            "activation_clamp": as_f32(clamp or 0.0)}


def yarn_from_args(args, where):
    """braid's YaRN fields for Megatron-LM's --position-embedding-type yarn (GPTModel's
    YarnRotaryEmbedding, outside multi-latent attention): cos and sin times g(mscale) /
    g(mscale_all_dim), the softmax scale unchanged, as braid computes YaRN without MLA."""
    if arg(args, "multi_latent_attention", False):
        refuse("position_embedding_type", "yarn", "multi-latent attention builds its own RoPE "
               "(--rope-type yarn)", where)
    for name, refused, why in (("rotary_percent", lambda v: v != 1.0, "YaRN on a part of each "
                                                                      "head"),
                               ("rotary_interleaved", bool, "megatron-core's YaRN refuses "
                                                            "interleaved pairs"),
                               ("use_rope_scaling", bool, "Llama 3.1's scaling with YaRN"),
                               ("rotary_seq_len_interpolation_factor",
                                lambda v: v not in (None, 1), "linear interpolation with "
                                                              "YaRN")):
        value = getattr(args, name, None)
        if value is not None and refused(value):
            refuse(name, value, why, where)
    out = {}
    for field, (names, default) in YARN_ARGS.items():
        name, value = first_arg(args, names, default)
        if value is None:
            raise ConvertError(f"{where}: args.{names[0]} (or args.{names[1]}) is missing; "
                               "--position-embedding-type yarn needs it")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                not math.isfinite(value) or value < 0:
            refuse(name, value, "YaRN's parameters are numbers >= 0", where)
        out[field] = value
    if out["rope_yarn_factor"] < 1:
        refuse("rotary_scaling_factor", out["rope_yarn_factor"], "braid's YaRN stretches the "
               "original context by a factor >= 1", where)
    if not 0 < out["rope_yarn_beta_slow"] <= out["rope_yarn_beta_fast"]:
        refuse("yarn_beta_slow", out["rope_yarn_beta_slow"], "YaRN needs 0 < beta_slow <= "
               f"beta_fast ({out['rope_yarn_beta_fast']})", where)
    original = out["rope_original_max_position_embeddings"]
    if original != int(original) or original < 1:
        refuse("yarn_original_max_position_embeddings", original, "a positive integer", where)
    return {**{k: as_f32(v) for k, v in out.items()},
            "rope_original_max_position_embeddings": int(original),
            "rope_yarn_truncate": bool(arg(args, "yarn_correction_range_round_to_int", True))}


# ---- braid's config -> Megatron-LM's arguments -------------------------------------------------

def megatron_glu_and_softmax_args(c):
    """Megatron-LM's --quick-geglu, --glu-linear-offset, --activation-func-clamp-value and
    --softmax-type for a braid config (the fused bias-SwiGLU off where it would ignore an offset
    or a clamp)."""
    offset, clamp = c.get("glu_linear_offset", 0.0), c.get("activation_clamp", 0.0)
    out = {"quick_geglu": c["activation"] == "quick_geglu",
           "glu_linear_offset": f32_value(offset), "activation_func_clamp_value":
           f32_value(clamp) if clamp else None,
           "softmax_type": c.get("softmax_type", "vanilla")}
    if c["activation"] == "swiglu" and (offset or clamp):
        out["bias_swiglu_fusion"] = False
    return out


def megatron_yarn_args(c):
    """Megatron-LM's YaRN arguments for a braid config with YaRN and without multi-latent
    attention ({} otherwise), under Megatron-LM's flags' names and megatron-core's config
    attributes'; ConvertError where megatron-core's YarnRotaryEmbedding would compute another
    model."""
    if not c.get("rope_yarn_factor") or c.get("multi_latent_attention"):
        return {}
    what = "this braid model has YaRN RoPE"
    for ok, why in ((c.get("rotary_percent", 1.0) == 1.0, "on a part of each head"),
                    (not c.get("rotary_interleaved"), "with interleaved pairs"),
                    (not c.get("rope_linear_factor") and not c.get("rope_scaling_factor"),
                     "with linear interpolation or Llama 3.1's scaling")):
        if not ok:
            raise ConvertError(f"{what} {why}; megatron-core's YarnRotaryEmbedding turns whole "
                               "heads as rotate_half, unscaled otherwise")
    values = {"rotary_scaling_factor": f32_value(c["rope_yarn_factor"]),
              "original_max_position_embeddings": c["rope_original_max_position_embeddings"],
              "beta_fast": f32_value(c["rope_yarn_beta_fast"]),
              "beta_slow": f32_value(c["rope_yarn_beta_slow"]),
              "mscale": f32_value(c["rope_yarn_mscale"]),
              "mscale_all_dim": f32_value(c["rope_yarn_mscale_all_dim"])}
    return {"position_embedding_type": "yarn", "use_rotary_position_embeddings": False,
            "rotary_scaling_factor": values["rotary_scaling_factor"],
            "mscale": values["mscale"], "mscale_all_dim": values["mscale_all_dim"],
            **{"yarn_" + k: v for k, v in values.items()},
            "yarn_correction_range_round_to_int": bool(c.get("rope_yarn_truncate", True))}
