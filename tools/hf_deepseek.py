"""DeepSeek-V3 (DeepseekV3ForCausalLM: multi-latent attention) and the mixtures of experts that
route as it does, between Hugging Face and braid (docs/convert_hf.md): dots1 (Dots1ForCausalLM:
Qwen3's attention) and GLM-4.5 (Glm4MoeForCausalLM: q, k, v biases, RoPE on a part of each head,
optional q/k norms); and DeepSeek-V2 (DeepseekV2ForCausalLM: V3's attention, a softmax router).
hf_configs.py holds their norms and dots1's and GLM-4.5's attention and RoPE; hf_moe.py the
expert tensors they share with the Qwens.

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

DeepSeek-V2 (DeepseekV2TopkRouter) is braid's pre-softmax router with a scaling factor and no
bias: p = softmax(x W^T) over all experts (f32); topk_method greedy takes the top k of p,
group_limited_greedy the top k among the topk_group best of n_group groups, a group scored by
its best p; the weights are p at the chosen, never renormalised (transformers 5 ignores
norm_topk_prob), times routed_scaling_factor. braid (Megatron) scores a group by the sum of its
best moe_router_topk / group_topk, so groups import only where that is 1. Its attention, norms,
YaRN, shared experts and dense first layers are DeepSeek-V3's (DeepseekV2Attention turns the
same interleaved pairs, as complex numbers).

Tensors: braid's names but for the shared expert (HF `mlp.shared_experts.*`, braid
`mlp.shared_expert.*`); `mlp.gate.e_score_correction_bias` [E] f32 is braid's expert bias
(GPTModel.expert_biases(), stored in the checkpoint under that name).

GLM-4.5's and DeepSeek-V3's checkpoints hold num_nextn_predict_layers multi-token-prediction
layers after the last, L: layer L + k - 1 is braid's MTP depth k (mtp_num_layers) under the same
names (enorm, hnorm, eh_proj [H, 2H], a layer with experts as the last, shared_head.norm), but
for its copies of embed_tokens and lm_head (embed_tokens, shared_head.head), which braid's depths
share with the model: import checks and drops them, export writes them.
"""

import json
import math

import numpy as np

from hf_configs import (DEEPSEEK_V2_MOE_KEYS, SIGMOID_MOE_KEYS, as_f32, braid_window, check,
                        f32_value, hf_architecture_or_none, refuse, rope_parameters_of,
                        yarn_attention_factor, yarn_mscale)
from hf_moe import expert_layers, moe_ffn
from safetensors_numpy import Tensor

