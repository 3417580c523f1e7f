"""The MLPs between Megatron-LM and braid (docs/convert_megatron.md): megatron-core's fc1 / fc2
(a gated activation's fc1 the gate's rows then the up projection's) <-> braid's gate_proj /
up_proj / down_proj, in a dense layer and in a mixture of experts: megatron-core's MoE layer
(TopKRouter, with a bias under --add-bias-linear; SequentialMLP or TEGroupedMLP experts, whose
checkpoint names are the same; SharedExpertMLP) <-> braid's router, experts and shared expert;
Megatron-LM's --num-experts, --moe-* arguments <-> braid's config."""

import numpy as np

from hf_configs import GATED, ConvertError, as_f32, check

ROUTER = "mlp.router."
EXPERTS = "mlp.experts.experts."  # with the expert as a first axis (after the layer's)
SHARED = "mlp.shared_experts."
BIAS = "mlp.gate.e_score_correction_bias"  # braid's (DeepSeek-V3's) name of the expert bias


def arg(args, name, default=None):
    """args.name, or `default` where Megatron-LM's args lack it or hold None."""
    value = getattr(args, name, None)
    return default if value is None else value


def moe_layer_pattern(freq, layers, where):
    """Megatron's --moe-layer-freq (N: layers 0, N, 2N, ... have experts; or a 0/1 list)."""
    if isinstance(freq, int):
        check(freq >= 1, f"{where}: args.moe_layer_freq {freq} should be at least 1")
        return [int(i % freq == 0) for i in range(layers)]
    pattern = [int(v) for v in freq]
    check(len(pattern) == layers and set(pattern) <= {0, 1}, f"{where}: args.moe_layer_freq "
          f"{list(freq)} should be one 0 or 1 per layer ({layers})")
    return pattern


def moe_config_from_args(args, where):
    """braid's MoE fields for Megatron-LM's args ({} without experts)."""
    experts = arg(args, "num_experts")
    if not experts:
        return {}
    balancing = arg(args, "moe_router_load_balancing_type", "aux_loss")
    balancing = balancing[0] if isinstance(balancing, list) and len(balancing) == 1 else balancing
    check(balancing in ("aux_loss", "seq_aux_loss", "none"), f"{where}: "
          f"args.moe_router_load_balancing_type = {balancing!r} is not supported (braid balances "
          "with aux_loss or seq_aux_loss)")
    score = arg(args, "moe_router_score_function", "softmax")
    check(score in ("softmax", "sigmoid"), f"{where}: args.moe_router_score_function = "
          f"{score!r} is not supported (braid's routers score by softmax or sigmoid)")
    for name, why in (("moe_use_upcycling", "upcycling"), ("moe_latent_size", "latent experts"),
                      ("moe_router_num_groups_per_rank", "per-rank groups")):
        if arg(args, name):
            raise ConvertError(f"{where}: args.{name} = {getattr(args, name)!r} is not supported "
                               f"({why})")
    pattern = moe_layer_pattern(arg(args, "moe_layer_freq", 1), args.num_layers, where)
    check(any(pattern), f"{where}: args.moe_layer_freq leaves no layer with experts")
    return {"num_experts": experts, "moe_router_topk": arg(args, "moe_router_topk", 2),
            "moe_ffn_hidden_size": arg(args, "moe_ffn_hidden_size", args.ffn_hidden_size),
            "moe_router_pre_softmax": bool(arg(args, "moe_router_pre_softmax", False)),
            "moe_router_score_function": score,
            "moe_router_enable_expert_bias": bool(arg(args, "moe_router_enable_expert_bias",
                                                      False)),
            "moe_router_num_groups": arg(args, "moe_router_num_groups", 0),
            "moe_router_group_topk": arg(args, "moe_router_group_topk", 0),
            "moe_router_topk_scaling_factor": as_f32(arg(args, "moe_router_topk_scaling_factor",
                                                         1.0)),
            "moe_expert_capacity_factor": float(arg(args, "moe_expert_capacity_factor", 0.0)),
            "moe_token_drop_policy": arg(args, "moe_token_drop_policy", "probs"),
            "moe_shared_expert_intermediate_size": arg(args,
                                                       "moe_shared_expert_intermediate_size", 0),
            "moe_shared_expert_gate": bool(arg(args, "moe_shared_expert_gate", False)),
            "moe_layers": [] if all(pattern) else pattern}


