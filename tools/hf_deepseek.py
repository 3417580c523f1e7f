"""DeepSeek-V3 (DeepseekV3ForCausalLM: multi-latent attention) and the mixtures of experts that
route as it does, between Hugging Face and braid (docs/convert_hf.md): dots1 (Dots1ForCausalLM:
Qwen3's attention) and GLM-4.5 (Glm4MoeForCausalLM: q, k, v biases, RoPE on a part of each head,
optional q/k norms). hf_configs.py holds their norms and dots1's and GLM-4.5's attention and
RoPE; hf_moe.py the expert tensors they share with the Qwens.

DeepSeek-V3's attention is braid's multi_latent_attention (include/braid/model/config.h), with
HF's names and layouts: self_attn.q_a_proj [Lq, H], q_a_layernorm [Lq], q_b_proj [N (Dn + Dr),
Lq] (or, with q_lora_rank null, q_proj [N (Dn + Dr), H]), kv_a_proj_with_mqa [Lkv + Dr, H],
kv_a_layernorm [Lkv], kv_b_proj [N (Dn + Dv), Lkv], o_proj [H, N Dv], no biases; q_lora_rank
(null: 0), kv_lora_rank, qk_nope_head_dim (braid's qk_head_dim), qk_rope_head_dim
(qk_pos_emb_head_dim) and v_head_dim as they are; qk_layernorm for the latent norms, which
transformers always builds. Its RoPE turns interleaved pairs (rope_interleave true, as braid's
MLA), plain or YaRN-scaled (rope_scaling, DeepSeek-V3's long context: yarn_config_from_hf); the
softmax scale is 1/sqrt(Dn + Dr), with YaRN times g(mscale_all_dim)^2. transformers' latent
norms use eps 1e-6 whatever rms_norm_eps says (DeepSeek's code too), braid's norm_eps for every
norm: the two must be 1e-6. Every layer but the first first_k_dense_replace routes as below;
with first_k_dense_replace >= num_hidden_layers no layer does, and braid's model is dense.

Their router (transformers' Dots1TopkRouter, Glm4MoeTopkRouter, DeepseekV3TopkRouter) is
braid's sigmoid router with an expert bias: s = sigmoid(x W^T) (f32); the top k of
s + e_score_correction_bias are chosen among the topk_group best of n_group groups, a group
scored by the sum of its 2 best s + bias; the weights are s at the chosen, divided by their sum +
1e-20 when norm_topk_prob, times routed_scaling_factor. braid (Megatron) scores a group by its
best moe_router_topk / group_topk, so groups import only where that is 2; braid always
renormalises for k > 1 and never for k = 1. Every expert layer adds an ungated shared expert of
n_shared_experts x moe_intermediate_size; the first first_k_dense_replace layers have the dense
MLP of intermediate_size instead.

Tensors: braid's names but for the shared expert (HF `mlp.shared_experts.*`, braid
`mlp.shared_expert.*`); `mlp.gate.e_score_correction_bias` [E] f32 is braid's expert bias
(GPTModel.expert_biases(), stored in the checkpoint under that name).
"""

import json
import math

import numpy as np

from hf_configs import (SIGMOID_MOE_KEYS, as_f32, braid_window, check, f32_value, refuse,
                        rope_parameters_of, yarn_attention_factor, yarn_mscale)
from hf_moe import expert_layers, moe_ffn
from safetensors_numpy import Tensor

SIGMOID_MOE_ARCHITECTURES = ("dots1", "glm4_moe", "deepseek_v3")
# transformers' defaults, where config.json leaves a field out
DEFAULTS = {
    "dots1": {"first_k_dense_replace": 0, "norm_topk_prob": False},
    "glm4_moe": {"first_k_dense_replace": 1, "norm_topk_prob": True, "n_shared_experts": 1,
                 "n_routed_experts": 128, "num_experts_per_tok": 8},
    "deepseek_v3": {"first_k_dense_replace": 3, "norm_topk_prob": True, "n_shared_experts": 1,
                    "n_routed_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048, "n_group": 8, "topk_group": 4,
                    "routed_scaling_factor": 2.5},
}
LATENT_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                   "qk_rope_head_dim": 64, "v_head_dim": 128}
BIAS = "mlp.gate.e_score_correction_bias"