SIGMOID_MOE_ARCHITECTURES = ("dots1", "glm4_moe", "deepseek_v3")
# with multi-latent attention
LATENT_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
# with ungated shared experts (mlp.shared_experts.*), first_k_dense_replace, f32 routers
DEEPSEEK_MOE_ARCHITECTURES = SIGMOID_MOE_ARCHITECTURES + ("deepseek_v2",)
ATTENTION = {"deepseek_v2": "DeepseekV2Attention", "deepseek_v3": "DeepseekV3Attention"}
CAUSAL_LM = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
# transformers' defaults, where config.json leaves a field out
DEFAULTS = {
    "dots1": {"first_k_dense_replace": 0, "norm_topk_prob": False},
    "glm4_moe": {"first_k_dense_replace": 1, "norm_topk_prob": True, "n_shared_experts": 1,
                 "n_routed_experts": 128, "num_experts_per_tok": 8},
    "deepseek_v3": {"first_k_dense_replace": 3, "norm_topk_prob": True, "n_shared_experts": 1,
                    "n_routed_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048, "n_group": 8, "topk_group": 4,
                    "routed_scaling_factor": 2.5},
    # transformers' DeepseekV2Config (num_experts_per_tok: none)
    "deepseek_v2": {"first_k_dense_replace": 0, "n_shared_experts": 2, "n_routed_experts": 64,
                    "moe_intermediate_size": 1407, "routed_scaling_factor": 1.0,
                    "topk_method": "greedy"},
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


def yarn_config_from_hf(hf, keep_truncate=False):
    """braid's YaRN fields for a DeepSeek-V3 or -V2 config.json whose RoPE is rope_type yarn, as
    transformers' _compute_yarn_parameters and DeepseekV3Attention (DeepseekV2Attention alike)
    compute it: the frequencies from factor, beta_fast, beta_slow (32 and 1 where absent or 0) and
    original_max_position_embeddings (max_position_embeddings where absent); cos and sin times
    attention_factor, or g(mscale) / g(mscale_all_dim) when both are set, else g(1); the softmax
    scale times g(mscale_all_dim)^2. braid (megatron-core, DeepSeek's own code) multiplies cos
    and sin by g(mscale) / g(mscale_all_dim), 1 and 0 where absent. ConvertError where the two
    differ (an attention_factor other than that ratio; one of mscale and mscale_all_dim without
    the other, but for mscale 1 alone) and for truncate false; with `keep_truncate` (GPT-OSS),
    truncate as braid's rope_yarn_truncate instead (false: the correction range unrounded)."""
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
    truncate = params.get("truncate", True)
    if keep_truncate:
        check(isinstance(truncate, bool), f"config.json: {field}.truncate should be true or "
              f"false, is {json.dumps(truncate)}")
    elif truncate is not True:
        refuse(f"{field}.truncate", params["truncate"], "transformers then blends the "
               "frequencies over the unrounded correction range; braid imports DeepSeek's YaRN "
               "as DeepSeek's code and megatron-core's MLA compute it, rounded (floor, ceil)")
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
            "rope_original_max_position_embeddings": int(original),
            **({"rope_yarn_truncate": truncate} if keep_truncate else {})}


