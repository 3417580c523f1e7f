"""Mixture-of-experts models between Hugging Face and braid (docs/convert_hf.md): Mixtral
(MixtralForCausalLM), Qwen2-MoE (Qwen2MoeForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM), their
config fields and the names of their router and expert tensors. hf_configs.py holds what they
share with Mistral, Qwen2 and Qwen3 (attention, norms, RoPE, windows).

A braid MoE layer has a router `mlp.gate.weight` [E, H] and per expert j
`mlp.experts.{j}.{gate_proj,up_proj,down_proj}.weight` (SwiGLU, no biases); with a shared expert
(Qwen2-MoE's) `mlp.shared_expert.{gate_proj,up_proj,down_proj}.weight` and its sigmoid gate
`mlp.shared_expert_gate.weight` [1, H]. The layers braid's moe_layers marks 0 have the dense MLP
(`mlp.{gate_proj,up_proj,down_proj}.weight`, ffn_hidden_size wide), as the Qwens' layers that
mlp_only_layers and decoder_sparse_step leave without experts do; Mixtral has experts on every
layer. On disk transformers writes Qwen2-MoE and Qwen3-MoE under braid's names and Mixtral as
`block_sparse_moe.gate`, `block_sparse_moe.experts.{j}.w1` (gate), `w3` (up), `w2` (down);
transformers 5 holds the experts of a layer fused in memory (`mlp.experts.gate_up_proj`
[E, 2F, H], gate rows first, and `mlp.experts.down_proj` [E, H, F]) and converts on load and
save. Import reads either layout; export writes the per-expert one, which every transformers
release loads. dots1, GLM-4.5, DeepSeek-V2 and DeepSeek-V3 name their experts as the Qwens do;
what else they have (their routers, expert biases, ungated shared experts) is hf_deepseek.py's.
"""

import json

from hf_configs import braid_architecture, braid_window, check, refuse

MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
BRAID_EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
EXPERT_NAMES = {"mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
                "qwen2_moe": BRAID_EXPERT_NAMES, "qwen3_moe": BRAID_EXPERT_NAMES,
                "dots1": BRAID_EXPERT_NAMES, "glm4_moe": BRAID_EXPERT_NAMES,
                "deepseek_v2": BRAID_EXPERT_NAMES, "deepseek_v3": BRAID_EXPERT_NAMES}
MLP_PREFIX = {"mixtral": "block_sparse_moe.", "qwen2_moe": "mlp.", "qwen3_moe": "mlp.",
              "dots1": "mlp.", "glm4_moe": "mlp.", "deepseek_v2": "mlp.", "deepseek_v3": "mlp."}
# transformers' defaults: (experts, top k, the experts' width)
DEFAULTS = {"mixtral": (8, 2, None), "qwen2_moe": (60, 4, 1408), "qwen3_moe": (128, 8, 768)}


# ---- config.json <-> braid's config -----------------------------------------------------------