def sigmoid_router(c):
    """Whether a braid config routes by sigmoid scores (dots1's, GLM-4.5's and DeepSeek-V3's
    router)."""
    return c.get("moe_router_score_function", "softmax") == "sigmoid"


# ---- config.json -> braid's config ------------------------------------------------------------

def positive(value, field):
    check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
          f"config.json: {field} should be a positive integer, is {json.dumps(value)}")
    return value


LATENT_NORM_EPS = 1e-6  # transformers' (and DeepSeek's) q_a_layernorm and kv_a_layernorm, always


def _number(params, field, where, least=0.0):
    value = params[field]
    check(isinstance(value, (int, float)) and not isinstance(value, bool) and
          math.isfinite(value) and value >= least, f"config.json: {where}.{field} should be a "
          f"number >= {least:g}, is {json.dumps(value)}")
    return value


def yarn_config_from_hf(hf):
    """braid's YaRN fields for a DeepSeek-V3 config.json whose RoPE is rope_type yarn, as
    transformers' _compute_yarn_parameters and DeepseekV3Attention compute it: the frequencies
    from factor, beta_fast, beta_slow (32 and 1 where absent or 0) and
    original_max_position_embeddings (max_position_embeddings where absent); cos and sin times
    attention_factor, or g(mscale) / g(mscale_all_dim) when both are set, else g(1); the softmax
    scale times g(mscale_all_dim)^2. braid (megatron-core, DeepSeek's own code) multiplies cos
    and sin by g(mscale) / g(mscale_all_dim), 1 and 0 where absent. ConvertError where the two
    differ (an attention_factor other than that ratio; one of mscale and mscale_all_dim without
    the other, but for mscale 1 alone) and for truncate false."""
    params, field = rope_parameters_of(hf)
    if "factor" not in params:
        refuse(field, params, "rope_type yarn without its factor")
    factor = _number(params, "factor", field, least=1.0)
    original = params.get("original_max_position_embeddings") or hf["max_position_embeddings"]
    check(isinstance(original, (int, float)) and not isinstance(original, bool) and
          original >= 1 and original == int(original), f"config.json: {field}."
          f"original_max_position_embeddings should be a positive integer, is {original!r}")
    fast = _number(params, "beta_fast", field) if params.get("beta_fast") else 32.0
    slow = _number(params, "beta_slow", field) if params.get("beta_slow") else 1.0
    if not 0 < slow <= fast:
        refuse(f"{field}.beta_slow", slow, f"YaRN needs 0 < beta_slow <= beta_fast ({fast})")
    if params.get("truncate", True) is not True:
        refuse(f"{field}.truncate", params["truncate"], "transformers then blends the "
               "frequencies over the unrounded correction range; braid's YaRN (megatron-core's) "
               "rounds it (floor, ceil)")
    mscale = _number(params, "mscale", field) if params.get("mscale") is not None else None
    all_dim = (_number(params, "mscale_all_dim", field)
               if params.get("mscale_all_dim") is not None else None)
    # DeepSeek's own modeling code and megatron-core: g(mscale) / g(mscale_all_dim), 1 and 0
    # where absent; transformers the same when both are set, else g(1), or attention_factor.
    kept, all_dim = (1.0 if mscale is None else mscale), all_dim or 0.0
    ratio = yarn_attention_factor(factor, kept, all_dim)
    given = params.get("attention_factor")
    if given is not None:
        given = _number(params, "attention_factor", field)
        if abs(given - ratio) > 1e-6 * ratio:
            refuse(f"{field}.attention_factor", given, "braid (as megatron-core and DeepSeek's "
                   f"code) multiplies cos and sin by g(mscale) / g(mscale_all_dim) = {ratio:.7g}, "
                   "g(m) = 0.1 m ln(factor) + 1")
    elif not (mscale and all_dim) and ratio != yarn_mscale(as_f32(factor), 1.0):
        name = "mscale" if mscale is not None else "mscale_all_dim"
        refuse(f"{field}.{name}", params[name], "transformers then multiplies cos and sin by "
               f"g(1) = {yarn_mscale(factor, 1.0):.7g}, DeepSeek's code and megatron-core (and "
               f"braid) by g(mscale) / g(mscale_all_dim) = {ratio:.7g}, g(m) = 0.1 m ln(factor) "
               "+ 1: give both mscale and mscale_all_dim, or an attention_factor")
    return {"rope_yarn_factor": as_f32(factor), "rope_yarn_beta_fast": as_f32(fast),
            "rope_yarn_beta_slow": as_f32(slow), "rope_yarn_mscale": as_f32(kept),
            "rope_yarn_mscale_all_dim": as_f32(all_dim),
            "rope_original_max_position_embeddings": int(original)}


