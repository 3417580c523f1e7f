"""Megatron-LM's model arguments and megatron-core GPTModel tensor names <-> braid's checkpoint
config and tensor names (docs/convert_megatron.md has the table). GPT / Llama-style models:
grouped-query attention, tied or untied embeddings, RMSNorm or LayerNorm (also zero-centred,
--apply-layernorm-1p), SwiGLU, GELU or squared ReLU, biases, q/k norms, RoPE (also partial,
Llama 3.1's scaling, YaRN) or learned positions, sliding windows, mixtures of experts
(megatron_mlp.py: the MLPs and experts), multi-latent attention with plain or YaRN RoPE
(megatron_mla.py), multi-token prediction (megatron_mtp.py), attention sinks and the quick GEGLU
(megatron_gpt_oss.py, with YaRN outside MLA). Anything else is refused."""

import argparse
import re

import numpy as np

from hf_configs import NO_ROPE_SCALING, ConvertError, as_f32, check, f32_value, head_width
from megatron_gpt_oss import (SINKS, glu_and_softmax_from_args, megatron_glu_and_softmax_args,
                              megatron_yarn_args, yarn_from_args)
from megatron_mla import (LATENT_NAMES, latent_config_from_args, latent_extra_state_modules,
                          megatron_latent_args)
from megatron_mlp import (EXPERTS, ROUTER, SHARED, arg, braid_moe_layer, expert_pattern, join_fc1,
                          megatron_moe_args, moe_config_from_args, moe_extra_state_modules,
                          moe_tensors_to_braid, take_mlp)
from megatron_mtp import (braid_mtp_tensors, check_mtp_args, depths, mtp_extra_state_keys,
                          mtp_names_of, split_mtp)
from safetensors_numpy import Tensor

EMBED = "embedding.word_embeddings.weight"
POSITIONS = "embedding.position_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm."
OUTPUT = "output_layer.weight"
LAYERS = "decoder.layers."
# Per layer: braid's name (after model.layers.{i}.) -> megatron-core's (after decoder.layers.),
# the first the one export writes: the names megatron-core's checkpoints use under both the local
# and Transformer Engine layer specs (the local spec maps its input_layernorm and
# pre_mlp_layernorm to TE's fused names); the others are read too.
LAYER_NAMES = {
    "input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight",
                               "input_layernorm.weight"),
    "input_layernorm.bias": ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    "post_attention_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight",
                                        "pre_mlp_layernorm.weight"),
    "post_attention_layernorm.bias": ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
    "self_attn.q_norm.weight": ("self_attention.q_layernorm.weight",),
    "self_attn.q_norm.bias": ("self_attention.q_layernorm.bias",),
    "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight",),
    "self_attn.k_norm.bias": ("self_attention.k_layernorm.bias",),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight",),
    "self_attn.o_proj.bias": ("self_attention.linear_proj.bias",),
    **SINKS,
}
QKV = "self_attention.linear_qkv."  # per query group: its query heads, then its key, its value
FC1 = "mlp.linear_fc1."  # with SwiGLU the gate's rows, then the up projection's (megatron_mlp)
FC2 = "mlp.linear_fc2."
# The modules of a layer that have an _extra_state (Transformer Engine's FP8 scaling state) under
# the local or the Transformer Engine spec; export writes an empty one for each.
ATTENTION_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj",
                         "self_attention.core_attention")
MLP_EXTRA_STATE = ("mlp.linear_fc1", "mlp.linear_fc2")


# ---- Megatron-LM's arguments <-> braid's config ----------------------------------------------

# Arguments whose models this tool does not map: (name, refused when, what it is).
REFUSED_ARGS = (
    ("no_rope_freq", bool, "layers without RoPE"),
    ("qk_l2_norm", bool, "L2-normalised queries and keys"),
    ("hybrid_override_pattern", bool, "a hybrid (Mamba) model"),
    ("hybrid_layer_pattern", bool, "a hybrid (Mamba) model"),
    ("heterogeneous_layers_config_path", bool, "layers of different shapes"),
    ("heterogeneous_layers_config_encoded_json", bool, "layers of different shapes"),
    ("experimental_attention_variant", bool, "an experimental attention variant"),
)


def refuse_arg(name, value, why, where):
    raise ConvertError(f"{where}: args.{name} = {value!r} is not supported ({why})")