def moe_config_from_hf(hf, arch):
    """braid's MoE fields for a Mixtral, Qwen2-MoE or Qwen3-MoE config.json ({} for a dense
    architecture); transformers' defaults where a field is left out. The Qwens' norm_topk_prob:
    true is a softmax over the top k logits (Mixtral's router), false the top k of a softmax over
    all experts (moe_router_pre_softmax). Qwen2-MoE adds a shared expert, always gated."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    # transformers 5 writes num_local_experts for Mixtral and Qwen3-MoE; hub configs and
    # Qwen2-MoE num_experts.
    default_experts, default_topk, default_ffn = DEFAULTS[arch]
    experts = hf.get("num_local_experts", hf.get("num_experts", default_experts))
    topk = hf.get("num_experts_per_tok", default_topk)
    shared = {}
    if arch == "mixtral":
        ffn, pre_softmax = hf["intermediate_size"], False
        layers = []
    else:
        layers = sparse_layers(hf)
        ffn = hf.get("moe_intermediate_size", default_ffn)
        pre_softmax = not hf.get("norm_topk_prob", False)
    if arch == "qwen2_moe":
        size = hf.get("shared_expert_intermediate_size", 5632)
        check(isinstance(size, int) and size >= 1, "config.json: shared_expert_intermediate_size "
              f"should be a positive integer, is {size!r}")
        shared = {"moe_shared_expert_intermediate_size": size, "moe_shared_expert_gate": True}
    check(isinstance(experts, int) and experts >= 1, "config.json: the number of experts "
          f"should be a positive integer, is {experts!r}")
    check(isinstance(topk, int) and 1 <= topk <= experts, "config.json: num_experts_per_tok "
          f"should be in [1, {experts}] (the number of experts), is {topk!r}")
    check(isinstance(ffn, int) and ffn >= 1, "config.json: the experts' intermediate size "
          f"should be a positive integer, is {ffn!r}")
    return {"num_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": ffn,
            "moe_router_pre_softmax": pre_softmax, **shared,
            "moe_layers": [] if all(layers) else layers}


def sparse_layers(hf):
    """One entry per layer of a Qwen2-MoE or Qwen3-MoE config.json, 1 where transformers builds
    the experts: layer i unless mlp_only_layers lists it, and only if (i + 1) is a multiple of
    decoder_sparse_step; the other layers have the dense MLP of intermediate_size."""
    only, step = hf.get("mlp_only_layers") or [], hf.get("decoder_sparse_step", 1)
    check(isinstance(only, list) and all(isinstance(i, int) for i in only), "config.json: "
          f"mlp_only_layers should be a list of layer numbers, is {json.dumps(only)}")
    check(isinstance(step, int) and step >= 1, "config.json: decoder_sparse_step should be a "
          f"positive integer, is {json.dumps(step)}")
    layers = [int(i not in only and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]
    if not any(layers):
        refuse("mlp_only_layers" if only else "decoder_sparse_step", only or step, "no layer "
               "has experts; braid's MoE models have them on one layer at least "
               "(--moe-layer-freq)")
    return layers


def expert_layers(c):
    """One entry per layer of a braid config, 1 where it has experts (moe_layers; every layer
    where it is empty or absent)."""
    return c.get("moe_layers") or [1] * c["num_layers"]


def moe_architecture(c):
    """The HF architecture of a braid MoE config: Qwen2-MoE with a shared expert; else Mixtral
    (Mistral's shape: no q/k norms, no biases, a window on every layer or none, the router's
    softmax over the top k, experts on every layer) or Qwen3-MoE with q/k norms (norm_topk_prob
    for either router, mlp_only_layers for dense layers); ConvertError with why otherwise.
    (Sigmoid routers: hf_deepseek.sigmoid_moe_architecture.)"""
    what = "this braid model's softmax router"
    check(not c.get("moe_router_num_groups"), what, " picks experts from groups "
          "(moe_router_num_groups); MixtralForCausalLM's, Qwen2MoeForCausalLM's and "
          "Qwen3MoeForCausalLM's do not (the HF models with groups route by sigmoid scores)")
    check(c.get("moe_router_topk_scaling_factor", 1.0) == 1.0, what, " scales the weights by ",
          c.get("moe_router_topk_scaling_factor"), " (moe_router_topk_scaling_factor); "
          "MixtralForCausalLM's, Qwen2MoeForCausalLM's and Qwen3MoeForCausalLM's do not")
    if c.get("moe_shared_expert_intermediate_size"):
        return shared_expert_architecture(c)
    what = "this braid model has experts"
    check(not c["add_bias_linear"] and not c.get("add_qkv_bias"), what, " and biases; "
          "MixtralForCausalLM has none, Qwen3MoeForCausalLM's experts have none, and "
          "Qwen2MoeForCausalLM (q, k, v biases) has a shared expert, which this model has not")
    window = braid_window(c)
    check(window is None or all(window[1]), what, " and a window on some layers only; "
          "MixtralForCausalLM and Qwen3MoeForCausalLM window every layer or none")
    dense = braid_architecture(c)  # the attention, norms and RoPE as a dense model's
    check(dense in ("llama", "mistral", "qwen3"), what, " and is ", dense, " shaped; "
          "MixtralForCausalLM and Qwen3MoeForCausalLM are RMSNorm, SwiGLU, RoPE")
    if c.get("qk_layernorm"):
        return "qwen3_moe"
    check(all(expert_layers(c)), what, " on some layers only (moe_layers) but no q/k norms and "
          "no shared expert; MixtralForCausalLM has experts on every layer, and of the HF "
          "models with dense layers among expert ones (mlp_only_layers) Qwen3MoeForCausalLM "
          "has q/k norms and Qwen2MoeForCausalLM a shared expert")
    check(not c.get("moe_router_pre_softmax"), what, " whose router takes the top k of a "
          "softmax over all experts (moe_router_pre_softmax) but no q/k norms; "
          "MixtralForCausalLM always renormalises the top k, and Qwen3MoeForCausalLM (whose "
          "norm_topk_prob false routes so) has q/k norms")
    return "mixtral"


def shared_expert_architecture(c):
    """Qwen2-MoE for a braid MoE config with a shared expert: its sigmoid gate, no q/k norms,
    q, k, v biases or none (export writes zeros), any window pattern (layer_types), either
    router (norm_topk_prob), dense layers anywhere (mlp_only_layers); ConvertError with why
    otherwise."""
    what = "this braid model has a shared expert"
    check(c.get("moe_shared_expert_gate"), what, " without a gate; Qwen2MoeForCausalLM, the HF "
          "model with a shared expert, always scales its output by sigmoid(x w) "
          "(--moe-shared-expert-gate)")
    check(not c["add_bias_linear"], what, " and biases on every linear layer; "
          "Qwen2MoeForCausalLM has biases on q, k and v alone")
    check(not c.get("qk_layernorm"), what, " and q/k norms; Qwen2MoeForCausalLM has none")
    dense = braid_architecture(c)  # the attention, norms and RoPE as a dense model's
    check(dense in ("llama", "mistral", "qwen2"), what, " and is ", dense, " shaped; "
          "Qwen2MoeForCausalLM is RMSNorm, SwiGLU, RoPE")
    return "qwen2_moe"


def moe_ffn(c):
    """The experts' hidden size of a braid config (moe_ffn_hidden_size, 0: ffn_hidden_size)."""
    return c.get("moe_ffn_hidden_size") or c["ffn_hidden_size"]


