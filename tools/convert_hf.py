#!/usr/bin/env python3
"""Hugging Face Llama / Qwen2 / Qwen3 / GPT-2 directories to braid checkpoints and back.

  convert_hf.py import --hf-dir DIR --save CKPT   config.json + model.safetensors (or sharded,
                                                  model.safetensors.index.json) -> a braid
                                                  checkpoint at iteration 0, no optimizer state
  convert_hf.py export --load CKPT --hf-dir OUT   a braid checkpoint saved under any layout ->
                                                  config.json + model.safetensors that
                                                  transformers.AutoModelForCausalLM loads

The checkpoint format is csrc/engine/checkpoint.cpp's: <CKPT>/latest_checkpointed_iteration.txt,
<CKPT>/iter_0000000/metadata.json (config, layout, tensor index) and mp_rank_TT_PPP.safetensors
shards. An import writes the tp=1, pp=1 layout (one file holding every tensor, indexed as braid
indexes a tp=1 save); braid's loader reshards it to any layout (load it with --finetune or
--no-load-optim). An export assembles every tensor from the shards the index lists.

Tensors are moved as raw bytes (bf16 included): a round trip is bit-exact. Only numpy is needed.
docs/convert_hf.md has the name mapping and what is refused.
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, when imported
from safetensors_numpy import (STORAGE, SafetensorsError, Tensor,  # noqa: E402
                               read_safetensors, write_safetensors, write_text)

FLOAT_DTYPES = {"F32": "f32", "BF16": "bf16", "F16": "f16"}  # what braid's parameters can be
TORCH_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}

FORMAT = "braid-checkpoint"
FORMAT_VERSION = 1
TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
SHARD_FILE = "mp_rank_00_000.safetensors"


class ConvertError(Exception):
    """A one-line reason the conversion cannot go on."""


def check(ok, *message):
    if not ok:
        raise ConvertError("".join(str(m) for m in message))


# ---- braid's parameters (include/braid/model/parameters.h) ----------------------------------

def braid_specs(c):
    """[(name, shape, tp_dim)] of the whole model in flat-buffer order, as parameter_layout."""
    h, f = c["hidden_size"], c["ffn_hidden_size"]
    head_dim = head_width(c)
    q_out, kv_out = c["num_attention_heads"] * head_dim, c["num_query_groups"] * head_dim
    bias, layernorm = c["add_bias_linear"], c["normalization"] == "layernorm"
    qkv_bias = bias or c.get("add_qkv_bias", False)  # absent in checkpoints before it
    specs = [("model.embed_tokens.weight", [c["vocab_size"], h], 0)]
    if c["position_embedding"] == "learned":
        specs.append(("model.embed_positions.weight", [c["max_position_embeddings"], h], -1))

    def norm(prefix, size=h):
        specs.append((prefix + ".weight", [size], -1))
        if layernorm:
            specs.append((prefix + ".bias", [size], -1))

    for i in range(c["num_layers"]):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm")
        specs += [(p + "self_attn.q_proj.weight", [q_out, h], 0),
                  (p + "self_attn.k_proj.weight", [kv_out, h], 0),
                  (p + "self_attn.v_proj.weight", [kv_out, h], 0)]
        if qkv_bias:
            specs += [(p + "self_attn.q_proj.bias", [q_out], 0),
                      (p + "self_attn.k_proj.bias", [kv_out], 0),
                      (p + "self_attn.v_proj.bias", [kv_out], 0)]
        if c.get("qk_layernorm"):
            norm(p + "self_attn.q_norm", head_dim)
            norm(p + "self_attn.k_norm", head_dim)
        specs.append((p + "self_attn.o_proj.weight", [h, q_out], 1))
        if bias:
            specs.append((p + "self_attn.o_proj.bias", [h], -1))
        norm(p + "post_attention_layernorm")
        mlp_in = ["gate_proj", "up_proj"] if c["activation"] == "swiglu" else ["up_proj"]
        specs += [(p + f"mlp.{m}.weight", [f, h], 0) for m in mlp_in]
        if bias:
            specs += [(p + f"mlp.{m}.bias", [f], 0) for m in mlp_in]
        specs.append((p + "mlp.down_proj.weight", [h, f], 1))
        if bias:
            specs.append((p + "mlp.down_proj.bias", [h], -1))
    norm("model.norm")
    if not c["tie_embeddings"]:
        specs.append(("lm_head.weight", [c["vocab_size"], h], 0))
    return specs


# ---- configs ---------------------------------------------------------------------------------

def head_width(c):
    """A braid config's head width: kv_channels (absent in checkpoints before it) or
    hidden_size / num_attention_heads."""
    return c.get("kv_channels") or c["hidden_size"] // c["num_attention_heads"]


# Mistral without a sliding window (v0.2 on, NeMo) is Llama; Qwen2 is Llama with biases on q, k
# and v alone (braid's add_qkv_bias), Qwen3 Llama with a
# norm on each query and key head (qk_layernorm), StableLM Llama with LayerNorms (weight and
# bias), RoPE on a part of each head (rotary_percent) and optional q, k, v biases; the names
# are Llama's.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "StableLmForCausalLM": "stablelm", "GPT2LMHeadModel": "gpt2"}
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "stablelm")


def hf_architecture(hf):
    names = hf.get("architectures") or []
    for name in names:
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
                   "rotary_percent": 1.0}


def rope_of(hf, arch):
    """braid's RoPE fields from either config style (transformers 4: rope_theta and rope_scaling
    at the top level; 5: rope_parameters): plain RoPE or Llama 3.1's scaling (rope_type
    "llama3"); refuses any other variant."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling")
    if scaling and not params.get("factor"):  # transformers 4
        params.update(scaling)
        params.setdefault("rope_type", scaling.get("type"))
    kind = params.get("rope_type") or "default"
    if kind not in ("default", "llama3"):
        field = "rope_scaling" if scaling else "rope_parameters.rope_type"
        refuse(field, scaling or kind, "braid implements plain RoPE and Llama 3.1's scaling "
               "(rope_type llama3)")
    # StableLM's configs may leave it out: transformers then takes a quarter.
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor",
                                                        0.25 if arch == "stablelm" else 1.0))
    if arch != "stablelm" and factor not in (None, 1, 1.0):
        refuse("partial_rotary_factor", factor, f"transformers' {arch} turns the whole head "
               "(StableLmForCausalLM turns a part)")
    out = {"rope_theta": as_f32(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
           **NO_ROPE_SCALING, "rotary_percent": float(factor or 1.0)}
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


def hf_rope_parameters(c):
    """HF's rope_parameters for braid's RoPE fields (export)."""
    theta = f32_value(c["rope_theta"])
    partial = c.get("rotary_percent", 1.0)
    partial = {"partial_rotary_factor": partial} if partial != 1.0 else {}
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
        if hf.get("hidden_act", "silu") != "silu":
            refuse("hidden_act", hf["hidden_act"], "braid's Llama MLP is SwiGLU (silu)")
        # Qwen3's configs may leave head_dim out: transformers then takes 128; the others
        # take hidden_size / num_attention_heads.
        head_dim = hf.get("head_dim") or (128 if arch == "qwen3" else h // heads)
        attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
        if attention_bias != mlp_bias:
            refuse("attention_bias", attention_bias, f"mlp_bias is {json.dumps(mlp_bias)}; braid's "
                   "add_bias_linear gives every linear layer a bias or none")
        if arch in ("qwen2", "qwen3"):  # sliding_window is set, unused unless use_sliding_window
            if hf.get("use_sliding_window"):
                refuse("use_sliding_window", True, "braid attends to the whole context")
            other = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
            if other:
                refuse("layer_types", other[0], "braid attends to the whole context")
        elif hf.get("sliding_window", 4096 if arch == "mistral" else None):  # Mistral's default
            refuse("sliding_window", hf.get("sliding_window", 4096),
                   "braid attends to the whole context")
        if arch == "stablelm":
            if hf.get("qk_layernorm"):
                refuse("qk_layernorm", True, "StableLM's per-head norms have a weight per head; "
                       "braid's qk_layernorm shares one over the heads")
            if hf.get("use_parallel_residual"):
                refuse("use_parallel_residual", True, "braid's layers are sequential")
        layernorm = arch == "stablelm"
        return {"num_layers": hf["num_hidden_layers"], "hidden_size": h,
                "num_attention_heads": heads,
                "num_query_groups": hf.get("num_key_value_heads") or heads, "kv_channels": head_dim,
                "ffn_hidden_size": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
                "max_position_embeddings": hf["max_position_embeddings"],
                "normalization": "layernorm" if layernorm else "rmsnorm", "activation": "swiglu",
                "position_embedding": "rope", "add_bias_linear": bool(attention_bias),
                "add_qkv_bias": arch == "qwen2" or bool(hf.get("use_qkv_bias")),
                "qk_layernorm": arch == "qwen3",
                "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), **rope_of(hf, arch),
                "norm_eps": as_f32(hf.get("layer_norm_eps" if layernorm else "rms_norm_eps",
                                          1e-5 if layernorm else 1e-6)),
                "params_dtype": dtype}
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        refuse("activation_function", act, "braid's GELU is the tanh approximation (gelu_new)")
    if not hf.get("scale_attn_weights", True):
        refuse("scale_attn_weights", False, "braid scales attention by 1/sqrt(head_dim)")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        refuse("scale_attn_by_inverse_layer_idx", True, "braid scales every layer alike")
    h = hf["n_embd"]
    return {"num_layers": hf["n_layer"], "hidden_size": h, "num_attention_heads": hf["n_head"],
            "num_query_groups": hf["n_head"], "kv_channels": h // max(hf["n_head"], 1),
            "ffn_hidden_size": hf.get("n_inner") or 4 * h,
            "vocab_size": hf["vocab_size"], "max_position_embeddings": hf["n_positions"],
            "normalization": "layernorm", "activation": "gelu", "position_embedding": "learned",
            "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "rope_theta": 10000.0, **NO_ROPE_SCALING,
            "norm_eps": as_f32(hf.get("layer_norm_epsilon", 1e-5)),
            "params_dtype": dtype}


def as_f32(x):
    """The double braid's config_json writes for an f32 field (rope_theta, norm_eps)."""
    return float(np.float32(x))


def f32_value(x):
    """braid keeps rope_theta and norm_eps as f32: the shortest decimal that is that f32."""
    return float(repr(np.float32(x)).replace("np.float32(", "").rstrip(")"))


def braid_architecture(c):
    kind = (c["normalization"], c["activation"], c["position_embedding"])
    partial = c.get("rotary_percent", 1.0) != 1.0
    if kind == ("layernorm", "swiglu", "rope"):
        check(not c["add_bias_linear"] and not c.get("qk_layernorm"),
              "this braid model is StableLM shaped (layernorm, swiglu, rope) but has ",
              "add_bias_linear" if c["add_bias_linear"] else "qk_layernorm",
              "; StableLmForCausalLM has neither")
        return "stablelm"
    check(not partial or kind != ("rmsnorm", "swiglu", "rope"), "this braid model has "
          f"rotary_percent {c.get('rotary_percent')} with RMSNorm; of transformers' models only "
          "StableLmForCausalLM (LayerNorm) turns a part of each head")
    if kind == ("rmsnorm", "swiglu", "rope"):
        if c.get("qk_layernorm"):
            check(not c["add_bias_linear"] and not c.get("add_qkv_bias"),
                  "this braid model has qk_layernorm and biases; Qwen3ForCausalLM has neither "
                  "attention nor MLP biases")
            return "qwen3"
        return "qwen2" if c.get("add_qkv_bias") and not c["add_bias_linear"] else "llama"
    if kind == ("layernorm", "gelu", "learned"):
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
                       "StableLM: layernorm/swiglu/rope and GPT-2: layernorm/gelu/learned)")


LLAMA_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
              "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters",
              "rope_scaling", "hidden_act", "tie_word_embeddings")
