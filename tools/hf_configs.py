"""Hugging Face config.json <-> braid's checkpoint config (docs/convert_hf.md): which HF
architectures braid imports, what each config field becomes, and what is refused."""

import json
import math
import os

import numpy as np


class ConvertError(Exception):
    """A one-line reason the conversion cannot go on."""


def check(ok, *message):
    if not ok:
        raise ConvertError("".join(str(m) for m in message))


JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "true or false",
              int: "a number", float: "a number", type(None): "null"}


def read_json(path, what="a JSON object", expected=dict):
    """The JSON document in file `path`; ConvertError naming the file where it is not a readable
    JSON file holding `what` (an instance of `expected`)."""
    check(not os.path.isdir(path), f"{path} is a directory, expected a file holding {what}")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ConvertError(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError as e:  # invalid JSON or UTF-8 (truncated, empty, ...)
        raise ConvertError(f"{path}: not valid JSON ({e}), expected {what}") from None
    check(isinstance(doc, expected), f"{path}: expected {what}, holds "
          f"{JSON_KINDS.get(type(doc), type(doc).__name__)}")
    return doc


def check_new_hf_dir(out):
    """Refuses an export into `out` where it is not a directory or already holds an HF model
    (config.json, weights): nothing is overwritten."""
    check(not os.path.exists(out) or os.path.isdir(out), f"{out} is a file, not a directory")
    held = sorted(n for n in os.listdir(out) if n == "config.json" or n.endswith(
        (".safetensors", ".safetensors.index.json"))) if os.path.isdir(out) else []
    check(not held, f"{out} already holds a Hugging Face model ({', '.join(held)}); export into "
          "a new directory")


def head_width(c):
    """A braid config's head width: kv_channels (absent in checkpoints before it) or
    hidden_size / num_attention_heads."""
    return c.get("kv_channels") or c["hidden_size"] // c["num_attention_heads"]


# Mistral is Llama with a sliding window on every layer (v0.1; none from v0.2 on, NeMo); Qwen2
# is Llama with biases on q, k and v alone (braid's add_qkv_bias), Qwen3 Llama with a
# norm on each query and key head (qk_layernorm), StableLM Llama with LayerNorms (weight and
# bias), RoPE on a part of each head (rotary_percent) and optional q, k, v biases; the names
# are Llama's. Mixtral is Mistral with every MLP a mixture of experts, Qwen2-MoE Qwen2 and
# Qwen3-MoE Qwen3 with the MLPs of the layers mlp_only_layers and decoder_sparse_step pick
# mixtures of experts, Qwen2-MoE's with a gated shared expert (hf_moe.py). dots1 is Qwen3 and
# GLM-4.5 Llama with q, k, v biases, RoPE on half of each head and optional q/k norms, both
# with DeepSeek-V3's sigmoid-routed experts after first_k_dense_replace dense layers
# (hf_deepseek.py). DeepSeek-V3 is Llama's norms and MLPs with multi-latent attention and those
# experts, DeepSeek-V2 the same attention with experts routed by a softmax (hf_deepseek.py).
# GPT-OSS is Llama with biases, attention sinks, windows on some layers, YaRN and gated quick-GELU
# experts with biases (hf_gpt_oss.py).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "StableLmForCausalLM": "stablelm", "NemotronForCausalLM": "nemotron",
                 "GPT2LMHeadModel": "gpt2", "MixtralForCausalLM": "mixtral",
                 "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "Dots1ForCausalLM": "dots1", "Glm4MoeForCausalLM": "glm4_moe",
                 "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                 "GptOssForCausalLM": "gpt_oss"}
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "stablelm", "nemotron", "mixtral",
              "qwen2_moe", "qwen3_moe", "dots1", "glm4_moe", "deepseek_v2", "deepseek_v3",
              "gpt_oss")
# braid's gated activations (TransformerConfig::gated_activation): fc1 is [gate_proj; up_proj].
GATED = ("swiglu", "quick_geglu")
# Known architectures braid cannot hold, with why (none at present).
REFUSED = {}
# Nemotron-4 is Llama with LayerNorm1P (LayerNorms whose weights hold gamma - 1: braid's
# zero_centered_gamma), an ungated squared-ReLU MLP and RoPE on half of each head.
PARTIAL_ROTARY_DEFAULT = {"stablelm": 0.25, "nemotron": 0.5,  # transformers' where it is absent
                          "glm4_moe": 0.5}