def latent_attention_config_from_hf(hf):
    """braid's attention fields for a DeepSeek-V3 config.json, in place of the Llama ones (a key
    and value head per query head, the latent norms); ConvertError for what braid's
    multi-latent attention does not compute as transformers' DeepseekV3Attention does."""
    def get(field):
        return hf.get(field, LATENT_DEFAULTS.get(field))

    if hf.get("attention_bias"):
        refuse("attention_bias", hf["attention_bias"], "DeepseekV3Attention then has biases on "
               "q_a_proj, kv_a_proj_with_mqa and o_proj; braid's multi-latent attention has none")
    if hf.get("rope_interleave", True) is not True:
        refuse("rope_interleave", hf["rope_interleave"], "transformers then turns the two halves "
               "of each head's RoPE channels against each other (rotate_half); braid's "
               "multi-latent attention turns interleaved pairs, as DeepSeek's checkpoints hold "
               "them")
    params, field = rope_parameters_of(hf)
    if params["rope_type"] not in ("default", "yarn"):
        refuse(f"{field}.rope_type", params["rope_type"], "braid's multi-latent attention turns "
               "plain RoPE or YaRN's (DeepSeek-V3's)")
    yarn = yarn_config_from_hf(hf) if params["rope_type"] == "yarn" else {}
    eps = hf.get("rms_norm_eps", 1e-6)
    if as_f32(eps) != as_f32(LATENT_NORM_EPS):
        refuse("rms_norm_eps", eps, "DeepseekV3Attention's latent norms (q_a_layernorm, "
               f"kv_a_layernorm) use {LATENT_NORM_EPS} whatever rms_norm_eps says; braid's norms "
               "share one epsilon (norm_eps)")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or kv_heads < heads:
        refuse("num_key_value_heads", kv_heads, f"DeepseekV3Attention gives each of the {heads} "
               "query heads its own key and value (kv_b_proj), which transformers cannot "
               f"repeat over {kv_heads} groups; braid's multi-latent attention has one per head")
    q_rank = get("q_lora_rank")
    if q_rank is not None:
        positive(q_rank, "q_lora_rank")
    dn, dr = positive(get("qk_nope_head_dim"), "qk_nope_head_dim"), get("qk_rope_head_dim")
    check(isinstance(dr, int) and dr >= 2 and dr % 2 == 0, "config.json: qk_rope_head_dim "
          f"should be a positive even number (RoPE turns pairs), is {json.dumps(dr)}")
    dv = positive(get("v_head_dim"), "v_head_dim")
    if dv > dn + dr:
        refuse("v_head_dim", dv, f"wider than the query and key heads, qk_nope_head_dim + "
               f"qk_rope_head_dim = {dn + dr}; braid's attention runs the value heads padded to "
               "their width")
    return {"multi_latent_attention": True, "q_lora_rank": q_rank or 0,
            "kv_lora_rank": positive(get("kv_lora_rank"), "kv_lora_rank"),
            "qk_head_dim": dn, "qk_pos_emb_head_dim": dr, "v_head_dim": dv,
            # braid's saves hold the query/key head width here; readers set 0 for MLA
            "kv_channels": dn + dr, "num_query_groups": heads, "qk_layernorm": True,
            "add_bias_linear": False, "add_qkv_bias": False, **yarn}