def latent_attention_config_from_hf(hf, arch="deepseek_v3"):
    """braid's attention fields for a DeepSeek-V3 or -V2 config.json, in place of the Llama ones
    (a key and value head per query head, the latent norms); ConvertError for what braid's
    multi-latent attention does not compute as transformers' DeepseekV3Attention (or
    DeepseekV2Attention, which always turns interleaved pairs) does."""
    def get(field):
        return hf.get(field, LATENT_DEFAULTS.get(field))

    attention = ATTENTION[arch]
    if hf.get("attention_bias"):
        refuse("attention_bias", hf["attention_bias"], f"{attention} then has biases on "
               "q_a_proj, kv_a_proj_with_mqa and o_proj; braid's multi-latent attention has none")
    if arch == "deepseek_v2" and hf.get("mlp_bias"):  # (before Llama's attention_bias rule)
        refuse("mlp_bias", hf["mlp_bias"], "DeepseekV2MLP then has biases on the dense MLPs and "
               "the shared experts but not on the routed experts; braid's add_bias_linear gives "
               "every linear layer a bias or none")
    if arch == "deepseek_v3" and hf.get("rope_interleave", True) is not True:
        refuse("rope_interleave", hf["rope_interleave"], "transformers then turns the two halves "
               "of each head's RoPE channels against each other (rotate_half); braid's "
               "multi-latent attention turns interleaved pairs, as DeepSeek's checkpoints hold "
               "them")
    params, field = rope_parameters_of(hf)
    if params["rope_type"] not in ("default", "yarn"):
        refuse(f"{field}.rope_type", params["rope_type"], "braid's multi-latent attention turns "
               "plain RoPE or YaRN's (DeepSeek-V2's and -V3's)")
    yarn = yarn_config_from_hf(hf) if params["rope_type"] == "yarn" else {}
    eps = hf.get("rms_norm_eps", 1e-6)
    if as_f32(eps) != as_f32(LATENT_NORM_EPS):
        refuse("rms_norm_eps", eps, f"{attention}'s latent norms (q_a_layernorm, "
               f"kv_a_layernorm) use {LATENT_NORM_EPS} whatever rms_norm_eps says; braid's norms "
               "share one epsilon (norm_eps)")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or kv_heads < heads:
        refuse("num_key_value_heads", kv_heads, f"{attention} gives each of the {heads} "
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


def expert_layers_from_hf(hf, arch, get):
    """The fields of the expert layers of a dots1, GLM-4.5, DeepSeek-V3 or -V2 config.json
    (`get`: a field, or transformers' default) but the router's: the experts, their top k and
    width, routed_scaling_factor, the ungated shared expert, the first_k_dense_replace dense
    layers. None for a DeepSeek-V2 or -V3 whose first_k_dense_replace leaves no layer with
    experts: a dense model."""
    layers = hf["num_hidden_layers"]
    first = get("first_k_dense_replace")
    check(isinstance(first, int) and first >= 0, "config.json: first_k_dense_replace should be "
          f"a layer count, is {json.dumps(first)}")
    if first >= layers and arch in LATENT_ARCHITECTURES:
        return None  # transformers builds no router: the MoE fields say nothing
    if first >= layers:
        refuse("first_k_dense_replace", first, f"no layer of the {layers} has experts; braid's "
               "MoE models have them on one layer at least")
    experts = positive(hf.get("n_routed_experts", hf.get("num_local_experts",
                                                         get("n_routed_experts"))),
                       "n_routed_experts")
    topk = get("num_experts_per_tok")
    check(isinstance(topk, int) and 1 <= topk <= experts, "config.json: num_experts_per_tok "
          f"should be in [1, {experts}] (n_routed_experts), is {json.dumps(topk)}")
    ffn = positive(get("moe_intermediate_size"), "moe_intermediate_size")
    shared = positive(get("n_shared_experts"), "n_shared_experts")
    scale = get("routed_scaling_factor")
    check(isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0,
          f"config.json: routed_scaling_factor should be a positive number, is "
          f"{json.dumps(scale)}")
    return {"num_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": ffn,
            "moe_router_topk_scaling_factor": as_f32(scale),
            "moe_shared_expert_intermediate_size": shared * ffn,
            "moe_shared_expert_gate": False,
            "moe_layers": [int(i >= first) for i in range(layers)] if first else []}


def groups_from_hf(get, experts):
    """(n_group, topk_group) of a config.json, checked (1 where absent or null)."""
    groups = get("n_group") or 1
    group_topk = get("topk_group") or 1
    check(isinstance(groups, int) and groups >= 1 and experts % groups == 0, "config.json: "
          f"n_group should divide n_routed_experts {experts}, is {json.dumps(groups)}")
    check(isinstance(group_topk, int) and 1 <= group_topk <= groups, "config.json: topk_group "
          f"should be in [1, {groups}] (n_group), is {json.dumps(group_topk)}")
    return groups, group_topk


def sigmoid_moe_config_from_hf(hf, arch):
    """braid's MoE fields for a dots1, GLM-4.5 or DeepSeek-V3 config.json ({} for a DeepSeek-V3
    whose first_k_dense_replace leaves no layer with experts: a dense model); ConvertError for
    what braid's router cannot compute exactly."""
    defaults = {"moe_intermediate_size": 1408, "n_group": 1, "topk_group": 1,
                "routed_scaling_factor": 1.0, **DEFAULTS[arch]}

    def get(field):
        return hf.get(field, defaults.get(field))

    moe = expert_layers_from_hf(hf, arch, get)
    if moe is None:
        return {}
    topk = moe["moe_router_topk"]
    norm = get("norm_topk_prob")
    if topk > 1 and not norm:
        refuse("norm_topk_prob", norm, f"braid's sigmoid router (Megatron's) always divides the "
               f"weights of the top {topk} by their sum; this model weights each by its score "
               "alone")
    if topk == 1 and norm:
        refuse("norm_topk_prob", norm, "with one expert per token it makes every weight 1; "
               "braid's sigmoid router (Megatron's) weights the expert by its score")
    groups, group_topk = groups_from_hf(get, moe["num_experts"])
    if groups > 1 and (topk % group_topk or topk // group_topk != 2):
        refuse("n_group", groups, "transformers scores each group by the sum of its 2 best "
               "experts, braid (Megatron) by its best num_experts_per_tok / topk_group; "
               f"here num_experts_per_tok is {topk} and topk_group {group_topk}, so braid holds "
               "this only with num_experts_per_tok = 2 x topk_group")
    return {**moe, "moe_router_pre_softmax": False, "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": groups if groups > 1 else 0,
            "moe_router_group_topk": group_topk if groups > 1 else 0}


V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def softmax_moe_config_from_hf(hf):
    """braid's MoE fields for a DeepSeek-V2 config.json ({} where first_k_dense_replace leaves no
    layer with experts: a dense model): its router is braid's pre-softmax one with
    routed_scaling_factor and no bias; norm_topk_prob is not read (transformers' DeepseekV2 does
    not either). ConvertError for what braid's router cannot compute exactly."""
    defaults = DEFAULTS["deepseek_v2"]

    def get(field):
        return hf.get(field, defaults.get(field))

    moe = expert_layers_from_hf(hf, "deepseek_v2", get)
    if moe is None:
        return {}
    method = get("topk_method")
    if method not in V2_TOPK_METHODS:
        refuse("topk_method", method, "transformers' DeepseekV2TopkRouter computes greedy and "
               "group_limited_greedy" + ("; noaux_tc is DeepSeek-V3's sigmoid router, "
                                         "DeepseekV3ForCausalLM's" if method == "noaux_tc" else ""))
    if hf.get("scoring_func", "softmax") != "softmax":
        refuse("scoring_func", hf["scoring_func"], "DeepSeek-V2 routes by a softmax over the "
               "experts: transformers' DeepseekV2TopkRouter whatever this says, DeepSeek's own "
               "code no other")
    if hf.get("moe_layer_freq", 1) != 1:
        refuse("moe_layer_freq", hf["moe_layer_freq"], "DeepSeek's own code then has experts on "
               "every moe_layer_freq-th layer from first_k_dense_replace on, transformers' "
               "DeepseekV2ForCausalLM on every one")
    topk, groups, group_topk = moe["moe_router_topk"], 0, 0
    if method == "group_limited_greedy":
        check(hf.get("n_group") is not None and hf.get("topk_group") is not None, "config.json: "
              "topk_method group_limited_greedy needs n_group and topk_group")
        groups, group_topk = groups_from_hf(get, moe["num_experts"])
        if group_topk == groups:  # every group chosen: greedy
            groups = group_topk = 0
        elif topk != group_topk:
            refuse("topk_group", group_topk, "with topk_method group_limited_greedy transformers "
                   f"scores each of the n_group = {groups} groups by its best expert, braid "
                   "(Megatron) by the sum of its best num_experts_per_tok / topk_group = "
                   f"{topk} / {group_topk}: the two agree only where num_experts_per_tok = "
                   "topk_group")
    return {**moe, "moe_router_pre_softmax": True, "moe_router_score_function": "softmax",
            "moe_router_enable_expert_bias": False, "moe_router_num_groups": groups,
            "moe_router_group_topk": group_topk}


# ---- braid's config -> config.json ------------------------------------------------------------

def latent_attention_architecture(c, imported=None):
    """DeepSeek-V3 or -V2 for a braid config with multi-latent attention: V3 with experts routed
    by sigmoid scores (as sigmoid_moe_architecture checks), V2 with a softmax router (as
    softmax_moe_architecture checks), and with none (every layer dense: the same model) V2 where
    `imported`, the config an import stored, is V2's, else V3; ConvertError with why otherwise."""
    if c.get("num_experts"):
        arch = "deepseek_v3" if sigmoid_router(c) else "deepseek_v2"
    else:
        arch = ("deepseek_v2" if hf_architecture_or_none(imported or {}) == "deepseek_v2"
                else "deepseek_v3")
    what, name = "this braid model has multi-latent attention", CAUSAL_LM[arch]
    kind = (c["normalization"], c["activation"], c["position_embedding"])
    check(kind == ("rmsnorm", "swiglu", "rope"), what, " and is ", "/".join(kind), " shaped; ",
          name, " is rmsnorm/swiglu/rope")
    check(c.get("qk_layernorm"), what, " without its latent norms (qk_layernorm); ", name,
          " always norms them (q_a_layernorm, kv_a_layernorm)")
    check(braid_window(c) is None, what, " and a sliding window; ", name, " has none")
    check(not c.get("rope_scaling_factor"), what, " and Llama 3.1's RoPE scaling; ", name,
          " turns plain RoPE or YaRN's (rope_type yarn)")
    check(as_f32(c["norm_eps"]) == as_f32(LATENT_NORM_EPS), what, " and norm_eps ",
          f32_value(c["norm_eps"]), f"; {name}'s latent norms use {LATENT_NORM_EPS} "
          "whatever rms_norm_eps says (train with --norm-epsilon 1e-6)")
    if c.get("num_experts"):  # the routing's checks
        (sigmoid_moe_architecture if arch == "deepseek_v3" else softmax_moe_architecture)(c)
    return arch


def hf_latent_attention_config(c, imported, arch="deepseek_v3"):
    """The attention fields of DeepSeek-V3's or -V2's config.json for a braid config with
    multi-latent attention; for a dense one first_k_dense_replace = num_hidden_layers, with the
    MoE fields (which then build nothing) of the config an import stored."""
    dn, dr = c["qk_head_dim"], c["qk_pos_emb_head_dim"]
    hf = {"q_lora_rank": c["q_lora_rank"] or None, "kv_lora_rank": c["kv_lora_rank"],
          "qk_nope_head_dim": dn, "qk_rope_head_dim": dr, "v_head_dim": c["v_head_dim"],
          "qk_head_dim": dn + dr, "head_dim": dr,  # as transformers derives them
          "num_key_value_heads": c["num_attention_heads"], "attention_bias": False}
    if arch == "deepseek_v3":  # V2 always turns interleaved pairs, and has no MTP layers
        hf.update({"rope_interleave": True,
                   "num_nextn_predict_layers": c.get("mtp_num_layers", 0)})
    if not c.get("num_experts"):
        if (imported or {}).get("model_type") == arch:
            keys = SIGMOID_MOE_KEYS if arch == "deepseek_v3" else DEEPSEEK_V2_MOE_KEYS
            hf.update({k: imported[k] for k in keys if k in imported})
        hf["first_k_dense_replace"] = c["num_layers"]
    return hf


def check_shared_expert_and_layers(c, what, names):
    """An ungated shared expert whose width is a multiple of the experts', and the dense layers
    first (first_k_dense_replace), as `names` (the HF models) need them; ConvertError with why
    otherwise."""
    shared, ffn = c.get("moe_shared_expert_intermediate_size", 0), moe_ffn(c)
    check(shared, what, f" but has no shared expert; {names} always add one (n_shared_experts)")
    check(not c.get("moe_shared_expert_gate"), what, f" and gates its shared expert; {names} "
          "add it ungated")
    check(shared % ffn == 0, what, f" and its shared expert is {shared} wide, not a multiple of "
          f"the experts' {ffn}; transformers builds n_shared_experts x moe_intermediate_size")
    layers = expert_layers(c)
    check(1 in layers, what, " but no layer has experts (moe_layers)")
    first = layers.index(1)
    check(layers == [0] * first + [1] * (len(layers) - first), what, " and dense layers after "
          f"expert ones (moe_layers {layers}); {names} have them first (first_k_dense_replace)")


def sigmoid_moe_architecture(c):
    """dots1 or GLM-4.5 for a braid config with a sigmoid router: dots1 with q/k norms, no
    biases and RoPE on whole heads (any window pattern) but for a model with multi-token
    prediction and no window, else GLM-4.5 (q, k, v biases or none, q/k norms or none, any
    rotary_percent, no window); ConvertError with why otherwise."""
    what = "this braid model routes by sigmoid scores"
    kind = (c["normalization"], c["activation"], c["position_embedding"])
    check(kind == ("rmsnorm", "swiglu", "rope"), what, " and is ", "/".join(kind), " shaped; "
          "Dots1ForCausalLM and Glm4MoeForCausalLM are rmsnorm/swiglu/rope")
    check(not c["add_bias_linear"], what, " and has biases on every linear layer; "
          "Glm4MoeForCausalLM has them on q, k and v alone, Dots1ForCausalLM's MLPs have none")
    check_shared_expert_and_layers(c, what, "Dots1ForCausalLM and Glm4MoeForCausalLM")
    groups, topk = c.get("moe_router_num_groups", 0), c["moe_router_topk"]
    group_topk = c.get("moe_router_group_topk", 0)
    check(groups <= 1 or topk == 2 * group_topk, what, f" in {groups} groups, each scored by its "
          f"best moe_router_topk / group_topk = {topk} / {group_topk}; transformers scores a "
          "group by its best 2")
    if c.get("qk_layernorm") and not c.get("add_qkv_bias") and c.get("rotary_percent", 1.0) == 1 \
            and not (c.get("mtp_num_layers") and braid_window(c) is None):
        return "dots1"  # (with MTP depths GLM-4.5, which has MTP layers, where it can)
    check(braid_window(c) is None, what, " and has a sliding window but ",
          "q, k, v biases" if c.get("add_qkv_bias") else
          "RoPE on a part of each head" if c.get("rotary_percent", 1.0) != 1 else
          "no q/k norms", "; Glm4MoeForCausalLM has no window, Dots1ForCausalLM (q/k norms, "
          "RoPE on whole heads) no biases")
    return "glm4_moe"


def v2_groups(c):
    """(n_group, topk_group) of a braid config's groups where they change the choice (some group
    left out), else None."""
    groups, group_topk = c.get("moe_router_num_groups", 0), c.get("moe_router_group_topk", 0)
    return (groups, group_topk) if 1 < groups and group_topk < groups else None


def softmax_moe_architecture(c):
    """The routing checks of DeepSeek-V2 for a braid config with multi-latent attention and a
    softmax router: the top k of a softmax over all experts (moe_router_pre_softmax), no biases,
    an ungated shared expert, the dense layers first, groups scored by their best expert;
    ConvertError with why otherwise."""
    what = "this braid model has multi-latent attention and a softmax router"
    check(c.get("moe_router_pre_softmax"), what, " over the top k logits "
          "(moe_router_pre_softmax false); DeepseekV2ForCausalLM takes the top k of a softmax "
          "over all experts (--moe-router-pre-softmax), DeepseekV3ForCausalLM routes by sigmoid "
          "scores with an expert bias (--moe-router-score-function sigmoid)")
    check(not c["add_bias_linear"], what, " and biases on every linear layer; "
          "DeepseekV2ForCausalLM has none")
    check_shared_expert_and_layers(c, what, "DeepseekV2ForCausalLM")
    topk, groups = c["moe_router_topk"], v2_groups(c)
    check(groups is None or groups[1] == topk, what, f" in {groups and groups[0]} groups, each "
          "scored by the sum of its best moe_router_topk / group_topk = "
          f"{topk} / {groups and groups[1]}; DeepseekV2ForCausalLM (topk_method "
          "group_limited_greedy) scores a group by its best expert")


def hf_softmax_moe_config(c):
    """The MoE fields of DeepSeek-V2's config.json for a braid config with a softmax router."""
    groups = v2_groups(c)
    hf = {"n_routed_experts": c["num_experts"], "num_experts_per_tok": c["moe_router_topk"],
          "moe_intermediate_size": moe_ffn(c),
          "n_shared_experts": c["moe_shared_expert_intermediate_size"] // moe_ffn(c),
          "first_k_dense_replace": expert_layers(c).index(1),
          "topk_method": "group_limited_greedy" if groups else "greedy",
          # transformers ignores it; DeepSeek's own code would renormalise the top k
          "norm_topk_prob": False,
          "routed_scaling_factor": f32_value(c.get("moe_router_topk_scaling_factor", 1.0))}
    if groups:
        hf.update({"n_group": groups[0], "topk_group": groups[1]})
    return hf


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
    if arch == "glm4_moe":
        hf.update({"use_qk_norm": bool(c.get("qk_layernorm")),
                   "attention_bias": bool(c.get("add_qkv_bias")),
                   "num_nextn_predict_layers": c.get("mtp_num_layers", 0)})
    return hf


# ---- tensor names ------------------------------------------------------------------------------

def expert_bias_specs(c):
    """[(name, shape, split_dim)] of the expert biases a braid config has (replicated, f32,
    not among the parameters)."""
    if not c.get("moe_router_enable_expert_bias"):
        return []
    return [(f"model.layers.{i}.{BIAS}", [c["num_experts"]], -1) for i in layers_with_experts(c)]


def layers_with_experts(c):
    """The layers of a braid config that have experts (moe_layers), then its multi-token-
    prediction depths (layers num_layers + k - 1) where its last layer has them: braid builds
    each depth as its last layer (TransformerConfig::kind_of_layer)."""
    if not c.get("num_experts"):
        return []
    kinds = expert_layers(c)
    return [i for i, e in enumerate(kinds + kinds[-1:] * c.get("mtp_num_layers", 0)) if e]


def deepseek_moe_tensors_to_braid(hf, c):
    """In `hf` (name -> Tensor) of a DEEPSEEK_MOE_ARCHITECTURES model: the shared experts to
    braid's name, the biases to f32 (exact). The experts: hf_moe.moe_tensors_to_braid."""
    for i in layers_with_experts(c):  # (none in a dense DeepSeek-V3 or -V2)
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


def braid_deepseek_moe_tensors_to_hf(t, c):
    """braid's tensors -> transformers' names (in place) for a DEEPSEEK_MOE_ARCHITECTURES model;
    biases of zero where braid's sigmoid router has none (transformers' always has them;
    DeepSeek-V2's softmax router never)."""
    for i in layers_with_experts(c):  # (none in a dense DeepSeek-V3 or -V2)
        p = f"model.layers.{i}.mlp."
        for m in ("gate_proj", "up_proj", "down_proj"):
            t[f"{p}shared_experts.{m}.weight"] = t.pop(f"{p}shared_expert.{m}.weight")
        if sigmoid_router(c) and not c.get("moe_router_enable_expert_bias"):
            t[f"model.layers.{i}.{BIAS}"] = Tensor("F32", np.zeros(c["num_experts"], "<f4"))


def as_f32_tensor(t):
    """A BF16 or F16 Tensor as F32 (exact)."""
    if t.dtype == "BF16":
        return Tensor("F32", (t.array.astype(np.uint32) << 16).view("<f4"))
    return Tensor("F32", np.ascontiguousarray(t.array, dtype="<f4"))


# ---- multi-token prediction (DeepSeek-V3's and GLM-4.5's MTP layers) --------------------------

MTP_ARCHITECTURES = ("glm4_moe", "deepseek_v3")
# What each MTP layer of DeepSeek's and GLM's checkpoints holds besides braid's depth: copies of
# the model's embedding and output head, which braid's depths share.
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def hf_mtp_count(hf):
    """num_nextn_predict_layers of a GLM-4.5 or DeepSeek-V3 config.json (transformers 5 reads
    num_mtp_layers alike): 1 where both are absent, as transformers defaults it; 0 for null."""
    count = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1)) or 0
    check(isinstance(count, int) and count >= 0, "config.json: num_nextn_predict_layers should "
          f"be a layer count, is {json.dumps(count)}")
    return count