def activation_of(args, where):
    # Megatron-LM's order: squared ReLU, then quick GEGLU; either with --swiglu fails its assert.
    others = [name for name in ("squared_relu", "quick_geglu") if arg(args, name, False)]
    if arg(args, "swiglu", False):
        if others:
            refuse_arg(others[0], True, "Megatron-LM asserts it is not given with --swiglu", where)
        return "swiglu"
    if others:
        return others[0]
    # megatron-core's MLP computes GELU's tanh form (braid's gelu) in its fused bias-GELU, which
    # Megatron-LM uses with biases unless --no-bias-gelu-fusion, or with --openai-gelu;
    # otherwise torch's exact GELU (braid's gelu_exact).
    fused = (arg(args, "bias_gelu_fusion", False) and arg(args, "add_bias_linear", True)
             and not arg(args, "use_te_activation_func", False))
    return "gelu" if fused or arg(args, "openai_gelu", False) else "gelu_exact"


def window_of(args, layers, where):
    """braid's window_size and window_layers from Megatron's window_size (W, 0) and
    window_attn_skip_freq (N: layers N, 2N, ... attend to everything; or a 0/1 list)."""
    window = arg(args, "window_size")
    if window is None or tuple(window)[0] in (-1, None):
        return {"window_size": -1, "window_layers": []}
    left, right = tuple(window)
    if right not in (0, -1):
        refuse_arg("window_size", window, "a window over later keys; braid's is causal", where)
    skip = arg(args, "window_attn_skip_freq")
    if skip is None:
        pattern = []
    elif isinstance(skip, int):
        pattern = [int((i + 1) % skip != 0) for i in range(layers)]
    else:
        pattern = [int(v) for v in skip]
        check(len(pattern) == layers, f"{where}: args.window_attn_skip_freq has {len(pattern)} "
              f"entries for {layers} layers")
    return {"window_size": int(left), "window_layers": pattern}