# transformers' rope_theta where it is absent (else 1e4)
THETA_DEFAULT = {"mixtral": 1000000.0, "gpt_oss": 150000.0}


def hf_architecture(hf):
    names = hf.get("architectures") or []
    for name in names:
        if name in REFUSED:
            raise ConvertError(f"unsupported architecture {name}: {REFUSED[name]}")
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not names and hf.get("model_type") in ARCHITECTURES.values():
        return hf["model_type"]
    what = ", ".join(names) if names else f"model_type {hf.get('model_type')!r}"
    raise ConvertError(f"unsupported architecture {what}: braid imports "
                       f"{' and '.join(ARCHITECTURES)}")


def refuse(field, value, why):
    raise ConvertError(f"config.json: {field} = {json.dumps(value)} is not supported ({why})")


NO_ROPE_SCALING = {"rope_scaling_factor": 0.0, "rope_low_freq_factor": 1.0,
                   "rope_high_freq_factor": 4.0, "rope_original_max_position_embeddings": 8192,
                   "rope_yarn_factor": 0.0, "rope_yarn_beta_fast": 32.0, "rope_yarn_beta_slow": 1.0,
                   "rope_yarn_mscale": 1.0, "rope_yarn_mscale_all_dim": 0.0, "rotary_percent": 1.0,
                   "rope_linear_factor": 0.0}


# Architectures whose YaRN (rope_type "yarn") imports, their module adding its fields
# (hf_deepseek.yarn_config_from_hf).
YARN_ARCHITECTURES = ("deepseek_v2", "deepseek_v3", "gpt_oss")


def rope_parameters_of(hf):
    """(the RoPE parameters, the field they came from) as transformers 5 reads either config
    style (transformers 4: rope_theta and rope_scaling at the top level; 5: rope_parameters):
    rope_scaling, when there is one, in place of rope_parameters; rope_type from its old name
    type; rope_theta from the top level where the dict has none."""
    scaling = hf.get("rope_scaling")
    params = dict(scaling or hf.get("rope_parameters") or {})
    params.setdefault("rope_type", params.get("type") or "default")
    params["rope_type"] = params["rope_type"] or "default"
    return params, "rope_scaling" if scaling else "rope_parameters"


def rope_of(hf, arch):
    """braid's RoPE fields from either config style (rope_parameters_of): plain RoPE, linear
    position interpolation (rope_type "linear") or Llama 3.1's scaling (rope_type "llama3"), and
    for YARN_ARCHITECTURES YaRN's frequencies' theta and partial factor (the rest: their
    module); refuses any other variant."""
    params, field = rope_parameters_of(hf)
    kind = params["rope_type"]
    if kind not in ("default", "linear", "llama3") and \
            not (kind == "yarn" and arch in YARN_ARCHITECTURES):
        refuse(field if field == "rope_scaling" else "rope_parameters.rope_type",
               hf["rope_scaling"] if field == "rope_scaling" else kind,
               "braid implements plain RoPE, linear interpolation (rope_type linear) and Llama "
               "3.1's scaling (rope_type llama3)"
               + (", and YaRN for DeepSeek-V2, -V3 and GPT-OSS" if kind == "yarn" else ""))
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor",
                                                        PARTIAL_ROTARY_DEFAULT.get(arch, 1.0)))
    if arch not in PARTIAL_ROTARY_DEFAULT and factor not in (None, 1, 1.0):
        refuse("partial_rotary_factor", factor, f"transformers' {arch} turns the whole head "
               "(StableLM, Nemotron and GLM-4.5 turn a part)")
    theta = params.get("rope_theta", hf.get("rope_theta", THETA_DEFAULT.get(arch, 10000.0)))
    out = {"rope_theta": as_f32(theta),
           **NO_ROPE_SCALING, "rotary_percent": float(factor or 1.0)}
    if kind == "linear":
        check("factor" in params, "config.json: rope_type linear without factor")
        check(params["factor"] > 0, f"config.json: rope_type linear with factor "
              f"{params['factor']} (it must be positive)")
        out["rope_linear_factor"] = as_f32(params["factor"])
    if kind == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings"):
            check(key in params, f"config.json: rope_type llama3 without {key}")
        out.update({"rope_scaling_factor": as_f32(params["factor"]),
                    "rope_low_freq_factor": as_f32(params["low_freq_factor"]),
                    "rope_high_freq_factor": as_f32(params["high_freq_factor"]),
                    "rope_original_max_position_embeddings":
                        int(params["original_max_position_embeddings"])})
    return out