def sigmoid_moe_config_from_hf(hf, arch):
    """braid's MoE fields for a dots1, GLM-4.5 or DeepSeek-V3 config.json ({} for a DeepSeek-V3
    whose first_k_dense_replace leaves no layer with experts: a dense model); ConvertError for
    what braid's router cannot compute exactly."""
    defaults = {"moe_intermediate_size": 1408, "n_group": 1, "topk_group": 1,
                "routed_scaling_factor": 1.0, **DEFAULTS[arch]}

    def get(field):
        return hf.get(field, defaults.get(field))

    layers = hf["num_hidden_layers"]
    first = get("first_k_dense_replace")
    check(isinstance(first, int) and first >= 0, "config.json: first_k_dense_replace should be "
          f"a layer count, is {json.dumps(first)}")
    if first >= layers and arch == "deepseek_v3":
        return {}  # transformers builds no router: the MoE fields say nothing
    if first >= layers:
        refuse("first_k_dense_replace", first, f"no layer of the {layers} has experts; braid's "
               "MoE models have them on one layer at least")
    experts = positive(hf.get("n_routed_experts", hf.get("num_local_experts",
                                                         defaults.get("n_routed_experts"))),
                       "n_routed_experts")
    topk = get("num_experts_per_tok")
    check(isinstance(topk, int) and 1 <= topk <= experts, "config.json: num_experts_per_tok "
          f"should be in [1, {experts}] (n_routed_experts), is {json.dumps(topk)}")
    ffn = positive(get("moe_intermediate_size"), "moe_intermediate_size")
    shared = positive(get("n_shared_experts"), "n_shared_experts")
    norm = get("norm_topk_prob")
    if topk > 1 and not norm:
        refuse("norm_topk_prob", norm, f"braid's sigmoid router (Megatron's) always divides the "
               f"weights of the top {topk} by their sum; this model weights each by its score "
               "alone")
    if topk == 1 and norm:
        refuse("norm_topk_prob", norm, "with one expert per token it makes every weight 1; "
               "braid's sigmoid router (Megatron's) weights the expert by its score")
    groups = get("n_group") or 1
    group_topk = get("topk_group") or 1
    check(isinstance(groups, int) and groups >= 1 and experts % groups == 0, "config.json: "
          f"n_group should divide n_routed_experts {experts}, is {json.dumps(groups)}")
    check(isinstance(group_topk, int) and 1 <= group_topk <= groups, "config.json: topk_group "
          f"should be in [1, {groups}] (n_group), is {json.dumps(group_topk)}")
    if groups > 1 and (topk % group_topk or topk // group_topk != 2):
        refuse("n_group", groups, "transformers scores each group by the sum of its 2 best "
               "experts, braid (Megatron) by its best num_experts_per_tok / topk_group; "
               f"here num_experts_per_tok is {topk} and topk_group {group_topk}, so braid holds "
               "this only with num_experts_per_tok = 2 x topk_group")
    scale = get("routed_scaling_factor")
    check(isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0,
          f"config.json: routed_scaling_factor should be a positive number, is "
          f"{json.dumps(scale)}")
    return {"num_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": ffn,
            "moe_router_pre_softmax": False, "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": groups if groups > 1 else 0,
            "moe_router_group_topk": group_topk if groups > 1 else 0,
            "moe_router_topk_scaling_factor": as_f32(scale),
            "moe_shared_expert_intermediate_size": shared * ffn,
            "moe_shared_expert_gate": False,
            "moe_layers": [int(i >= first) for i in range(layers)] if first else []}


# ---- braid's config -> config.json ------------------------------------------------------------

def latent_attention_architecture(c):
    """DeepSeek-V3 for a braid config with multi-latent attention (experts routed by sigmoid
    scores, as sigmoid_moe_architecture checks, or none: every layer dense); ConvertError with
    why otherwise."""
    what = "this braid model has multi-latent attention"
    kind = (c["normalization"], c["activation"], c["position_embedding"])
    check(kind == ("rmsnorm", "swiglu", "rope"), what, " and is ", "/".join(kind), " shaped; "
          "DeepseekV3ForCausalLM is rmsnorm/swiglu/rope")
    check(c.get("qk_layernorm"), what, " without its latent norms (qk_layernorm); "
          "DeepseekV3ForCausalLM always norms them (q_a_layernorm, kv_a_layernorm)")
    check(braid_window(c) is None, what, " and a sliding window; DeepseekV3ForCausalLM has none")
    check(not c.get("rope_scaling_factor"), what, " and Llama 3.1's RoPE scaling; "
          "DeepseekV3ForCausalLM turns plain RoPE or YaRN's (rope_type yarn)")
    check(as_f32(c["norm_eps"]) == as_f32(LATENT_NORM_EPS), what, " and norm_eps ",
          f32_value(c["norm_eps"]), f"; DeepseekV3ForCausalLM's latent norms use {LATENT_NORM_EPS} "
          "whatever rms_norm_eps says (train with --norm-epsilon 1e-6)")
    if c.get("num_experts"):
        check(sigmoid_router(c), what, " and a softmax router; DeepseekV3ForCausalLM routes by "
              "sigmoid scores with an expert bias (--moe-router-score-function sigmoid)")
        sigmoid_moe_architecture(c)  # the routing's checks
    return "deepseek_v3"


def hf_latent_attention_config(c, imported):
    """The attention fields of DeepSeek-V3's config.json for a braid config with multi-latent
    attention; for a dense one first_k_dense_replace = num_hidden_layers, with the MoE fields
    (which then build nothing) of the config an import stored."""
    dn, dr = c["qk_head_dim"], c["qk_pos_emb_head_dim"]
    hf = {"q_lora_rank": c["q_lora_rank"] or None, "kv_lora_rank": c["kv_lora_rank"],
          "qk_nope_head_dim": dn, "qk_rope_head_dim": dr, "v_head_dim": c["v_head_dim"],
          "qk_head_dim": dn + dr, "head_dim": dr,  # as transformers derives them
          "num_key_value_heads": c["num_attention_heads"], "rope_interleave": True,
          "attention_bias": False, "num_nextn_predict_layers": 0}  # no MTP layers exported
    if not c.get("num_experts"):
        if (imported or {}).get("model_type") == "deepseek_v3":
            hf.update({k: imported[k] for k in SIGMOID_MOE_KEYS if k in imported})
        hf["first_k_dense_replace"] = c["num_layers"]
    return hf


def sigmoid_moe_architecture(c):
    """dots1 or GLM-4.5 for a braid config with a sigmoid router: dots1 with q/k norms, no
    biases and RoPE on whole heads (any window pattern), else GLM-4.5 (q, k, v biases or none,
    q/k norms or none, any rotary_percent, no window); ConvertError with why otherwise."""
    what = "this braid model routes by sigmoid scores"
    kind = (c["normalization"], c["activation"], c["position_embedding"])
    check(kind == ("rmsnorm", "swiglu", "rope"), what, " and is ", "/".join(kind), " shaped; "
          "Dots1ForCausalLM and Glm4MoeForCausalLM are rmsnorm/swiglu/rope")
    check(not c["add_bias_linear"], what, " and has biases on every linear layer; "
          "Glm4MoeForCausalLM has them on q, k and v alone, Dots1ForCausalLM's MLPs have none")
    shared, ffn = c.get("moe_shared_expert_intermediate_size", 0), moe_ffn(c)
    check(shared, what, " but has no shared expert; Dots1ForCausalLM and Glm4MoeForCausalLM "
          "always add one (n_shared_experts)")
    check(not c.get("moe_shared_expert_gate"), what, " and gates its shared expert; "
          "Dots1ForCausalLM and Glm4MoeForCausalLM add it ungated")
    check(shared % ffn == 0, what, f" and its shared expert is {shared} wide, not a multiple of "
          f"the experts' {ffn}; transformers builds n_shared_experts x moe_intermediate_size")
    layers = expert_layers(c)
    check(1 in layers, what, " but no layer has experts (moe_layers)")
    first = layers.index(1)
    check(layers == [0] * first + [1] * (len(layers) - first), what, " and dense layers after "
          f"expert ones (moe_layers {layers}); Dots1ForCausalLM and Glm4MoeForCausalLM have "
          "them first (first_k_dense_replace)")
    groups, topk = c.get("moe_router_num_groups", 0), c["moe_router_topk"]
    group_topk = c.get("moe_router_group_topk", 0)
    check(groups <= 1 or topk == 2 * group_topk, what, f" in {groups} groups, each scored by its "
          f"best moe_router_topk / group_topk = {topk} / {group_topk}; transformers scores a "
          "group by its best 2")
    if c.get("qk_layernorm") and not c.get("add_qkv_bias") and c.get("rotary_percent", 1.0) == 1:
        return "dots1"
    check(braid_window(c) is None, what, " and has a sliding window but ",
          "q, k, v biases" if c.get("add_qkv_bias") else
          "RoPE on a part of each head" if c.get("rotary_percent", 1.0) != 1 else
          "no q/k norms", "; Glm4MoeForCausalLM has no window, Dots1ForCausalLM (q/k norms, "
          "RoPE on whole heads) no biases")
    return "glm4_moe"


def hf_sigmoid_moe_config(c, arch):
    """The MoE fields of the HF config.json for a braid config with a sigmoid router."""
    layers, topk = expert_layers(c), c["moe_router_topk"]
    groups = c.get("moe_router_num_groups", 0)
    hf = {"n_routed_experts": c["num_experts"], "num_experts_per_tok": topk,
          "moe_intermediate_size": moe_ffn(c),
          "n_shared_experts": c["moe_shared_expert_intermediate_size"] // moe_ffn(c),
          "first_k_dense_replace": layers.index(1),
          "n_group": groups or 1, "topk_group": c.get("moe_router_group_topk", 0) if groups else 1,
          "norm_topk_prob": topk > 1,
          "routed_scaling_factor": f32_value(c.get("moe_router_topk_scaling_factor", 1.0))}
    if arch == "glm4_moe":  # no multi-token-prediction layers in the export
        hf.update({"use_qk_norm": bool(c.get("qk_layernorm")),
                   "attention_bias": bool(c.get("add_qkv_bias")), "num_nextn_predict_layers": 0})
    return hf


# ---- tensor names ------------------------------------------------------------------------------

def expert_bias_specs(c):
    """[(name, shape, split_dim)] of the expert biases a braid config has (replicated, f32,
    not among the parameters)."""
    if not c.get("num_experts") or not c.get("moe_router_enable_expert_bias"):
        return []
    return [(f"model.layers.{i}.{BIAS}", [c["num_experts"]], -1)
            for i, e in enumerate(expert_layers(c)) if e]


def sigmoid_moe_tensors_to_braid(hf, c):
    """In `hf` (name -> Tensor): the shared experts to braid's name, the biases to f32 (exact).
    The experts: hf_moe.moe_tensors_to_braid."""
    if not c.get("num_experts"):  # a dense DeepSeek-V3
        return
    for i in [i for i, e in enumerate(expert_layers(c)) if e]:
        p = f"model.layers.{i}.mlp."
        for m in ("gate_proj", "up_proj", "down_proj"):
            name = f"{p}shared_experts.{m}.weight"
            if name in hf:
                hf[f"{p}shared_expert.{m}.weight"] = hf.pop(name)
        bias = hf.get(f"model.layers.{i}.{BIAS}")
        if bias is not None and bias.dtype != "F32":
            check(bias.dtype in ("BF16", "F16"), f"model.layers.{i}.{BIAS} is {bias.dtype}; "
                  "braid's expert biases are F32 (BF16 and F16 ones import exactly)")
            hf[f"model.layers.{i}.{BIAS}"] = as_f32_tensor(bias)


def drop_mtp_layers(tensors, hf, arch):
    """Removes from `tensors` GLM-4.5's and DeepSeek-V3's multi-token-prediction layers: the
    num_nextn_predict_layers layers after the last (model.layers.{L}.*, ...), which
    transformers' causal LM does not load either. Returns how many tensors it dropped."""
    if arch not in ("glm4_moe", "deepseek_v3"):
        return 0
    count = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1)) or 0
    first = hf["num_hidden_layers"]
    prefixes = tuple(f"model.layers.{j}." for j in range(first, first + count))
    names = [n for n in tensors if n.startswith(prefixes)] if prefixes else []
    for name in names:
        del tensors[name]
    return len(names)


def braid_sigmoid_moe_tensors_to_hf(t, c):
    """braid's tensors -> transformers' names (in place); biases of zero where braid's sigmoid
    router has none (transformers' always has them)."""
    if not c.get("num_experts"):  # a dense DeepSeek-V3
        return
    for i in [i for i, e in enumerate(expert_layers(c)) if e]:
        p = f"model.layers.{i}.mlp."
        for m in ("gate_proj", "up_proj", "down_proj"):
            t[f"{p}shared_experts.{m}.weight"] = t.pop(f"{p}shared_expert.{m}.weight")
        if not c.get("moe_router_enable_expert_bias"):
            t[f"model.layers.{i}.{BIAS}"] = Tensor("F32", np.zeros(c["num_experts"], "<f4"))


def as_f32_tensor(t):
    """A BF16 or F16 Tensor as F32 (exact)."""
    if t.dtype == "BF16":
        return Tensor("F32", (t.array.astype(np.uint32) << 16).view("<f4"))
    return Tensor("F32", np.ascontiguousarray(t.array, dtype="<f4"))
