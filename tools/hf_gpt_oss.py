"""GPT-OSS (GptOssForCausalLM, model_type gpt_oss: openai/gpt-oss-20b and -120b) between Hugging
Face and braid (docs/convert_hf.md), and the MXFP4 experts of its released checkpoints.
hf_configs.py holds the RoPE fields it shares with Llama, hf_deepseek.py its YaRN.

GPT-OSS is Llama's RMSNorms and grouped-query attention with biases on q, k, v and o, one learned
sink logit per head (self_attn.sinks: each row's softmax runs over its scores and the sink, which
weighs no value; braid's softmax_type learnable) and experts on every layer. The router
(mlp.router, with a bias) takes the top k of its logits and weighs them by a softmax over those
(braid's softmax router without moe_router_pre_softmax, with add_bias_linear's bias). An expert is
a gated quick GELU with biases: with g = min(gate, L) and u = clamp(up, -L, L),
(u + 1) g sigmoid(1.702 g) (braid's activation quick_geglu, glu_linear_offset 1, activation_clamp
L = swiglu_limit). RoPE is YaRN (truncate false: the correction range left unrounded, braid's
rope_yarn_truncate), the windows Mistral's on the layers layer_types names sliding_attention.

Tensors have braid's names but for the router (HF mlp.router.{weight,bias}, braid mlp.gate.*) and
the experts, which transformers holds, and save_pretrained writes, fused per layer:
  mlp.experts.gate_up_proj [E, H, 2F]: x @ gate_up_proj[j] is expert j's gate in the even columns
      and its up projection in the odd ones (braid's gate_proj.weight [F, H] is
      gate_up_proj[j][:, 0::2] transposed, up_proj.weight gate_up_proj[j][:, 1::2] transposed);
  mlp.experts.gate_up_proj_bias [E, 2F], interleaved alike;
  mlp.experts.down_proj [E, F, H] (braid's down_proj.weight [H, F] is down_proj[j] transposed);
  mlp.experts.down_proj_bias [E, H].

openai's checkpoints store gate_up_proj and down_proj in MXFP4 (quantization_config quant_method
mxfp4) as the transposed matrix M [E, R, C] (R = 2F, C = H for gate_up_proj; R = H, C = F for
down_proj) in blocks of 32 along C: X_blocks [E, R, C / 32, 16] uint8 holds two E2M1 values a byte
(the low nibble first), X_scales [E, R, C / 32] uint8 a block's power of two, 2^(scale - 127).
Import dequantizes them (dequantize_mxfp4_experts), exactly: each value is an E2M1 value times a
power of two.
"""

import json
import re

import numpy as np

from hf_configs import (LLAMA_KEYS, ConvertError, as_f32, braid_window, check, f32_value,
                        head_width, hf_architecture_or_none, hf_rope_parameters, refuse, rope_of,
                        rope_parameters_of)
from hf_deepseek import yarn_config_from_hf
from hf_moe import expert_layers, moe_ffn
from safetensors_numpy import Tensor

QUICK_GELU_ALPHA = 1.702  # braid's (Megatron's quick_gelu's) sigmoid gain, HF's swiglu_alpha
GLU_OFFSET = 1.0  # GptOssExperts' (up + 1)
# transformers' GptOssConfig defaults, where config.json leaves a field out
DEFAULTS = {"num_local_experts": 128, "num_experts_per_tok": 4, "intermediate_size": 2880,
            "head_dim": 64, "sliding_window": 128, "swiglu_alpha": QUICK_GELU_ALPHA,
            "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "attention_bias": True}
# GptOssConfig's RoPE when config.json has none: YaRN with an unrounded correction range.
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
# E2M1 (FP4): sign, 2 exponent bits, 1 mantissa bit, by nibble value
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
MXFP4_BLOCK = 32  # values sharing one scale
MXFP4_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_blocks$")


def get(hf, field):
    """config.json's `field`, or transformers' default where it is left out; head_dim null is
    hidden_size / num_attention_heads (GptOssConfig's __post_init__)."""
    value = hf.get(field, DEFAULTS[field])
    if field == "head_dim" and value is None:
        return hf["hidden_size"] // hf["num_attention_heads"]
    return value


# ---- config.json -> braid's config -------------------------------------------------------------

def gpt_oss_window(hf, layers):
    """braid's window_size and window_layers: sliding_window S (HF counts the query's own position)
    is window_size S - 1 on the layers layer_types names sliding_attention (the even ones where
    it is left out, as transformers fills it in)."""
    kinds = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(layers)]
    check(isinstance(kinds, list) and len(kinds) == layers, "config.json: layer_types has "
          f"{len(kinds) if isinstance(kinds, list) else kinds!r} entries for num_hidden_layers "
          f"{layers}")
    other = [k for k in kinds if k not in ("full_attention", "sliding_attention")]
    if other:
        refuse("layer_types", other[0], "braid's layers attend to all of the context or to a "
               "sliding window")
    if "sliding_attention" not in kinds:
        return {"window_size": -1, "window_layers": []}
    window = get(hf, "sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        refuse("sliding_window", window, "layer_types has sliding_attention layers, whose window "
               "must be a positive number of positions")
    pattern = [int(k == "sliding_attention") for k in kinds]
    return {"window_size": window - 1, "window_layers": [] if all(pattern) else pattern}