def yarn_mscale(factor, mscale):
    """YaRN's g: transformers' get_mscale and yarn_get_mscale, megatron-core's _yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor, mscale, mscale_all_dim):
    """What braid (and megatron-core) multiply RoPE's cos and sin by: g(mscale) /
    g(mscale_all_dim), from the f32 values braid keeps (TransformerConfig.rope_attention_factor)."""
    factor = as_f32(factor)
    return yarn_mscale(factor, as_f32(mscale)) / yarn_mscale(factor, as_f32(mscale_all_dim))


def hf_yarn_parameters(c):
    """HF's YaRN parameters (rope_parameters, rope_scaling) for a braid config with YaRN; the
    attention_factor too where transformers' own rule would not give braid's (mscale other than
    1 without mscale_all_dim, or mscale 0), and truncate false for an unrounded correction
    range (rope_yarn_truncate false)."""
    factor, mscale = c["rope_yarn_factor"], c["rope_yarn_mscale"]
    all_dim = c["rope_yarn_mscale_all_dim"]
    out = {"factor": f32_value(factor),
           "original_max_position_embeddings": c["rope_original_max_position_embeddings"],
           "beta_fast": f32_value(c["rope_yarn_beta_fast"]),
           "beta_slow": f32_value(c["rope_yarn_beta_slow"]),
           "mscale": f32_value(mscale), "mscale_all_dim": f32_value(all_dim)}
    transformers_rule = (yarn_attention_factor(factor, mscale, all_dim) if mscale and all_dim
                         else yarn_mscale(as_f32(factor), 1.0))
    braids = yarn_attention_factor(factor, mscale, all_dim)
    if transformers_rule != braids:
        out["attention_factor"] = braids
    if not c.get("rope_yarn_truncate", True):  # absent in checkpoints before it
        out["truncate"] = False
    return out


def hf_rope_parameters(c, arch):
    """HF's rope_parameters for braid's RoPE fields (export)."""
    theta = f32_value(c["rope_theta"])
    partial = c.get("rotary_percent", 1.0)
    partial = {"partial_rotary_factor": partial} if partial != 1.0 else {}
    if c.get("rope_yarn_factor"):  # absent in checkpoints before it
        check(arch in YARN_ARCHITECTURES, f"this braid model has YaRN RoPE and exports as {arch}; "
              "convert_hf.py moves YaRN with DeepSeek-V3 and -V2 (multi-latent attention) "
              "and GPT-OSS only")
        return {"rope_type": "yarn", "rope_theta": theta, **partial, **hf_yarn_parameters(c)}
    if c.get("rope_linear_factor"):  # absent in checkpoints before it
        return {"rope_type": "linear", "rope_theta": theta, **partial,
                "factor": f32_value(c["rope_linear_factor"])}
    if not c.get("rope_scaling_factor"):
        return {"rope_type": "default", "rope_theta": theta, **partial}
    return {"rope_type": "llama3", "rope_theta": theta, **partial,
            "factor": f32_value(c["rope_scaling_factor"]),
            "low_freq_factor": f32_value(c["rope_low_freq_factor"]),
            "high_freq_factor": f32_value(c["rope_high_freq_factor"]),
            "original_max_position_embeddings": c["rope_original_max_position_embeddings"]}


def braid_config_from_hf(hf, arch, dtype):
    """braid's config_json fields for an HF config.json."""
    if arch in LLAMA_LIKE:
        h, heads = hf["hidden_size"], hf["num_attention_heads"]
        act = "relu2" if arch == "nemotron" else "silu"
        if hf.get("hidden_act", act) != act:
            refuse("hidden_act", hf["hidden_act"], f"transformers' {arch} MLP with {act} is "
                   "what braid has")
        # Qwen3's configs may leave head_dim out: transformers then takes 128; the others
        # take hidden_size / num_attention_heads.
        head_dim = hf.get("head_dim") or (128 if arch == "qwen3" else h // heads)
        attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
        if arch == "dots1" and attention_bias:
            refuse("attention_bias", attention_bias, "Dots1ForCausalLM then has biases on q, k, "
                   "v and o but none in its MLPs; braid's add_bias_linear gives every linear "
                   "layer a bias, add_qkv_bias q, k and v alone")
        qkv_bias_only = arch == "glm4_moe" and bool(attention_bias)  # GLM's o_proj has none
        if qkv_bias_only:
            attention_bias = False
        if attention_bias != mlp_bias:
            refuse("attention_bias", attention_bias, f"mlp_bias is {json.dumps(mlp_bias)}; braid's "
                   "add_bias_linear gives every linear layer a bias or none")
        if arch == "llama" and hf.get("sliding_window"):
            refuse("sliding_window", hf["sliding_window"], "LlamaForCausalLM has no window")
        if arch == "stablelm":
            if hf.get("qk_layernorm"):
                refuse("qk_layernorm", True, "StableLM's per-head norms have a weight per head; "
                       "braid's qk_layernorm shares one over the heads")
            if hf.get("use_parallel_residual"):
                refuse("use_parallel_residual", True, "braid's layers are sequential")
        layernorm = arch in ("stablelm", "nemotron")
        eps_key = {"stablelm": "layer_norm_eps", "nemotron": "norm_eps"}.get(arch, "rms_norm_eps")
        eps_default = 1e-5 if layernorm or arch == "glm4_moe" else 1e-6
        return {**window_of(hf, arch), "num_layers": hf["num_hidden_layers"], "hidden_size": h,
                "num_attention_heads": heads,
                "num_query_groups": hf.get("num_key_value_heads") or heads, "kv_channels": head_dim,
                "ffn_hidden_size": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
                "max_position_embeddings": hf["max_position_embeddings"],
                "normalization": "layernorm" if layernorm else "rmsnorm",
                "activation": "squared_relu" if arch == "nemotron" else "swiglu",
                "position_embedding": "rope", "add_bias_linear": bool(attention_bias),
                # Qwen2-MoE's qkv_bias: transformers 5's switch (4's q, k, v always have them)
                "add_qkv_bias": arch == "qwen2" or bool(hf.get("use_qkv_bias")) or
                                (arch == "qwen2_moe" and bool(hf.get("qkv_bias", True))) or
                                qkv_bias_only,
                "qk_layernorm": arch in ("qwen3", "qwen3_moe", "dots1") or
                                (arch == "glm4_moe" and bool(hf.get("use_qk_norm"))),
                "zero_centered_gamma": arch == "nemotron",
                "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), **rope_of(hf, arch),
                "norm_eps": as_f32(hf.get(eps_key, eps_default)),
                "params_dtype": dtype}
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        refuse("activation_function", act, "braid's GELU is the tanh form (gelu_new, "
               "gelu_pytorch_tanh) or the exact one (gelu)")
    if not hf.get("scale_attn_weights", True):
        refuse("scale_attn_weights", False, "braid scales attention by 1/sqrt(head_dim)")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        refuse("scale_attn_by_inverse_layer_idx", True, "braid scales every layer alike")
    h = hf["n_embd"]
    return {"num_layers": hf["n_layer"], "hidden_size": h, "num_attention_heads": hf["n_head"],
            "num_query_groups": hf["n_head"], "kv_channels": h // max(hf["n_head"], 1),
            "ffn_hidden_size": hf.get("n_inner") or 4 * h,
            "vocab_size": hf["vocab_size"], "max_position_embeddings": hf["n_positions"],
            "normalization": "layernorm", "position_embedding": "learned",
            "activation": "gelu_exact" if act == "gelu" else "gelu",
            "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "rope_theta": 10000.0, **NO_ROPE_SCALING,
            "norm_eps": as_f32(hf.get("layer_norm_epsilon", 1e-5)),
            "params_dtype": dtype}


def window_of(hf, arch):
    """braid's window_size and window_layers for a Llama-like config: Mistral's and Mixtral's
    sliding_window on every layer (where the field is left out, 4096 for Mistral and none for
    Mixtral, as transformers has it; null: none); Qwen3-MoE's with use_sliding_window, on every
    layer (transformers 5 builds one mask for all); Qwen2's, Qwen3's and Qwen2-MoE's with
    use_sliding_window, on the layers layer_types names sliding_attention (or, without
    layer_types, as transformers 5 fills it in: for Qwen2 and Qwen3 from max_window_layers on,
    for Qwen2-MoE every other layer from the first, below max_window_layers); dots1's
    sliding_window (4096 where left out; null: none), always on, on the layers layer_types names
    (without it, from max_window_layers, 62 where left out, on)."""
    none = {"window_size": -1, "window_layers": []}
    layers = hf["num_hidden_layers"]
    if arch in ("mistral", "mixtral", "qwen3_moe"):
        if arch == "qwen3_moe":
            window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
        else:
            window = hf.get("sliding_window", 4096 if arch == "mistral" else None)
        kinds = ["sliding_attention"] * layers
    elif arch in ("qwen2", "qwen3", "qwen2_moe", "dots1"):
        if arch == "dots1":
            window, from_layer = hf.get("sliding_window", 4096), hf.get("max_window_layers", 62)
        else:
            window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
            from_layer = hf.get("max_window_layers", 28)
        below = arch == "qwen2_moe"
        kinds = hf.get("layer_types") or [
            "sliding_attention" if window and (
                i % 2 == 0 and i < from_layer if below else i >= from_layer)
            else "full_attention" for i in range(layers)]
        check(len(kinds) == layers, f"config.json: layer_types has {len(kinds)} entries for "
              f"num_hidden_layers {layers}")
        other = [k for k in kinds if k not in ("full_attention", "sliding_attention")]
        if other:
            refuse("layer_types", other[0], "braid's layers attend to all of the context or to "
                   "a sliding window")
        if "sliding_attention" in kinds and not window:
            refuse("layer_types", "sliding_attention", "sliding_window is null, so transformers "
                   "has no window for those layers" if arch == "dots1" else "use_sliding_window "
                   "is false, so transformers has no window for those layers")
    else:
        return none
    if not window or "sliding_attention" not in kinds:
        return none
    check(isinstance(window, int) and window >= 1,
          f"config.json: sliding_window = {json.dumps(window)} must be a positive integer")
    layer_list = [int(k == "sliding_attention") for k in kinds]
    return {"window_size": window - 1, "window_layers": [] if all(layer_list) else layer_list}


def braid_window(c):
    """A braid config's window as (W, per-layer list), None without one: no window_size, or a
    window_layers list that windows no layer."""
    window = c.get("window_size", -1)
    layers = c.get("window_layers") or [1] * c["num_layers"] if window >= 0 else []
    return (window, layers) if any(layers) else None


def hf_window(c, arch):
    """The HF fields of a braid config's window: Mistral's and Mixtral's sliding_window,
    Qwen3-MoE's use_sliding_window and sliding_window (every layer: hf_moe.py checks), Qwen2's,
    Qwen3's and Qwen2-MoE's use_sliding_window, sliding_window, layer_types (and for Qwen2 and
    Qwen3 max_window_layers where the windowed layers are the last ones, as transformers before
    layer_types reads it); dots1's sliding_window and layer_types (no switch)."""
    one_switch = arch in ("mistral", "mixtral")
    if arch == "dots1" and braid_window(c) is None:  # sliding_window kept: no layer uses it
        return {"layer_types": ["full_attention"] * c["num_layers"]}
    if braid_window(c) is None:
        return {"sliding_window": None} if one_switch else {"use_sliding_window": False}
    (window, pattern), layers = braid_window(c), c["num_layers"]
    if one_switch:
        return {"sliding_window": window + 1}
    if arch == "qwen3_moe":
        return {"use_sliding_window": True, "sliding_window": window + 1}
    first = pattern.index(1)
    hf = {"use_sliding_window": True, "sliding_window": window + 1,
          "layer_types": ["sliding_attention" if w else "full_attention" for w in pattern]}
    if arch == "dots1":
        del hf["use_sliding_window"]
    if arch != "qwen2_moe" and pattern == [0] * first + [1] * (layers - first):
        hf["max_window_layers"] = first
    return hf


def as_f32(x):
    """The double braid's config_json writes for an f32 field (rope_theta, norm_eps)."""
    return float(np.float32(x))


def f32_value(x):
    """braid keeps rope_theta and norm_eps as f32: the shortest decimal that is that f32."""
    return float(repr(np.float32(x)).replace("np.float32(", "").rstrip(")"))


def braid_architecture(c):
    kind = (c["normalization"], c["activation"], c["position_embedding"])
    partial = c.get("rotary_percent", 1.0) != 1.0
    window = braid_window(c)
    check(window is None or kind == ("rmsnorm", "swiglu", "rope"),
          "this braid model has a sliding window; of the architectures braid exports only "
          "Mistral, Qwen2 and Qwen3 (RMSNorm, SwiGLU, RoPE) have one")
    if kind == ("layernorm", "swiglu", "rope"):
        check(not c["add_bias_linear"] and not c.get("qk_layernorm"),
              "this braid model is StableLM shaped (layernorm, swiglu, rope) but has ",
              "add_bias_linear" if c["add_bias_linear"] else "qk_layernorm",
              "; StableLmForCausalLM has neither")
        check(head_width(c) * c["num_attention_heads"] == c["hidden_size"],
              "this braid model is StableLM shaped but its heads are ", head_width(c), " wide "
              "(kv_channels), not hidden_size / num_attention_heads; StableLmForCausalLM's are")
        return "stablelm"
    if kind == ("layernorm", "squared_relu", "rope"):
        check(not c.get("qk_layernorm") and (c["add_bias_linear"] or not c.get("add_qkv_bias")),
              "this braid model is Nemotron shaped (layernorm, squared_relu, rope) but has ",
              "qk_layernorm" if c.get("qk_layernorm") else "q/k/v biases alone",
              "; NemotronForCausalLM has neither")
        return "nemotron"
    check(not partial or kind != ("rmsnorm", "swiglu", "rope"), "this braid model has "
          f"rotary_percent {c.get('rotary_percent')} with RMSNorm; of transformers' models only "
          "StableLM and Nemotron (LayerNorm) turn a part of each head")
    if kind == ("rmsnorm", "swiglu", "rope"):
        if c.get("qk_layernorm"):
            check(not c["add_bias_linear"] and not c.get("add_qkv_bias"),
                  "this braid model has qk_layernorm and biases; Qwen3ForCausalLM has neither "
                  "attention nor MLP biases")
            return "qwen3"
        if c.get("add_qkv_bias") and not c["add_bias_linear"]:
            return "qwen2"
        if window is None:
            return "llama"
        # A window: Mistral's on every layer, Qwen2's on some (export gives it q, k, v biases
        # of zero).
        check(not c["add_bias_linear"], "this braid model has a sliding window and biases on "
              "every linear layer; MistralForCausalLM and Qwen2ForCausalLM have neither")
        return "mistral" if all(window[1]) else "qwen2"
    if kind in (("layernorm", "gelu", "learned"), ("layernorm", "gelu_exact", "learned")):
        check(not c.get("qk_layernorm"), "this braid model is GPT-2 shaped but has qk_layernorm; "
              "GPT2LMHeadModel has no query/key norms")
        check(c["add_bias_linear"], "this braid model is GPT-2 shaped but add_bias_linear is false; "
              "GPT2LMHeadModel always has biases")
        check(c["num_query_groups"] == c["num_attention_heads"],
              "this braid model is GPT-2 shaped but has num_query_groups ",
              c["num_query_groups"], " != num_attention_heads ", c["num_attention_heads"],
              "; GPT2LMHeadModel has no grouped-query attention")
        check(head_width(c) * c["num_attention_heads"] == c["hidden_size"],
              "this braid model is GPT-2 shaped but its heads are ", head_width(c), " wide "
              "(kv_channels), not hidden_size / num_attention_heads; GPT2LMHeadModel's are")
        return "gpt2"
    raise ConvertError("no Hugging Face architecture for a braid model with normalization "
                       f"{c['normalization']}, activation {c['activation']} and position_embedding "
                       f"{c['position_embedding']} (export knows Llama: rmsnorm/swiglu/rope, "
                       "StableLM: layernorm/swiglu/rope, Nemotron: layernorm/squared_relu/rope "
                       "and GPT-2: layernorm/gelu/learned)")


LLAMA_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
              "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters",
              "rope_scaling", "hidden_act", "tie_word_embeddings")