SLIDING_KEYS = ("use_sliding_window", "sliding_window", "layer_types")
ARCH_KEYS = {  # the HF fields export sets from braid's config; the rest may come from the import
    "llama": LLAMA_KEYS + ("head_dim", "attention_bias", "mlp_bias"),
    "mistral": LLAMA_KEYS + ("head_dim", "sliding_window"),
    "qwen2": LLAMA_KEYS + ("head_dim",) + SLIDING_KEYS,
    "qwen3": LLAMA_KEYS + ("head_dim", "attention_bias") + SLIDING_KEYS,
    "stablelm": LLAMA_KEYS + ("layer_norm_eps", "use_qkv_bias", "qk_layernorm",
                              "use_parallel_residual", "partial_rotary_factor"),
    "gpt2": ("architectures", "model_type", "n_embd", "n_inner", "n_layer", "n_head",
             "vocab_size", "n_positions", "n_ctx", "layer_norm_epsilon", "activation_function",
             "tie_word_embeddings", "scale_attn_weights", "scale_attn_by_inverse_layer_idx"),
}
HF_NAMES = {arch: name for name, arch in ARCHITECTURES.items()}


def hf_config_from_braid(c, arch, torch_dtype, imported):
    if arch in LLAMA_LIKE:
        rope = hf_rope_parameters(c)
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
                   "mistral": {"head_dim": head_dim, "sliding_window": None, "rms_norm_eps": eps},
                   "qwen2": {"head_dim": head_dim, "use_sliding_window": False,
                             "rms_norm_eps": eps},
                   "qwen3": {"head_dim": head_dim, "attention_bias": False,
                             "use_sliding_window": False, "rms_norm_eps": eps},
                   # transformers 4 reads the factor at the top level, 5 in rope_parameters
                   "stablelm": {"layer_norm_eps": eps, "use_qkv_bias": c.get("add_qkv_bias"),
                                "qk_layernorm": False, "use_parallel_residual": False,
                                "partial_rotary_factor": c.get("rotary_percent", 1.0)}}[arch])
        if arch == "stablelm":  # else transformers 5 takes a quarter
            rope["partial_rotary_factor"] = hf["partial_rotary_factor"]
        if rope["rope_type"] == "llama3":  # transformers 4 reads the scaling from rope_scaling
            hf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    else:
        hf = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
              "n_embd": c["hidden_size"], "n_inner": c["ffn_hidden_size"],
              "n_layer": c["num_layers"], "n_head": c["num_attention_heads"],
              "vocab_size": c["vocab_size"], "n_positions": c["max_position_embeddings"],
              "layer_norm_epsilon": f32_value(c["norm_eps"]), "activation_function": "gelu_new",
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