def gpt_oss_config_from_hf(hf, dtype):
    """braid's config for a GPT-OSS config.json (transformers' defaults where a field is left
    out); ConvertError for what braid does not compute as GptOssForCausalLM does."""
    hf = {"num_key_value_heads": 8, **hf}  # GptOssConfig's default (None: one per head)
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
        hf["rope_parameters"] = dict(DEFAULT_ROPE)
    alpha, limit = get(hf, "swiglu_alpha"), get(hf, "swiglu_limit")
    if alpha != QUICK_GELU_ALPHA:
        refuse("swiglu_alpha", alpha, "braid's quick_geglu (Megatron's quick_gelu) is g "
               f"sigmoid({QUICK_GELU_ALPHA} g)")
    if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not limit > 0:
        refuse("swiglu_limit", limit, "GptOssExperts clamps the gate to at most swiglu_limit and "
               "the up projection to [-swiglu_limit, swiglu_limit]; braid's activation_clamp is "
               "that limit, positive")
    if not get(hf, "attention_bias"):
        refuse("attention_bias", hf["attention_bias"], "the router and experts of "
               "GptOssForCausalLM always have biases; braid's add_bias_linear gives every linear "
               "layer a bias or none")
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    experts = hf.get("num_local_experts", hf.get("num_experts", DEFAULTS["num_local_experts"]))
    topk, ffn = get(hf, "num_experts_per_tok"), get(hf, "intermediate_size")
    check(isinstance(experts, int) and experts >= 1, "config.json: num_local_experts should be a "
          f"positive integer, is {experts!r}")
    check(isinstance(topk, int) and 1 <= topk <= experts, "config.json: num_experts_per_tok "
          f"should be in [1, {experts}] (num_local_experts), is {topk!r}")
    check(isinstance(ffn, int) and ffn >= 1, "config.json: intermediate_size should be a "
          f"positive integer, is {ffn!r}")
    rope = rope_of(hf, "gpt_oss")
    if rope_parameters_of(hf)[0]["rope_type"] == "yarn":
        rope.update(yarn_config_from_hf(hf, keep_truncate=True))
    return {**gpt_oss_window(hf, layers), "num_layers": layers,
            "hidden_size": hf["hidden_size"], "num_attention_heads": heads,
            "num_query_groups": hf.get("num_key_value_heads") or heads,
            "kv_channels": get(hf, "head_dim"), "ffn_hidden_size": ffn,
            "vocab_size": hf["vocab_size"],
            "max_position_embeddings": hf["max_position_embeddings"],
            "normalization": "rmsnorm", "activation": "quick_geglu", "position_embedding": "rope",
            "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False,
            "zero_centered_gamma": False, "softmax_type": "learnable",
            "glu_linear_offset": GLU_OFFSET, "activation_clamp": as_f32(limit),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), **rope,
            "norm_eps": as_f32(get(hf, "rms_norm_eps")), "params_dtype": dtype,
            "num_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": ffn,
            "moe_router_pre_softmax": False, "moe_layers": []}


# ---- braid's config -> config.json --------------------------------------------------------------