def expert_pattern(c):
    """Which layers of a braid config have experts, one 0/1 per layer, then one per MTP depth
    (of the last layer's kind, as braid and megatron-core build them)."""
    pattern = list(c.get("moe_layers") or [1] * c["num_layers"])
    return pattern + pattern[-1:] * (c.get("mtp_num_layers") or 0)


def megatron_moe_args(c):
    """Megatron-LM's MoE arguments for a braid config (with experts)."""
    layers = c.get("moe_layers") or []
    return {"num_experts": c["num_experts"], "moe_router_topk": c["moe_router_topk"],
            "moe_ffn_hidden_size": c.get("moe_ffn_hidden_size") or c["ffn_hidden_size"],
            "moe_router_pre_softmax": c.get("moe_router_pre_softmax", False),
            "moe_router_score_function": c.get("moe_router_score_function", "softmax"),
            "moe_router_enable_expert_bias": c.get("moe_router_enable_expert_bias", False),
            "moe_router_num_groups": c.get("moe_router_num_groups") or None,
            "moe_router_group_topk": c.get("moe_router_group_topk") or None,
            "moe_router_topk_scaling_factor": c.get("moe_router_topk_scaling_factor", 1.0),
            "moe_expert_capacity_factor": c.get("moe_expert_capacity_factor") or None,
            "moe_token_drop_policy": c.get("moe_token_drop_policy", "probs"),
            "moe_shared_expert_intermediate_size":
                c.get("moe_shared_expert_intermediate_size") or None,
            "moe_shared_expert_gate": c.get("moe_shared_expert_gate", False),
            "moe_layer_freq": list(layers) if layers else 1}


def split_fc1(t, c, size, name):
    """An fc1's rows as braid's (gate_proj, up_proj) with a gated activation (SwiGLU, the quick
    GEGLU), (None, up_proj) without."""
    if c["activation"] not in GATED:
        return None, t
    check(t.shape[0] == 2 * size, f"{name} has {t.shape[0]} rows; the gate and up "
          f"projections of {size} make {2 * size}")
    return t.like(t.array[:size]), t.like(t.array[size:])


def join_fc1(gate, up):
    """SwiGLU's fc1: the gate's rows, then the up projection's (without a gate: up's)."""
    return up if gate is None else up.like(np.concatenate([gate.array, up.array]))


def take_fc1(layers, i, name):
    """Takes layer i's fc1 `name` out of `layers`: as one tensor, or as the halves megatron-core
    names name_w and name_v with singleton_local_shards (SwiGLU's gate and up rows), joined;
    None where it has neither."""
    if (i, name + "_w") in layers and (i, name + "_v") in layers:
        return join_fc1(layers.pop((i, name + "_w")), layers.pop((i, name + "_v")))
    return layers.pop((i, name), None)


def take_mlp(layers, i, prefix, braid_prefix, c, size, out):
    """One MLP's fc1 / fc2 (weights and biases) under megatron-core's `prefix` in layer i, as
    braid's gate_proj / up_proj / down_proj under `braid_prefix`; EXPERTS holds the experts as a
    first axis (expert j: braid's {braid_prefix}{j}.)."""
    stacked = prefix == EXPERTS
    for kind in ("weight", "bias"):
        fc1 = take_fc1(layers, i, f"{prefix}linear_fc1.{kind}")
        fc2 = layers.pop((i, f"{prefix}linear_fc2.{kind}"), None)
        for j in range(c["num_experts"] if stacked else 1):
            p = f"{braid_prefix}{j}." if stacked else braid_prefix
            if fc1 is not None:
                gate, up = split_fc1(fc1.like(fc1.array[j]) if stacked else fc1, c, size,
                                     f"layer {i}'s {prefix}linear_fc1.{kind}")
                out[f"{p}up_proj.{kind}"] = up
                if gate is not None:
                    out[f"{p}gate_proj.{kind}"] = gate
            if fc2 is not None:
                out[f"{p}down_proj.{kind}"] = fc2.like(fc2.array[j]) if stacked else fc2