# ---- tensor names ----------------------------------------------------------------------------

def hf_to_braid(hf, arch, c):
    """HF tensors (name -> Tensor) -> braid's names and layout; consumes what it maps."""
    take = hf.pop
    if arch in LLAMA_LIKE:
        out = {}
        for name, _, _ in braid_specs(c):
            check(name in hf, f"the HF weights have no {name}")
            out[name] = take(name)
        if c["tie_embeddings"] and "lm_head.weight" in hf:  # a tied copy saved anyway
            check(np.array_equal(hf["lm_head.weight"].array, out["model.embed_tokens.weight"].array),
                  "tie_word_embeddings is true but lm_head.weight differs from embed_tokens")
            take("lm_head.weight")
        for name in [n for n in hf if n.endswith("rotary_emb.inv_freq")]:  # old buffers
            take(name)
        return out

    # GPT-2: optional "transformer." prefix; Conv1D weights are [in, out]; c_attn is [q | k | v].
    def get(name):
        for key in ("transformer." + name, name):
            if key in hf:
                return take(key)
        raise ConvertError(f"the HF weights have no transformer.{name}")

    h = c["hidden_size"]
    out = {"model.embed_tokens.weight": get("wte.weight"),
           "model.embed_positions.weight": get("wpe.weight")}
    for i in range(c["num_layers"]):
        s, b = f"h.{i}.", f"model.layers.{i}."
        for key in ("attn.bias", "attn.masked_bias"):  # causal-mask buffers of old checkpoints
            for prefix in ("transformer." + s, s):
                hf.pop(prefix + key, None)
        qkv_w, qkv_b = get(s + "attn.c_attn.weight"), get(s + "attn.c_attn.bias")
        check(qkv_w.shape == [h, 3 * h], f"{s}attn.c_attn.weight is {qkv_w.shape}, config.json "
              f"says {[h, 3 * h]}")
        check(qkv_b.shape == [3 * h], f"{s}attn.c_attn.bias is {qkv_b.shape}, config.json says "
              f"{[3 * h]}")
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            out[b + f"self_attn.{proj}.weight"] = qkv_w.like(qkv_w.array[:, j * h:(j + 1) * h].T)
            out[b + f"self_attn.{proj}.bias"] = qkv_b.like(qkv_b.array[j * h:(j + 1) * h])
        for hf_name, braid_name in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            out[b + braid_name + ".weight"] = get(s + hf_name + ".weight")
            out[b + braid_name + ".bias"] = get(s + hf_name + ".bias")
        for hf_name, braid_name in (("attn.c_proj", "self_attn.o_proj"), ("mlp.c_fc", "mlp.up_proj"),
                                    ("mlp.c_proj", "mlp.down_proj")):
            w = get(s + hf_name + ".weight")
            check(w.array.ndim == 2, f"{s}{hf_name}.weight is {w.shape}, expected a matrix")
            out[b + braid_name + ".weight"] = w.like(w.array.T)
            out[b + braid_name + ".bias"] = get(s + hf_name + ".bias")
    out["model.norm.weight"], out["model.norm.bias"] = get("ln_f.weight"), get("ln_f.bias")
    if not c["tie_embeddings"]:
        check("lm_head.weight" in hf, "the HF weights have no lm_head.weight "
              "(tie_word_embeddings is false)")
        out["lm_head.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in hf:
        check(np.array_equal(hf["lm_head.weight"].array, out["model.embed_tokens.weight"].array),
              "tie_word_embeddings is true but lm_head.weight differs from wte")
        take("lm_head.weight")
    return out


def braid_to_hf(t, arch, c):
    """braid's tensors -> HF names and layout (the inverse of hf_to_braid)."""
    if arch in LLAMA_LIKE:
        return dict(t)
    out = {"transformer.wte.weight": t["model.embed_tokens.weight"],
           "transformer.wpe.weight": t["model.embed_positions.weight"],
           "transformer.ln_f.weight": t["model.norm.weight"],
           "transformer.ln_f.bias": t["model.norm.bias"]}
    for i in range(c["num_layers"]):
        s, b = f"transformer.h.{i}.", f"model.layers.{i}."
        q = [t[b + f"self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
        check(len({x.dtype for x in q}) == 1, f"layer {i}: q, k, v weights differ in dtype")
        out[s + "attn.c_attn.weight"] = q[0].like(np.concatenate([x.array for x in q], axis=0).T)
        qb = [t[b + f"self_attn.{p}.bias"] for p in ("q_proj", "k_proj", "v_proj")]
        out[s + "attn.c_attn.bias"] = qb[0].like(np.concatenate([x.array for x in qb]))
        for hf_name, braid_name in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            out[s + hf_name + ".weight"] = t[b + braid_name + ".weight"]
            out[s + hf_name + ".bias"] = t[b + braid_name + ".bias"]
        for hf_name, braid_name in (("attn.c_proj", "self_attn.o_proj"), ("mlp.c_fc", "mlp.up_proj"),
                                    ("mlp.c_proj", "mlp.down_proj")):
            w = t[b + braid_name + ".weight"]
            out[s + hf_name + ".weight"] = w.like(w.array.T)
            out[s + hf_name + ".bias"] = t[b + braid_name + ".bias"]
    if not c["tie_embeddings"]:
        out["lm_head.weight"] = t["lm_head.weight"]
    return out


# ---- reading an HF directory -----------------------------------------------------------------

def read_hf_config(hf_dir):
    check(os.path.isdir(hf_dir), f"{hf_dir}: no such directory")
    config_path = os.path.join(hf_dir, "config.json")
    check(os.path.isfile(config_path), f"{hf_dir}: no config.json")
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except ValueError as e:
        raise ConvertError(f"{config_path}: not valid JSON ({e})")
    check(isinstance(hf, dict), f"{config_path}: not a JSON object")
    return hf


def read_hf_weights(hf_dir):
    """name -> Tensor over every weight file."""
    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = ["model.safetensors"]
    elif os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        check(weight_map, f"{index}: empty weight_map")
        files = sorted(set(weight_map.values()))
    else:
        bins = [n for n in os.listdir(hf_dir) if n.endswith(".bin")]
        raise ConvertError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json" +
                           (" (only PyTorch .bin weights, which this tool does not read: "
                            "re-save them with safe_serialization=True)" if bins else ""))
    tensors = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        check(os.path.isfile(path), f"{hf_dir}: {name} is missing")
        part, _ = read_safetensors(path)
        for key in part:
            check(key not in tensors, f"{hf_dir}: {key} is in more than one weight file")
        tensors.update(part)
    return tensors


def weights_dtype(tensors, hf_dir):
    dtypes = {t.dtype for t in tensors.values()}
    for d in dtypes:
        check(d in FLOAT_DTYPES, f"{hf_dir}: weights of dtype {d} (braid's parameters are F32, "
              "BF16 or F16)")
    if len(dtypes) == 1:
        return FLOAT_DTYPES[dtypes.pop()]
    return "f32"  # mixed: braid computes in f32; every tensor is still stored as it came


# ---- import ----------------------------------------------------------------------------------

def checkpoint_metadata(config, specs, hf):
    index = {}
    for name, shape, tp_dim in specs:  # stored_slices at tp = 1
        index[name] = {"shape": shape, "split_dim": tp_dim,
                       "shards": [{"file": SHARD_FILE, "start": 0,
                                   "length": shape[tp_dim] if tp_dim >= 0 else shape[0]}]}
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "iteration": 0, "config": config,
            "layout": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                       "data_parallel_size": 1, "virtual_pipeline_stages": 1,
                       "use_distributed_optimizer": False},
            "trainer": {"iteration": 0, "skipped_iterations": 0, "optimizer_steps": 0},
            "lr_schedule": {"lr": 0.0, "min_lr": 0.0, "warmup_iters": 0, "decay_iters": 0,
                            "style": "cosine", "lr_now": 0.0},
            "loss_scaler": {"scale": 1.0, "growth_tracker": 0, "hysteresis_tracker": 0},
            "consumed_samples": 0, "optimizer": False, "tensors": index,
            "hf_config": hf}