def gpt_oss_architecture(c):
    """'gpt_oss' for a braid config GptOssForCausalLM computes (attention sinks, learned or fixed
    at 0, the quick GEGLU with offset 1 and a clamp, biases everywhere, experts on every layer
    routed by a softmax over the top k logits); ConvertError with why otherwise."""
    what = "this braid model has " + ("attention sinks" if c.get("softmax_type", "vanilla") !=
                                      "vanilla" else "the quick GEGLU")
    kind = (c["normalization"], c["activation"], c["position_embedding"])
    check(kind == ("rmsnorm", "quick_geglu", "rope"), what, " and is ", "/".join(kind),
          " shaped; GptOssForCausalLM is rmsnorm/quick_geglu/rope")
    check(c.get("softmax_type", "vanilla") != "vanilla", what, " and the usual softmax; "
          "GptOssForCausalLM's attention has sinks (softmax_type learnable, or off-by-one: sinks "
          "of 0)")
    check(c.get("glu_linear_offset", 0.0) == GLU_OFFSET, what, " with glu_linear_offset ",
          c.get("glu_linear_offset", 0.0), "; GptOssExperts computes act(gate) (up + 1)")
    check(c.get("activation_clamp", 0.0) > 0, what, " without a clamp (activation_clamp 0); "
          "GptOssExperts always clamps (swiglu_limit)")
    check(c["add_bias_linear"] and not c.get("qk_layernorm"), what, " and ",
          "q/k norms" if c.get("qk_layernorm") else "no biases (add_bias_linear)",
          "; GptOssForCausalLM has biases on every linear layer and no q/k norms")
    check(c.get("rotary_percent", 1.0) == 1.0, what, " and RoPE on a part of each head; "
          "GptOssForCausalLM turns whole heads")
    check(c.get("num_experts"), what, " and no experts; GptOssForCausalLM's MLPs are mixtures "
          "of experts")
    check(all(expert_layers(c)), what, " and dense layers (moe_layers); GptOssForCausalLM has "
          "experts on every layer")
    check(not c.get("moe_shared_expert_intermediate_size"), what, " and a shared expert; "
          "GptOssForCausalLM has none")
    router = "softmax over the top k logits, without groups, scaling, expert bias or capacity"
    check(c.get("moe_router_score_function", "softmax") == "softmax" and
          not c.get("moe_router_pre_softmax") and not c.get("moe_router_num_groups") and
          c.get("moe_router_topk_scaling_factor", 1.0) == 1.0 and
          not c.get("moe_router_enable_expert_bias") and
          not c.get("moe_expert_capacity_factor"), what, " and another router; "
          f"GptOssForCausalLM's is a {router}")
    return "gpt_oss"


# the HF fields export sets from braid's config; the rest may come from the import (not its
# quantization_config: the export's experts are dequantized)
GPT_OSS_KEYS = LLAMA_KEYS + ("head_dim", "attention_bias", "num_local_experts", "num_experts",
                             "num_experts_per_tok", "experts_per_token", "swiglu_alpha",
                             "swiglu_limit", "sliding_window", "layer_types",
                             "quantization_config", "dtype")


def gpt_oss_rope(c):
    """rope_parameters of a GPT-OSS export: YaRN's without mscale keys where braid's are (1, 0),
    transformers' own rule then (g(factor)), with truncate."""
    rope = hf_rope_parameters(c, "gpt_oss")
    if rope["rope_type"] == "yarn":
        if (rope["mscale"], rope["mscale_all_dim"]) == (1.0, 0.0):
            del rope["mscale"], rope["mscale_all_dim"]
        rope["truncate"] = bool(c.get("rope_yarn_truncate", True))
    return rope


def hf_gpt_oss_config(c, torch_dtype, imported):
    """GPT-OSS's config.json for a braid config (gpt_oss_architecture's), over the fields of the
    import's config braid does not keep (token ids, router_aux_loss_coef, ...)."""
    rope, window = gpt_oss_rope(c), braid_window(c)
    pattern = window[1] if window else [0] * c["num_layers"]
    same = imported and hf_architecture_or_none(imported) == "gpt_oss"
    unused = imported.get("sliding_window") if same else None  # no layer slides: an import's
    hf = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
          "hidden_size": c["hidden_size"], "intermediate_size": moe_ffn(c),
          "num_hidden_layers": c["num_layers"], "num_attention_heads": c["num_attention_heads"],
          "num_key_value_heads": c["num_query_groups"], "head_dim": head_width(c),
          "vocab_size": c["vocab_size"], "max_position_embeddings": c["max_position_embeddings"],
          "rms_norm_eps": f32_value(c["norm_eps"]), "rope_theta": rope["rope_theta"],
          "rope_parameters": rope, "hidden_act": "silu", "attention_bias": True,
          "tie_word_embeddings": c["tie_embeddings"], "num_local_experts": c["num_experts"],
          "num_experts_per_tok": c["moe_router_topk"], "swiglu_alpha": QUICK_GELU_ALPHA,
          "swiglu_limit": f32_value(c["activation_clamp"]),
          "sliding_window": window[0] + 1 if window else unused,
          "layer_types": ["sliding_attention" if w else "full_attention" for w in pattern],
          "torch_dtype": torch_dtype}
    if rope["rope_type"] != "default":  # transformers 4 reads the scaling from rope_scaling
        hf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if same:
        merged = {k: v for k, v in imported.items() if k not in GPT_OSS_KEYS}
        merged.update(hf)
        hf = merged
    return hf