def braid_config_from_args(args, vocab_rows, dtype, where):
    """braid's config for Megatron-LM's saved `args`, the embedding's (padded) rows and the
    weights' dtype (braid's name)."""
    if not isinstance(args, argparse.Namespace):
        raise ConvertError(f"{where}: args is a {type(args).__name__}, not Megatron-LM's "
                           "argparse.Namespace")
    for name, refused, why in REFUSED_ARGS:
        if refused(getattr(args, name, None)):
            refuse_arg(name, getattr(args, name), why, where)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "max_position_embeddings"):
        value = getattr(args, name, None)
        check(isinstance(value, int) and value > 0, f"{where}: args.{name} should be a positive "
              f"integer, is {value!r}")
    h, heads, layers = args.hidden_size, args.num_attention_heads, args.num_layers
    position = arg(args, "position_embedding_type", "learned_absolute")
    if arg(args, "use_rotary_position_embeddings", False):
        position = "rope"
    if position not in ("learned_absolute", "rope", "yarn"):
        refuse_arg("position_embedding_type", position, "braid has learned positions and RoPE "
                   "(plain, YaRN)", where)
    if position == "learned_absolute" and not arg(args, "add_position_embedding", True):
        refuse_arg("add_position_embedding", False, "a model without positions", where)
    normalization = arg(args, "normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        refuse_arg("normalization", normalization, "braid has LayerNorm and RMSNorm", where)
    rope = dict(NO_ROPE_SCALING, rotary_percent=float(arg(args, "rotary_percent", 1.0)),
                rotary_interleaved=bool(arg(args, "rotary_interleaved", False)))
    if arg(args, "use_rope_scaling", False):  # megatron-core's Llama 3.1 scaling constants
        rope.update(rope_scaling_factor=as_f32(arg(args, "rope_scaling_factor", 8.0)),
                    rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                    rope_original_max_position_embeddings=8192)
    interpolation = arg(args, "rotary_seq_len_interpolation_factor", None)
    if interpolation not in (None, 1, 1.0):  # megatron-core's positions / factor
        rope.update(rope_linear_factor=as_f32(interpolation))
    if position == "yarn":
        rope.update(yarn_from_args(args, where))
    bias = bool(arg(args, "add_bias_linear", True))
    activation = activation_of(args, where)
    config = {**window_of(args, layers, where), **moe_config_from_args(args, where),
              **glu_and_softmax_from_args(args, activation, where),
              "num_layers": layers, "hidden_size": h,
              "num_attention_heads": heads,
              "num_query_groups": args.num_query_groups if arg(args, "group_query_attention", False)
              else heads,
              "kv_channels": arg(args, "kv_channels", h // heads),
              "ffn_hidden_size": args.ffn_hidden_size, "vocab_size": vocab_rows,
              "max_position_embeddings": args.max_position_embeddings,
              "normalization": normalization.lower(),
              "activation": activation,
              "position_embedding": "learned" if position == "learned_absolute" else "rope",
              "add_bias_linear": bias, "add_qkv_bias": bool(arg(args, "add_qkv_bias")) and not bias,
              "qk_layernorm": bool(arg(args, "qk_layernorm", False)),
              "zero_centered_gamma": bool(arg(args, "apply_layernorm_1p", False)),
              "tie_embeddings": not arg(args, "untie_embeddings_and_output_weights", False),
              "rope_theta": as_f32(arg(args, "rotary_base", 10000)), **rope,
              "norm_eps": as_f32(arg(args, "norm_epsilon", 1e-5)), "params_dtype": dtype}
    if arg(args, "mtp_num_layers", 0):  # (absent, as in braid's saves, without MTP depths)
        config["mtp_num_layers"] = args.mtp_num_layers
    config.update(latent_config_from_args(args, position, where))
    check_mtp_args(config, where)
    return config


def plain_args(args):
    """The JSON values of Megatron-LM's args (kept in braid's metadata as megatron_args, for an
    export to give back what braid does not keep: tokenizer, sequence length, ...)."""
    def plain(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return True
        return isinstance(v, (list, tuple)) and all(plain(x) for x in v)
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in sorted(vars(args).items()) if plain(v)}


def round_up(n, multiple):
    return -(-n // multiple) * multiple


def interpolation_factor(c):
    """--rotary-seq-len-interpolation-factor of a braid config (None: none); Megatron-LM's
    argument is an integer."""
    factor = c.get("rope_linear_factor") or 0.0  # absent in checkpoints before it
    if not factor:
        return None
    check(factor == int(factor), f"this braid model interpolates RoPE's positions by "
          f"{f32_value(factor)}; Megatron-LM's --rotary-seq-len-interpolation-factor is an "
          "integer")
    return int(factor)


def megatron_args_from_braid(c, consumed_samples, imported):
    """Megatron-LM's args for a braid config: the model's arguments, a tp=1 pp=1 layout, no
    optimizer or RNG state saved; over `imported` (an import's megatron_args, or {})."""
    latent = megatron_latent_args(c)
    if c.get("rope_scaling_factor"):
        fixed = (c["rope_low_freq_factor"], c["rope_high_freq_factor"],
                 c["rope_original_max_position_embeddings"])
        check(fixed == (1.0, 4.0, 8192), f"this braid model scales RoPE with low/high frequency "
              f"factors and original context {fixed}; megatron-core's --use-rope-scaling has "
              "(1.0, 4.0, 8192)")
    heads, groups = c["num_attention_heads"], c["num_query_groups"]
    theta = f32_value(c["rope_theta"])
    window = c.get("window_size", -1)
    divisor = imported.get("make_vocab_size_divisible_by", 128)
    dtype = {"bf16": "bfloat16", "f16": "float16"}.get(c["params_dtype"], "float32")
    model = {
        "num_layers": c["num_layers"], "hidden_size": c["hidden_size"],
        "ffn_hidden_size": c["ffn_hidden_size"], "num_attention_heads": heads,
        "group_query_attention": groups != heads, "num_query_groups": groups,
        "kv_channels": head_width(c), "max_position_embeddings": c["max_position_embeddings"],
        "position_embedding_type": "rope" if c["position_embedding"] == "rope"
        else "learned_absolute",
        "add_position_embedding": c["position_embedding"] == "learned",
        "use_rotary_position_embeddings": c["position_embedding"] == "rope",
        "rotary_base": int(theta) if theta == int(theta) else theta,
        "rotary_percent": c.get("rotary_percent", 1.0),
        "rotary_interleaved": bool(c.get("rotary_interleaved")),
        "use_rope_scaling": bool(c.get("rope_scaling_factor")),
        "rotary_seq_len_interpolation_factor": interpolation_factor(c),
        "rope_scaling_factor": f32_value(c.get("rope_scaling_factor") or 8.0),
        "normalization": {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}[c["normalization"]],
        "norm_epsilon": f32_value(c["norm_eps"]),
        "apply_layernorm_1p": bool(c.get("zero_centered_gamma")),
        "swiglu": c["activation"] == "swiglu", "squared_relu": c["activation"] == "squared_relu",
        "add_bias_linear": c["add_bias_linear"],
        "add_qkv_bias": c["add_bias_linear"] or bool(c.get("add_qkv_bias")),
        "qk_layernorm": bool(c.get("qk_layernorm")),
        "untie_embeddings_and_output_weights": not c["tie_embeddings"],
        "window_size": (window, 0) if window >= 0 else None,
        "window_attn_skip_freq": list(c.get("window_layers") or []) or None,
        "vocab_size": imported.get("vocab_size", c["vocab_size"]),
        "padded_vocab_size": round_up(c["vocab_size"], divisor),
        "make_vocab_size_divisible_by": divisor, "params_dtype": dtype,
        "bf16": dtype == "bfloat16", "fp16": dtype == "float16",
        "num_experts": None, "mtp_num_layers": depths(c) or None, **latent,
        **(megatron_moe_args(c) if c.get("num_experts") else {}),
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None, "expert_model_parallel_size": 1,
        "context_parallel_size": 1, "world_size": 1, "data_parallel_size": 1,
        **megatron_glu_and_softmax_args(c), **megatron_yarn_args(c),
        "ckpt_format": "torch_dist", "use_dist_ckpt": True, "no_save_optim": True,
        "no_save_rng": True, "consumed_train_samples": consumed_samples,
        "skipped_train_samples": 0,
        # GELU's form by Megatron-LM's rule (activation_of): the tanh form (braid's gelu) in the
        # fused bias-GELU, which needs biases, else by --openai-gelu; the exact form unfused.
        "bias_gelu_fusion": c["add_bias_linear"] and c["activation"] == "gelu",
        "openai_gelu": c["activation"] == "gelu" and not c["add_bias_linear"]}
    return {**imported, **model}


# ---- tensors ---------------------------------------------------------------------------------

def split_layers(megatron, layers):
    """Takes every decoder.layers.* tensor out of `megatron`: {(layer, name): Tensor}, from
    megatron-core's stacked tensors (the layer as a first axis) or per-layer names
    (decoder.layers.{i}.name)."""
    out = {}
    for key in [k for k in megatron if k.startswith(LAYERS)]:
        t, rest = megatron.pop(key), key[len(LAYERS):]
        per_layer = re.match(r"(\d+)\.(.+)$", rest)
        if per_layer:
            out[(int(per_layer.group(1)), per_layer.group(2))] = t
            continue
        check(t.array.ndim >= 1 and t.shape[0] == layers, f"{key} is {t.shape}: its first axis "
              f"should be the {layers} layers (args.num_layers)")
        for i in range(layers):
            out[(i, rest)] = t.like(t.array[i])
    return out


def split_qkv(t, c, name):
    """megatron-core's fused [groups x (q heads, k, v) x head_dim, ...] -> q, k, v."""
    groups, d = c["num_query_groups"], head_width(c)
    per_group = c["num_attention_heads"] // groups
    rows = groups * (per_group + 2) * d
    check(t.shape[0] == rows, f"{name} has {t.shape[0]} rows; {groups} query groups of "
          f"{per_group} query heads, a key and a value of {d} make {rows}")
    x = t.array.reshape(groups, per_group + 2, d, *t.shape[1:])
    rest = t.shape[1:]
    return (t.like(x[:, :per_group].reshape(-1, *rest)),
            t.like(x[:, per_group].reshape(-1, *rest)),
            t.like(x[:, per_group + 1].reshape(-1, *rest)))


def merge_qkv(q, k, v, c):
    groups, d = c["num_query_groups"], head_width(c)
    rest = q.shape[1:]
    x = np.concatenate([q.array.reshape(groups, -1, d, *rest), k.array.reshape(groups, 1, d, *rest),
                        v.array.reshape(groups, 1, d, *rest)], axis=1)
    return q.like(x.reshape(-1, *rest))


def layer_names(c):
    """Per layer: braid's name (after model.layers.{i}.) -> (megatron-core's names an import
    reads, those an export writes)."""
    if c.get("multi_latent_attention"):
        return {name: (names, names) for name, names in LATENT_NAMES.items()}
    return {name: (names, names[:1]) for name, names in LAYER_NAMES.items()}


def megatron_to_braid(megatron, c):
    """megatron-core's tensors (name -> Tensor) -> braid's names; takes what it maps out of
    `megatron` (what is left is unexpected). The MTP depths' layers come as layers L, L + 1, ..."""
    layers = split_layers(megatron, c["num_layers"])
    out = {"model.embed_tokens.weight": megatron.pop(EMBED)} if EMBED in megatron else {}
    split_mtp(megatron, c, layers, out)
    if POSITIONS in megatron:
        out["model.embed_positions.weight"] = megatron.pop(POSITIONS)
    for kind in ("weight", "bias"):
        if FINAL_NORM + kind in megatron:
            out["model.norm." + kind] = megatron.pop(FINAL_NORM + kind)
    if OUTPUT in megatron:
        out["lm_head.weight"] = megatron.pop(OUTPUT)
    if c.get("num_experts"):
        moe_tensors_to_braid(layers, c, out)
    names_of = layer_names(c)
    for i in range(c["num_layers"] + depths(c)):
        p = f"model.layers.{i}."
        for braid_name, (names, _) in names_of.items():
            found = [layers.pop((i, n)) for n in names if (i, n) in layers]
            if len(found) > 1 and not all(x.dtype == found[0].dtype and
                                          np.array_equal(x.array, found[0].array)
                                          for x in found[1:]):
                raise ConvertError(f"{layer_prefix(c, i).rstrip('.')}: layer {i} has "
                                   f"{' and '.join(names)}, which differ (one norm under two "
                                   "names)")
            if found:
                out[p + braid_name] = found[0]
        for kind in ("weight", "bias"):
            if (i, QKV + kind) in layers:
                qkv = split_qkv(layers.pop((i, QKV + kind)), c, f"layer {i}'s {QKV}{kind}")
                for proj, t in zip(("q_proj", "k_proj", "v_proj"), qkv):
                    out[f"{p}self_attn.{proj}.{kind}"] = t
        take_mlp(layers, i, "mlp.", p + "mlp.", c, c["ffn_hidden_size"], out)
    for (i, name) in layers:  # left: unexpected, named as in the checkpoint
        megatron[f"{layer_prefix(c, i)}{name} (layer {i})"] = layers[(i, name)]
    return out


def layer_prefix(c, i):
    """megatron-core's prefix of layer i's names: the decoder's, or an MTP depth's layer."""
    first = c["num_layers"]
    return LAYERS if i < first else f"mtp.layers.{i - first}.transformer_layer."


def megatron_names_of(braid_name, c):
    """Where an import looks for a braid tensor, for messages."""
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", braid_name)
    if not m:
        return {"model.embed_tokens.weight": EMBED, "model.embed_positions.weight": POSITIONS,
                "model.norm.weight": FINAL_NORM + "weight", "model.norm.bias": FINAL_NORM + "bias",
                "lm_head.weight": OUTPUT}.get(braid_name, braid_name)
    i, name, kind = int(m.group(1)), m.group(2), m.group(2).rsplit(".", 1)[-1]
    own = mtp_names_of(c, i, name) if i >= c["num_layers"] else None
    if own:
        return own
    names_of = layer_names(c)
    if name in names_of:
        names = names_of[name][0]
    elif ".q_proj." in name or ".k_proj." in name or ".v_proj." in name:
        names = (QKV + kind,)
    elif name.startswith("mlp.gate."):
        names = (ROUTER + {"mlp.gate.weight": "weight", "mlp.gate.bias": "bias"}.get(
            name, "expert_bias"),)
    elif name.startswith(("mlp.experts.", "mlp.shared_expert")):
        prefix = EXPERTS if name.startswith("mlp.experts.") else SHARED
        names = (prefix + ("linear_fc2." if "down_proj" in name else "linear_fc1.") + kind,)
    else:
        names = ((FC2 if "down_proj" in name else FC1) + kind,)
    return " or ".join(layer_prefix(c, i) + n for n in names) + f" (layer {i})"


def per_layer_names(c):
    """Whether megatron-core names each layer's tensors (decoder.layers.{i}.*) rather than
    stacking them: where its layers differ (experts on some, --moe-layer-freq other than 1)."""
    return bool(c.get("num_experts") and c.get("moe_layers"))


def braid_layer(t, c, i):
    """Layer i's tensors (an MTP depth's for i >= num_layers) under megatron-core's layer names
    (every name layer_names writes)."""
    p = f"model.layers.{i}."
    layer = {name: t[p + braid_name] for braid_name, (_, written) in layer_names(c).items()
             if p + braid_name in t for name in written}
    for kind in ("weight", "bias"):
        if p + "self_attn.q_proj." + kind in t and not c.get("multi_latent_attention"):
            layer[QKV + kind] = merge_qkv(*(t[f"{p}self_attn.{x}.{kind}"]
                                            for x in ("q_proj", "k_proj", "v_proj")), c)
        if p + "mlp.up_proj." + kind in t:
            layer[FC1 + kind] = join_fc1(t.get(p + "mlp.gate_proj." + kind),
                                         t[p + "mlp.up_proj." + kind])
            layer[FC2 + kind] = t[p + "mlp.down_proj." + kind]
    if p + "mlp.gate.weight" in t:
        layer.update(braid_moe_layer(t, c, i))
        # The pre-MLP norm of a layer with experts: the local spec's name (above), and Transformer
        # Engine's spec's, whose MoE layers keep a separate norm module.
        for kind in ("weight", "bias"):
            if p + "post_attention_layernorm." + kind in t:
                layer["pre_mlp_layernorm." + kind] = t[p + "post_attention_layernorm." + kind]
    return layer


def braid_to_megatron(t, c):
    """braid's tensors -> (megatron-core's names and tensors, the names whose first axis is the
    layers): the inverse of megatron_to_braid."""
    out = {EMBED: t["model.embed_tokens.weight"]}
    if c["position_embedding"] == "learned":
        out[POSITIONS] = t["model.embed_positions.weight"]
    layers = [braid_layer(t, c, i) for i in range(c["num_layers"])]
    stacked = []
    if per_layer_names(c):
        for i, layer in enumerate(layers):
            out.update({f"{LAYERS}{i}.{name}": x for name, x in layer.items()})
    else:
        for name in layers[0]:
            parts = [layer[name] for layer in layers]
            check(len({x.dtype for x in parts}) == 1, f"the layers' {name} differ in dtype")
            out[LAYERS + name] = Tensor(parts[0].dtype, np.stack([x.array for x in parts]))
            stacked.append(LAYERS + name)
    out.update(braid_mtp_tensors(t, c, lambda i: braid_layer(t, c, i)))
    for kind in ("weight", "bias"):
        if "model.norm." + kind in t:
            out[FINAL_NORM + kind] = t["model.norm." + kind]
    if not c["tie_embeddings"]:
        out[OUTPUT] = t["lm_head.weight"]
    return out, stacked


def layer_extra_state_modules(c, i):
    """(module, whether it has an expert axis) of layer i (an MTP depth's for i >= num_layers)
    that have an _extra_state under the local or the Transformer Engine spec."""
    if c.get("multi_latent_attention"):
        attention = latent_extra_state_modules(c)
    else:
        norms = ("self_attention.q_layernorm", "self_attention.k_layernorm") if c.get(
            "qk_layernorm") else ()
        attention = ATTENTION_EXTRA_STATE + norms
    experts = c.get("num_experts") and expert_pattern(c)[i]
    # a layer with experts: Transformer Engine's spec keeps its pre-MLP norm a module of its own
    mlp = moe_extra_state_modules(c) + [("pre_mlp_layernorm", False)] if experts else [
        (m, False) for m in MLP_EXTRA_STATE]
    return [(m, False) for m in attention] + mlp


def extra_state_keys(c):
    """The _extra_state objects (megatron-core's ShardedObject unique keys) an export writes,
    each empty: per layer its modules', an expert's per expert; the MTP depths'."""
    layers, experts = c["num_layers"], c.get("num_experts") or 0
    keys = []
    for i in range(layers):
        for module, per_expert in layer_extra_state_modules(c, i):
            if per_layer_names(c):
                key, offset, shape = f"{LAYERS}{i}.{module}", [], []
            else:
                key, offset, shape = LAYERS + module, [i], [layers]
            for j in range(experts if per_expert else 1):
                o, n = (offset + [j], shape + [experts]) if per_expert else (offset, shape)
                o, n = o or [0], n or [1]
                keys.append(f"{key}._extra_state/shard_{'.'.join(map(str, o))}_"
                            f"{'.'.join(map(str, n))}")
    keys += mtp_extra_state_keys(c, lambda i: layer_extra_state_modules(c, i))
    return keys + [f"{FINAL_NORM}_extra_state/shard_0_1"]