def import_hf(hf_dir, save):
    hf = read_hf_config(hf_dir)
    arch = hf_architecture(hf)
    tensors = read_hf_weights(hf_dir)
    config = braid_config_from_hf(hf, arch, weights_dtype(tensors, hf_dir))
    for key in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                "max_position_embeddings"):
        check(isinstance(config[key], int) and config[key] > 0, f"config.json: {key} should be a "
              f"positive integer, is {config[key]!r}")
    check(arch in LLAMA_LIKE or config["hidden_size"] % config["num_attention_heads"] == 0,
          "config.json: the hidden size is not a multiple of the number of attention heads")
    check(isinstance(config["kv_channels"], int) and config["kv_channels"] > 0,
          f"config.json: head_dim should be a positive integer, is {config['kv_channels']!r}")
    check(arch not in LLAMA_LIKE or config["kv_channels"] % 2 == 0,
          f"config.json: head_dim {config['kv_channels']} is odd; RoPE rotates pairs of a "
          "head's channels")
    left = dict(tensors)  # hf_to_braid takes what it maps; what is left is unexpected
    braid_tensors = hf_to_braid(left, arch, config)
    if left:
        more = "" if len(left) == 1 else f", and {len(left) - 1} more"
        raise ConvertError(f"{hf_dir}: unexpected tensor {sorted(left)[0]} (not part of a {arch} "
                           f"model with this config.json){more}")
    specs = braid_specs(config)
    for name, shape, _ in specs:
        got = braid_tensors[name].shape
        check(got == shape, f"{name}: the weights hold {got}, config.json makes it {shape}")
    check(set(braid_tensors) == {s[0] for s in specs}, "internal: mapped tensors differ from specs")

    if os.path.exists(os.path.join(save, TRACKER)):
        raise ConvertError(f"{save} already holds a checkpoint; import into a new directory")
    iter_dir = os.path.join(save, "iter_0000000")
    tmp_dir = iter_dir + ".tmp"
    os.makedirs(save, exist_ok=True)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    write_safetensors(os.path.join(tmp_dir, SHARD_FILE), braid_tensors)
    meta = checkpoint_metadata(config, specs, hf)
    # As braid writes it (nlohmann::json: sorted keys), so the two look alike.
    write_text(os.path.join(tmp_dir, METADATA), json.dumps(meta, indent=1, sort_keys=True) + "\n")
    if os.path.exists(iter_dir):
        shutil.rmtree(iter_dir)
    os.replace(tmp_dir, iter_dir)
    write_text(os.path.join(save, TRACKER), "0\n")
    return iter_dir, arch, config