def same_bits(a, b):
    """Whether two Tensors hold the same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a.array).reshape(-1).view(np.uint8),
        np.ascontiguousarray(b.array).reshape(-1).view(np.uint8))


def take_mtp_layers(tensors, hf, arch, keep=True):
    """The multi-token-prediction layers of a GLM-4.5 or DeepSeek-V3 checkpoint in `tensors`:
    the num_nextn_predict_layers layers after the last (model.layers.{L}.*, ...), which
    transformers' causal LM does not load and its save_pretrained does not write. Where `keep`
    and `tensors` hold them, removes each layer's copies of the embedding and the output head
    (MTP_COPIES), checked bit for bit against the model's, and leaves the rest, braid's depths;
    else removes them all. Returns how many depths it left: braid's mtp_num_layers."""
    if arch not in MTP_ARCHITECTURES:
        return 0
    first, count = hf["num_hidden_layers"], hf_mtp_count(hf)
    held = {j: [n for n in tensors if n.startswith(f"model.layers.{j}.")]
            for j in range(first, first + count)}
    if not keep or not any(held.values()):
        for name in [n for names in held.values() for n in names]:
            del tensors[name]
        return 0
    head = ("model.embed_tokens.weight" if hf.get("tie_word_embeddings", False) else
            "lm_head.weight")
    for j, names in held.items():
        check(names, f"config.json: num_nextn_predict_layers is {count} but the weights hold "
              f"model.layers.{first}.* and no model.layers.{j}.*; import with --no-mtp to leave "
              "the multi-token-prediction layers out")
        for copy, of in zip(MTP_COPIES, ("model.embed_tokens.weight", head)):
            name = f"model.layers.{j}.{copy}"
            if name in tensors and of in tensors:  # (a missing `of` is refused with the model's)
                check(same_bits(tensors[name], tensors[of]), f"{name} differs from {of}; "
                      "braid's multi-token-prediction depths share the model's embedding and "
                      "output head: import with --no-mtp to leave the MTP layers out")
            tensors.pop(name, None)
    return count