def moe_tensors_to_braid(layers, c, out):
    """Takes the MoE layers' router, expert bias, experts and shared expert out of `layers`
    ({(layer, megatron-core name): Tensor}; the MTP depths' layers after the model's) into `out`
    under braid's names."""
    ffn = c.get("moe_ffn_hidden_size") or c["ffn_hidden_size"]
    for i in [i for i, e in enumerate(expert_pattern(c)) if e]:
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):  # (the bias with add_bias_linear)
            if (i, ROUTER + kind) in layers:
                out[p + "mlp.gate." + kind] = layers.pop((i, ROUTER + kind))
        if (i, ROUTER + "expert_bias") in layers:
            bias = layers.pop((i, ROUTER + "expert_bias"))
            check(bias.dtype == "F32", f"layer {i}'s {ROUTER}expert_bias is {bias.dtype}; "
                  "megatron-core and braid keep it in f32")
            out[p + BIAS] = bias
        take_mlp(layers, i, EXPERTS, p + "mlp.experts.", c, ffn, out)
        for j in range(c["num_experts"]):  # singleton_local_shards: one name per expert
            take_mlp(layers, i, f"{EXPERTS}{j}.", f"{p}mlp.experts.{j}.", c, ffn, out)
        shared = c.get("moe_shared_expert_intermediate_size") or 0
        if shared:
            take_mlp(layers, i, SHARED, p + "mlp.shared_expert.", c, shared, out)
        if (i, SHARED + "gate_weight") in layers:
            out[p + "mlp.shared_expert_gate.weight"] = layers.pop((i, SHARED + "gate_weight"))


def braid_moe_layer(t, c, i):
    """Layer i's router, expert bias, experts and shared expert under megatron-core's names
    ({name: Tensor}; the experts stacked on a first axis)."""
    p = f"model.layers.{i}."
    out = {ROUTER + "weight": t[p + "mlp.gate.weight"]}
    if p + "mlp.gate.bias" in t:
        out[ROUTER + "bias"] = t[p + "mlp.gate.bias"]
    if p + BIAS in t:
        out[ROUTER + "expert_bias"] = t[p + BIAS]
    shared = c.get("moe_shared_expert_intermediate_size")
    for kind in ("weight", "bias"):
        if p + f"mlp.experts.0.up_proj.{kind}" in t:
            experts = [f"{p}mlp.experts.{j}." for j in range(c["num_experts"])]
            fc1 = [join_fc1(t.get(e + "gate_proj." + kind), t[e + "up_proj." + kind])
                   for e in experts]
            fc2 = [t[e + "down_proj." + kind] for e in experts]
            out[f"{EXPERTS}linear_fc1.{kind}"] = fc1[0].like(np.stack([x.array for x in fc1]))
            out[f"{EXPERTS}linear_fc2.{kind}"] = fc2[0].like(np.stack([x.array for x in fc2]))
        e = p + "mlp.shared_expert."
        if shared and e + "up_proj." + kind in t:
            out[f"{SHARED}linear_fc1.{kind}"] = join_fc1(t.get(e + "gate_proj." + kind),
                                                         t[e + "up_proj." + kind])
            out[f"{SHARED}linear_fc2.{kind}"] = t[e + "down_proj." + kind]
    if p + "mlp.shared_expert_gate.weight" in t:
        out[SHARED + "gate_weight"] = t[p + "mlp.shared_expert_gate.weight"]
    return out


def moe_extra_state_modules(c):
    """(module, whether it has an expert axis) of an MoE layer that have an _extra_state."""
    shared = (SHARED + "linear_fc1", SHARED + "linear_fc2") if c.get(
        "moe_shared_expert_intermediate_size") else ()
    return [(EXPERTS + "linear_fc1", True), (EXPERTS + "linear_fc2", True)] + [
        (m, False) for m in shared]