# ---- export ----------------------------------------------------------------------------------

def read_checkpoint(load, iteration=None):
    """(metadata, name -> Tensor of every model tensor, assembled from its shards)."""
    check(os.path.isdir(load), f"{load}: no such directory")
    if iteration is None:
        tracker = os.path.join(load, TRACKER)
        check(os.path.isfile(tracker), f"{load}: no {TRACKER} (nothing saved there)")
        text = open(tracker).read().strip()
        check(text.isdigit(), f"{tracker} should hold an iteration number, holds {text!r}")
        iteration = int(text)
    path = os.path.join(load, f"iter_{iteration:07d}")
    check(os.path.isdir(path), f"{path} does not exist")
    meta_path = os.path.join(path, METADATA)
    check(os.path.isfile(meta_path), f"{path}: no {METADATA}")
    with open(meta_path) as f:
        meta = json.load(f)
    check(meta.get("format") == FORMAT, f"{meta_path}: not a braid checkpoint")
    check(meta.get("format_version", 0) <= FORMAT_VERSION, f"{meta_path}: format version "
          f"{meta.get('format_version')} is newer than this tool reads ({FORMAT_VERSION})")
    files = {}

    def shard(file, name):
        if file not in files:
            full = os.path.join(path, file)
            check(os.path.isfile(full), f"{path}: {file} is missing")
            files[file] = read_safetensors(full)[0]
        check(name in files[file], f"{path}/{file} has no {name}, the index says it does")
        return files[file][name]

    tensors = {}
    for name, entry in meta["tensors"].items():
        if name.startswith("optimizer."):
            continue
        shape, dim = entry["shape"], entry["split_dim"]
        whole, covered = None, np.zeros(shape[max(dim, 0)], dtype=bool)
        for s in entry["shards"]:
            part = shard(s["file"], name)
            start, length = (s["start"], s["length"]) if dim >= 0 else (0, shape[0])
            want = list(shape)
            want[max(dim, 0)] = length
            check(part.shape == want if dim >= 0 else part.shape == shape,
                  f"{path}/{s['file']}: {name} holds {part.shape}, the index says "
                  f"{want if dim >= 0 else shape}")
            if whole is None:
                whole = Tensor(part.dtype, np.empty(shape, dtype=STORAGE[part.dtype]))
            check(part.dtype == whole.dtype, f"{path}: the shards of {name} differ in dtype")
            check(not covered[start:start + length].any(), f"{path}: shards of {name} overlap")
            covered[start:start + length] = True
            index = [slice(None)] * len(shape)
            index[max(dim, 0)] = slice(start, start + length)
            whole.array[tuple(index)] = part.array
        check(whole is not None and covered.all(), f"{path}: the shards of {name} do not cover it")
        tensors[name] = whole
    return meta, tensors