# ---- tensors ------------------------------------------------------------------------------------

def gpt_oss_tensors_to_braid(hf, c):
    """Renames, in `hf` (name -> Tensor), each layer's router to braid's and splits its fused
    experts into braid's per-expert tensors (the module docstring's layout)."""
    e_count, f, h = c["num_experts"], moe_ffn(c), c["hidden_size"]
    for i in range(c["num_layers"]):
        p = f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            if p + "router." + kind in hf:
                hf[p + "gate." + kind] = hf.pop(p + "router." + kind)
        fused = {}
        for name, shape in (("gate_up_proj", [e_count, h, 2 * f]), ("gate_up_proj_bias",
                                                                     [e_count, 2 * f]),
                            ("down_proj", [e_count, f, h]), ("down_proj_bias", [e_count, h])):
            full = p + "experts." + name
            check(full in hf, f"the HF weights have no {full}")
            fused[name] = t = hf.pop(full)
            check(t.shape == shape, f"{full} is {t.shape}, config.json makes it {shape}")
        gate_up, gate_up_bias = fused["gate_up_proj"], fused["gate_up_proj_bias"]
        down, down_bias = fused["down_proj"], fused["down_proj_bias"]
        for j in range(e_count):
            x = f"{p}experts.{j}."
            hf[x + "gate_proj.weight"] = gate_up.like(gate_up.array[j][:, 0::2].T)
            hf[x + "up_proj.weight"] = gate_up.like(gate_up.array[j][:, 1::2].T)
            hf[x + "gate_proj.bias"] = gate_up_bias.like(gate_up_bias.array[j, 0::2])
            hf[x + "up_proj.bias"] = gate_up_bias.like(gate_up_bias.array[j, 1::2])
            hf[x + "down_proj.weight"] = down.like(down.array[j].T)
            hf[x + "down_proj.bias"] = down_bias.like(down_bias.array[j])


def _common_dtype(parts, name):
    """The one dtype of the tensors fused into one of GPT-OSS's."""
    check(len({t.dtype for t in parts}) == 1, f"the experts' {name} differ in dtype; "
          "GptOssForCausalLM holds them in one tensor")
    return parts[0].dtype


def braid_gpt_oss_tensors_to_hf(t, c):
    """braid's tensors -> GPT-OSS's names and fused experts (in place); sinks of 0 for braid's
    off-by-one softmax (transformers' are always parameters)."""
    e_count = c["num_experts"]
    for i in range(c["num_layers"]):
        p = f"model.layers.{i}."
        if c.get("softmax_type") == "off-by-one":
            w = t[p + "self_attn.q_proj.weight"]
            t[p + "self_attn.sinks"] = w.like(np.zeros(c["num_attention_heads"], w.array.dtype))
        for kind in ("weight", "bias"):
            t[p + "mlp.router." + kind] = t.pop(p + "mlp.gate." + kind)
        experts = [{n: t.pop(f"{p}mlp.experts.{j}.{n}") for n in (
            "gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias",
            "down_proj.weight", "down_proj.bias")} for j in range(e_count)]
        gate_up = np.stack([np.stack([e["gate_proj.weight"].array.T, e["up_proj.weight"].array.T],
                                     axis=-1).reshape(c["hidden_size"], -1) for e in experts])
        gate_up_bias = np.stack([np.stack([e["gate_proj.bias"].array, e["up_proj.bias"].array],
                                          axis=-1).reshape(-1) for e in experts])
        x = p + "mlp.experts."
        t[x + "gate_up_proj"] = Tensor(_common_dtype(
            [e[n] for e in experts for n in ("gate_proj.weight", "up_proj.weight")],
            "gate_proj and up_proj weights"), np.ascontiguousarray(gate_up))
        t[x + "gate_up_proj_bias"] = Tensor(_common_dtype(
            [e[n] for e in experts for n in ("gate_proj.bias", "up_proj.bias")],
            "gate_proj and up_proj biases"), np.ascontiguousarray(gate_up_bias))
        t[x + "down_proj"] = Tensor(
            _common_dtype([e["down_proj.weight"] for e in experts], "down_proj weights"),
            np.ascontiguousarray(np.stack([e["down_proj.weight"].array.T for e in experts])))
        t[x + "down_proj_bias"] = Tensor(
            _common_dtype([e["down_proj.bias"] for e in experts], "down_proj biases"),
            np.stack([e["down_proj.bias"].array for e in experts]))


# ---- MXFP4 -------------------------------------------------------------------------------------