def mtp_config_from_hf(hf, config, depths):
    """braid's MTP fields for `depths` (take_mtp_layers) MTP layers of a config.json whose braid
    config is `config`; ConvertError where braid's depths would differ from them."""
    if not depths:
        return {}
    if not config.get("num_experts"):  # a DeepSeek-V3 of dense layers (GLM-4.5: refused before)
        refuse("first_k_dense_replace", hf.get("first_k_dense_replace"), "every layer is dense "
               "but the multi-token-prediction layers have experts, as transformers, vLLM and "
               "DeepSeek's code build them; braid builds each MTP depth as the last layer: "
               "import with --no-mtp to leave them out")
    return {"mtp_num_layers": depths}


def check_mtp_export(c, arch):
    """ConvertError where `arch` cannot hold a braid config's MTP depths (mtp_num_layers) as
    braid computes them."""
    depths = c.get("mtp_num_layers", 0)
    if not depths:
        return
    what = (f"this braid model has {depths} multi-token-prediction "
            f"depth{'s' if depths > 1 else ''} (mtp_num_layers)")
    check(arch in MTP_ARCHITECTURES, what, f" and exports as {arch}, which has none (DeepSeek-V3 "
          "and GLM-4.5 do): export with --no-mtp to leave them out")
    check(c.get("num_experts"), what, " and no experts; DeepSeek-V3's readers (transformers, "
          "vLLM, DeepSeek's code) build its MTP layers with experts, braid as the last layer: "
          "export with --no-mtp to leave them out")


def without_mtp(tensors, c):
    """(`tensors` less the MTP depths' (model.layers.{num_layers + k - 1}.*), `c` with
    mtp_num_layers 0): the model without multi-token prediction."""
    first, depths = c["num_layers"], c.get("mtp_num_layers", 0)
    prefixes = tuple(f"model.layers.{j}." for j in range(first, first + depths))
    return ({n: t for n, t in tensors.items() if not prefixes or not n.startswith(prefixes)},
            dict(c, mtp_num_layers=0))


def braid_mtp_copies_to_hf(t, c):
    """Adds to `t` (HF names) the copies of the embedding and the output head each MTP layer of
    DeepSeek's and GLM's checkpoints carries (MTP_COPIES), as they hold them."""
    head = t["model.embed_tokens.weight" if c["tie_embeddings"] else "lm_head.weight"]
    for j in range(c["num_layers"], c["num_layers"] + c.get("mtp_num_layers", 0)):
        t[f"model.layers.{j}.{MTP_COPIES[0]}"] = t["model.embed_tokens.weight"]
        t[f"model.layers.{j}.{MTP_COPIES[1]}"] = head