def export_hf(load, out, iteration=None):
    meta, tensors = read_checkpoint(load, iteration)
    config = meta["config"]
    arch = braid_architecture(config)
    if arch == "llama" and not config["add_bias_linear"] and \
            hf_architecture_or_none(meta.get("hf_config") or {}) == "mistral":
        arch = "mistral"  # an imported Mistral goes back as one
    specs = braid_specs(config)
    for name, shape, _ in specs:
        check(name in tensors, f"{load}: the checkpoint has no {name}")
        check(tensors[name].shape == shape, f"{load}: {name} is {tensors[name].shape}, the "
              f"config makes it {shape}")
    extra = set(tensors) - {s[0] for s in specs}
    if extra:
        raise ConvertError(f"{load}: unexpected tensor {sorted(extra)[0]} for this config")
    hf_tensors = braid_to_hf(tensors, arch, config)
    dtypes = {t.dtype for t in hf_tensors.values()}
    torch_dtype = TORCH_NAMES.get(dtypes.pop(), "float32") if len(dtypes) == 1 else "float32"
    hf = hf_config_from_braid(config, arch, torch_dtype, meta.get("hf_config"))
    os.makedirs(out, exist_ok=True)
    write_safetensors(os.path.join(out, "model.safetensors"), hf_tensors, {"format": "pt"})
    stale = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(stale):  # transformers would read the old shards through it
        os.remove(stale)
    write_text(os.path.join(out, "config.json"), json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return arch, config


# ---- command line ----------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See docs/convert_hf.md.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("import", help="HF directory -> braid checkpoint")
    p.add_argument("--hf-dir", required=True, help="config.json + model.safetensors[.index.json]")
    p.add_argument("--save", required=True, help="checkpoint directory to create")
    p = sub.add_parser("export", help="braid checkpoint -> HF directory")
    p.add_argument("--load", required=True, help="checkpoint directory (any layout)")
    p.add_argument("--hf-dir", required=True, help="output directory")
    p.add_argument("--ckpt-step", type=int, default=None,
                   help="iteration to export (default: the tracker file's)")
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            where, arch, c = import_hf(args.hf_dir, args.save)
            print(f"imported {arch} ({c['num_layers']} layers, hidden {c['hidden_size']}, "
                  f"{c['params_dtype']}) into {where}")
        else:
            arch, c = export_hf(args.load, args.hf_dir, args.ckpt_step)
            print(f"exported {arch} ({c['num_layers']} layers, hidden {c['hidden_size']}) "
                  f"to {args.hf_dir}")
    except (ConvertError, SafetensorsError) as e:
        print(f"convert_hf.py {args.command}: error: {e}", file=sys.stderr)
        return 1
    except (KeyError, TypeError) as e:
        print(f"convert_hf.py {args.command}: error: config.json or metadata.json lacks or "
              f"mistypes a field: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