def is_mxfp4(quantization_config):
    return isinstance(quantization_config, dict) and \
        quantization_config.get("quant_method") == "mxfp4"


def mxfp4_dequantize(blocks, scales):
    """The f32 values of MXFP4 `blocks` [..., G, 16] (uint8: two E2M1 values a byte, the low
    nibble first) and `scales` [..., G] (uint8: each block's 2^(scale - 127)): [..., G * 32]."""
    check(blocks.shape[-1] == MXFP4_BLOCK // 2 and blocks.shape[:-1] == scales.shape,
          f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair (a "
          f"block is {MXFP4_BLOCK // 2} bytes, one scale each)")
    values = np.empty(blocks.shape[:-1] + (MXFP4_BLOCK,), dtype=np.float32)
    values[..., 0::2] = E2M1[blocks & 0x0F]
    values[..., 1::2] = E2M1[blocks >> 4]
    with np.errstate(over="ignore"):
        values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(blocks.shape[:-2] + (-1,))


def as_dtype(values, dtype, name):
    """f32 `values` as a Tensor of safetensors `dtype` (F32, BF16, F16), exactly."""
    if dtype == "F32":
        return Tensor("F32", values)
    if dtype == "BF16":
        bits = values.view(np.uint32)
        check(not (bits & 0xFFFF).any(), f"internal: {name} does not fit BF16")
        return Tensor("BF16", (bits >> 16).astype(np.uint16))
    half = values.astype(np.float16)
    check(np.array_equal(half.astype(np.float32), values), f"{name}: its dequantized MXFP4 "
          "values do not fit F16, the other weights' dtype (convert the checkpoint to BF16 "
          "first)")
    return Tensor("F16", half)


def dequantize_mxfp4_experts(tensors, dtype):
    """Replaces, in `tensors` (name -> Tensor), each layer's experts.{gate_up_proj,down_proj}
    _blocks and _scales by the dequantized parameter (the module docstring's layout) in
    safetensors `dtype`; returns how many it replaced."""
    count = 0
    for name in sorted(n for n in tensors if MXFP4_EXPERTS.match(n)):
        param = name[:-len("_blocks")]
        check(param + "_scales" in tensors, f"the HF weights have {name} but no {param}_scales")
        blocks, scales = tensors.pop(name), tensors.pop(param + "_scales")
        check(blocks.dtype == scales.dtype == "U8" and blocks.array.ndim == 4, f"{name} and "
              f"{param}_scales should be U8 [experts, rows, blocks, 16] and [experts, rows, "
              f"blocks], are {blocks.dtype} {blocks.shape} and {scales.dtype} {scales.shape}")
        experts, rows, groups, _ = blocks.shape
        out = None
        for j in range(experts):  # an expert at a time: the f32 values of one matrix
            values = mxfp4_dequantize(blocks.array[j], scales.array[j])
            check(np.isfinite(values).all(), f"{name}: expert {j}'s values overflow (a scale of "
                  "255, E8M0's NaN, or above the f32 range)")
            part = as_dtype(np.ascontiguousarray(values.T), dtype, param)
            if out is None:
                out = np.empty((experts, groups * MXFP4_BLOCK, rows), part.array.dtype)
            out[j] = part.array
        tensors[param] = Tensor(part.dtype, out)
        count += 1
    left = sorted(n for n in tensors if n.endswith(("_blocks", "_scales")))
    if left:
        raise ConvertError(f"the HF weights have {left[0]} unpaired or outside the experts; "
                           "braid dequantizes GPT-OSS's MXFP4 experts (mlp.experts.gate_up_proj "
                           "and down_proj) alone")
    return count


def mxfp4_target_dtype(tensors):
    """The dtype the MXFP4 experts dequantize to: the other weights' (F32 where they are mixed)."""
    dtypes = {t.dtype for n, t in tensors.items() if not n.endswith(("_blocks", "_scales"))}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= {"F32", "BF16", "F16"} else "F32"


def check_quantization(hf, tensors):
    """GPT-OSS's quantization_config: none, or mxfp4 (the experts, dequantized on import)."""
    quant = hf.get("quantization_config")
    if quant and not is_mxfp4(quant):
        method = quant.get("quant_method") if isinstance(quant, dict) else json.dumps(quant)
        raise ConvertError(f"config.json: quantization_config ({method}) is not supported; "
                           "braid imports GPT-OSS's MXFP4 experts (quant_method mxfp4), else "
                           "F32, BF16 or F16 weights")
    return dequantize_mxfp4_experts(tensors, mxfp4_target_dtype(tensors))