SLIDING_KEYS = ("use_sliding_window", "sliding_window", "layer_types", "max_window_layers")
SIGMOID_MOE_KEYS = ("n_routed_experts", "num_local_experts", "num_experts_per_tok",
                    "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                    "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")
# DeepSeek-V2's: n_group and topk_group only where topk_method is group_limited_greedy (export
# writes them then; else an import's, which build nothing, come back as they were)
DEEPSEEK_V2_MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "n_shared_experts", "first_k_dense_replace", "topk_method",
                        "norm_topk_prob", "routed_scaling_factor")
LATENT_KEYS = ("head_dim", "attention_bias", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim", "qk_head_dim")
ARCH_KEYS = {  # the HF fields export sets from braid's config; the rest may come from the import
    "llama": LLAMA_KEYS + ("head_dim", "attention_bias", "mlp_bias"),
    "mistral": LLAMA_KEYS + ("head_dim", "sliding_window"),
    "qwen2": LLAMA_KEYS + ("head_dim",) + SLIDING_KEYS,
    "qwen3": LLAMA_KEYS + ("head_dim", "attention_bias") + SLIDING_KEYS,
    "mixtral": LLAMA_KEYS + ("head_dim", "sliding_window", "num_local_experts", "num_experts",
                             "num_experts_per_tok"),
    "qwen2_moe": LLAMA_KEYS + ("head_dim", "qkv_bias", "num_experts", "num_local_experts",
                               "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                               "shared_expert_intermediate_size", "decoder_sparse_step",
                               "mlp_only_layers") + SLIDING_KEYS,
    "qwen3_moe": LLAMA_KEYS + ("head_dim", "attention_bias", "num_experts", "num_local_experts",
                               "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                               "decoder_sparse_step", "mlp_only_layers", "use_sliding_window",
                               "sliding_window"),
    "dots1": LLAMA_KEYS + ("head_dim", "attention_bias", "layer_types") + SIGMOID_MOE_KEYS,
    "glm4_moe": LLAMA_KEYS + ("head_dim", "attention_bias", "use_qk_norm", "partial_rotary_factor",
                              "num_nextn_predict_layers", "num_mtp_layers") + SIGMOID_MOE_KEYS,
    "deepseek_v2": LLAMA_KEYS + LATENT_KEYS + ("mlp_bias",) + DEEPSEEK_V2_MOE_KEYS,
    "deepseek_v3": LLAMA_KEYS + LATENT_KEYS + ("rope_interleave", "num_nextn_predict_layers",
                                               "num_mtp_layers") + SIGMOID_MOE_KEYS,
    "stablelm": LLAMA_KEYS + ("layer_norm_eps", "use_qkv_bias", "qk_layernorm",
                              "use_parallel_residual", "partial_rotary_factor"),
    "nemotron": LLAMA_KEYS + ("head_dim", "attention_bias", "mlp_bias", "norm_eps",
                              "partial_rotary_factor"),
    "gpt2": ("architectures", "model_type", "n_embd", "n_inner", "n_layer", "n_head",
             "vocab_size", "n_positions", "n_ctx", "layer_norm_epsilon", "activation_function",
             "tie_word_embeddings", "scale_attn_weights", "scale_attn_by_inverse_layer_idx"),
}
HF_NAMES = {arch: name for name, arch in ARCHITECTURES.items()}


def hf_config_from_braid(c, arch, torch_dtype, imported):
    if arch in LLAMA_LIKE:
        rope = hf_rope_parameters(c, arch)
        hf = {"architectures": [HF_NAMES[arch]], "model_type": arch,
              "hidden_size": c["hidden_size"], "intermediate_size": c["ffn_hidden_size"],
              "num_hidden_layers": c["num_layers"],
              "num_attention_heads": c["num_attention_heads"],
              "num_key_value_heads": c["num_query_groups"],
              "vocab_size": c["vocab_size"], "max_position_embeddings": c["max_position_embeddings"],
              "rope_theta": rope["rope_theta"],
              "rope_parameters": rope, "hidden_act": "silu",
              "tie_word_embeddings": c["tie_embeddings"]}
        head_dim, eps = head_width(c), f32_value(c["norm_eps"])
        hf.update({"llama": {"head_dim": head_dim, "attention_bias": c["add_bias_linear"],
                             "mlp_bias": c["add_bias_linear"], "rms_norm_eps": eps},
                   "mistral": {"head_dim": head_dim, "rms_norm_eps": eps},
                   "qwen2": {"head_dim": head_dim, "rms_norm_eps": eps},
                   "qwen3": {"head_dim": head_dim, "attention_bias": False, "rms_norm_eps": eps},
                   "mixtral": {"head_dim": head_dim, "rms_norm_eps": eps},
                   "qwen2_moe": {"head_dim": head_dim, "rms_norm_eps": eps},
                   "qwen3_moe": {"head_dim": head_dim, "attention_bias": False,
                                 "rms_norm_eps": eps},
                   "dots1": {"head_dim": head_dim, "attention_bias": False, "rms_norm_eps": eps},
                   "glm4_moe": {"head_dim": head_dim, "rms_norm_eps": eps,
                                "partial_rotary_factor": c.get("rotary_percent", 1.0)},
                   # its attention's fields: hf_deepseek.hf_latent_attention_config
                   "deepseek_v2": {"attention_bias": False, "mlp_bias": False,
                                   "rms_norm_eps": eps},
                   "deepseek_v3": {"attention_bias": False, "rms_norm_eps": eps},
                   # transformers 4 reads the factor at the top level, 5 in rope_parameters
                   "stablelm": {"layer_norm_eps": eps, "use_qkv_bias": c.get("add_qkv_bias"),
                                "qk_layernorm": False, "use_parallel_residual": False,
                                "partial_rotary_factor": c.get("rotary_percent", 1.0)},
                   "nemotron": {"head_dim": head_dim, "attention_bias": c["add_bias_linear"],
                                "mlp_bias": c["add_bias_linear"], "norm_eps": eps,
                                "hidden_act": "relu2",
                                "partial_rotary_factor": c.get("rotary_percent", 1.0)}}[arch])
        if arch in ("mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "dots1"):
            hf.update(hf_window(c, arch))
        if arch in PARTIAL_ROTARY_DEFAULT:  # else transformers 5 takes its default
            rope["partial_rotary_factor"] = hf["partial_rotary_factor"]
        if rope["rope_type"] != "default":  # transformers 4 reads the scaling from rope_scaling
            hf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
            if rope["rope_type"] == "yarn":  # DeepSeek's config.json and own code name it type
                hf["rope_scaling"]["type"] = "yarn"
    else:
        hf = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
              "n_embd": c["hidden_size"], "n_inner": c["ffn_hidden_size"],
              "n_layer": c["num_layers"], "n_head": c["num_attention_heads"],
              "vocab_size": c["vocab_size"], "n_positions": c["max_position_embeddings"],
              "layer_norm_epsilon": f32_value(c["norm_eps"]),
              "activation_function": "gelu" if c["activation"] == "gelu_exact" else "gelu_new",
              "tie_word_embeddings": c["tie_embeddings"], "scale_attn_weights": True,
              "scale_attn_by_inverse_layer_idx": False}
    hf["torch_dtype"] = torch_dtype
    # Fields braid does not keep (token ids, dropout, ...) from the config an import stored.
    if imported and hf_architecture_or_none(imported) == arch:
        merged = {k: v for k, v in imported.items() if k not in ARCH_KEYS[arch]}
        merged.pop("dtype", None)
        merged.update(hf)
        hf = merged
    return hf


def hf_architecture_or_none(hf):
    try:
        return hf_architecture(hf)
    except ConvertError:
        return None