def hf_moe_config(c, arch):
    """The MoE fields of the HF config.json for a braid MoE config."""
    if arch == "mixtral":
        return {"num_local_experts": c["num_experts"], "num_experts_per_tok":
                c["moe_router_topk"], "intermediate_size": moe_ffn(c)}
    # The Qwens' hub configs say num_experts (transformers 5 maps Qwen3-MoE's to
    # num_local_experts); intermediate_size is their dense MLPs' width, braid's ffn_hidden_size
    # (kept where every layer has experts). mlp_only_layers lists any pattern of dense layers.
    hf = {"num_experts": c["num_experts"], "num_experts_per_tok": c["moe_router_topk"],
          "moe_intermediate_size": moe_ffn(c),
          "norm_topk_prob": not c.get("moe_router_pre_softmax", False),
          "decoder_sparse_step": 1,
          "mlp_only_layers": [i for i, e in enumerate(expert_layers(c)) if not e]}
    if arch == "qwen2_moe":  # q, k, v biases always: transformers 4 has no qkv_bias switch
        hf.update({"shared_expert_intermediate_size": c["moe_shared_expert_intermediate_size"],
                   "qkv_bias": True})
    return hf


# ---- tensor names ------------------------------------------------------------------------------

def moe_tensors_to_braid(hf, arch, c):
    """Renames, in `hf` (name -> Tensor), each layer's router and experts to braid's names,
    splitting transformers 5's fused [E, 2F, H] / [E, H, F] experts where it holds those. Dense
    layers' MLPs have braid's names already."""
    e_count, f, h = c["num_experts"], moe_ffn(c), c["hidden_size"]
    for i in [i for i, e in enumerate(expert_layers(c)) if e]:
        p, src = f"model.layers.{i}.", f"model.layers.{i}.{MLP_PREFIX[arch]}"
        for router in (src + "gate.weight", p + "mlp.gate.weight"):
            if router in hf:
                hf[p + "mlp.gate.weight"] = hf.pop(router)
                break
        fused = (p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj")
        if fused[0] in hf or fused[1] in hf:
            has, lacks = fused if fused[0] in hf else fused[::-1]
            check(lacks in hf, f"the HF weights have {has} but no {lacks}")
            gate_up, down = hf.pop(fused[0]), hf.pop(fused[1])
            check(gate_up.shape == [e_count, 2 * f, h], f"{fused[0]} is {gate_up.shape}, "
                  f"config.json makes it {[e_count, 2 * f, h]}")
            check(down.shape == [e_count, h, f], f"{fused[1]} is {down.shape}, config.json "
                  f"makes it {[e_count, h, f]}")
            for j in range(e_count):
                x = f"{p}mlp.experts.{j}."
                hf[x + "gate_proj.weight"] = gate_up.like(gate_up.array[j, :f])
                hf[x + "up_proj.weight"] = gate_up.like(gate_up.array[j, f:])
                hf[x + "down_proj.weight"] = down.like(down.array[j])
            continue
        for j in range(e_count):
            for braid_name, hf_name in EXPERT_NAMES[arch].items():
                name = f"{src}experts.{j}.{hf_name}.weight"
                check(name in hf, f"the HF weights have no {name} (config.json: {e_count} "
                      "experts)")
                hf[f"{p}mlp.experts.{j}.{braid_name}.weight"] = hf.pop(name)


def braid_moe_tensors_to_hf(t, arch, c):
    """braid's tensors -> the per-expert names transformers writes (in place)."""
    if arch in ("qwen2_moe", "qwen3_moe"):  # braid's names
        return
    for i in [i for i, e in enumerate(expert_layers(c)) if e]:
        p, dst = f"model.layers.{i}.", f"model.layers.{i}.{MLP_PREFIX[arch]}"
        t[dst + "gate.weight"] = t.pop(p + "mlp.gate.weight")
        for j in range(c["num_experts"]):
            for braid_name, hf_name in EXPERT_NAMES[arch].items():
                t[f"{dst}experts.{j}.{hf_name}.weight"] = t.pop(
                    f"{p}mlp.experts.{j}.{braid_name}.weight")
